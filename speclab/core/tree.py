"""`DraftTree`: what a drafter proposes. A chain is a tree with one child per node.

Nodes are stored flat in topological order (a parent always comes before its children); the root is
the last committed token and is not a node (parent -1 means "child of the root").
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kernels.reference import ancestor_mask
from speclab.core.sampling import draw as draw_children
from speclab.core.sampling import spread

_EMPTY: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # `DraftTree.empty`'s tensors


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [n] long: the drafted token of each node
    parents: torch.Tensor  # [n] long: parent node index, -1 for children of the root
    draft_probs: torch.Tensor  # [n] float: q(token) under the drafter's distribution at the parent
    # Full draft distributions q at the root and at every node ([n+1, V], row 0 = root, row i+1 = node i),
    # present when children were *sampled* i.i.d. from q (then verification uses min(1, p/q) and the
    # residual max(p - q, 0)). Absent for deterministic drafts (argmax, top-k, lookup), which verification
    # treats as point masses (accept with p(x), residual p with x removed).
    draft_dists: torch.Tensor | None = None
    # Per-node integers a drafter attaches for the trace ([n] each; speclab.trace.NODE_EXTRAS: SpecBlock's block
    # and rank bucket). Verification never reads them.
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    # FlashHead (speclab.drafters.flashhead): per node, the candidate token ids (target ids) of the row that drafted it
    # ([n, C], -1 = none); the engine then records whether the target's token was among them (`in_cands`)
    cands: torch.Tensor | None = None
    # How sampled siblings were drawn from their parent's q (`speclab.core.sampling.draw`): "iid" (SpecInfer) or
    # "wor" (without replacement: verification then also takes a rejected token out of q). A chain has one child
    # per node, where the two are the same test.
    scheme: str = "iid"
    # A merged tree (`merge`: several drafters' proposals at one root, verified in one call) holds q per *node*
    # instead of per parent: `child_dists` [n, V] the q node i was drawn from, and `child_groups` [n] how: POINT (a
    # point mass: a zero row), IID (drawn i.i.d. from its row) or g >= 0 (drawn without replacement with the
    # siblings of the same group g: verification takes a rejected sibling's token out of the group's q).
    child_dists: torch.Tensor | None = None
    child_groups: torch.Tensor | None = None

    def __post_init__(self):
        self._anc: torch.Tensor | None = None
        self._chain: bool | None = None
        self._depth: torch.Tensor | None = None

    @property
    def depth(self) -> torch.Tensor:
        """[n] long: depth of every node (children of the root have depth 1)."""
        if self._depth is None:
            self._depth = (torch.arange(1, len(self) + 1, device=self.parents.device) if self._chain
                           else depths(self.parents))
        return self._depth

    @property
    def ancestors(self) -> torch.Tensor:
        """[n, n] bool: ancestors[i, j] = node j is on the path from the root to node i (i included)."""
        if self._anc is None:
            self._anc = ancestor_mask(self.parents)
        return self._anc

    @classmethod
    def empty(cls, device="cpu") -> DraftTree:
        """A draft of no nodes (an AR round, a drafter with nothing to propose): a new tree over zero-length tensors
        made once per device (three tensor constructors a round were 30-40 us of an AR round's 3 ms)."""
        dev = torch.device(device)
        if dev not in _EMPTY:
            none = torch.zeros(0, dtype=torch.long, device=dev)
            _EMPTY[dev] = (none, none.clone(), torch.zeros(0, device=dev))
        tokens, parents, probs = _EMPTY[dev]
        tree = cls(tokens, parents, probs)
        tree._chain = True
        return tree

    @classmethod
    def chain(cls, tokens: torch.Tensor, draft_probs: torch.Tensor,
              draft_dists: torch.Tensor | None = None) -> DraftTree:
        n = tokens.numel()
        tree = cls(tokens, torch.arange(-1, n - 1, device=tokens.device), draft_probs, draft_dists)
        tree._chain = True
        return tree

    def to(self, device) -> DraftTree:
        if self.tokens.device == torch.device(device):
            return self
        def to(t):
            return None if t is None else t.to(device)
        tree = DraftTree(self.tokens.to(device), self.parents.to(device), self.draft_probs.to(device),
                         to(self.draft_dists), self.extra, to(self.cands), self.scheme, to(self.child_dists),
                         to(self.child_groups))
        tree._chain = self._chain
        return tree

    def __len__(self) -> int:
        return self.tokens.numel()

    def head(self, n: int) -> DraftTree:
        """A chain's first n nodes (their q rows and per-node extras with them): a draft cut before verification, as
        a drafter that stopped there would have proposed it (DSpark's scheduler, `speclab.serve.policies`)."""
        assert self.is_chain, "only a chain is cut to a prefix"
        if n >= len(self):
            return self
        dists = None if self.draft_dists is None else torch.cat([self.draft_dists[:n],
                                                                  torch.zeros_like(self.draft_dists[:1])])
        tree = DraftTree.chain(self.tokens[:n], self.draft_probs[:n], dists)
        tree.extra = {k: v[:n] for k, v in self.extra.items()}
        tree.cands = None if self.cands is None else self.cands[:n]
        tree.scheme = self.scheme
        return tree

    @property
    def sampled(self) -> bool:
        """Some node was drawn from a distribution q (not a point mass)."""
        return self.draft_dists is not None or self.child_dists is not None

    @property
    def tested_q(self) -> torch.Tensor:
        """[n] q(x) of every node as a sampled verification tests it (min(1, p(x) / q(x))): its draft probability
        where it was drawn from q, 1 for a point mass."""
        if self.child_groups is not None:
            return torch.where(self.child_groups == POINT, 1.0, self.draft_probs.float())
        return self.draft_probs.float() if self.draft_dists is not None else torch.ones_like(self.draft_probs.float())

    @property
    def is_chain(self) -> bool:
        if self._chain is None:
            self._chain = bool((self.parents == torch.arange(-1, len(self) - 1, device=self.parents.device)).all())
        return self._chain

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to `node`."""
        path = []
        parents = self.parents.tolist()
        while node >= 0:
            path.append(node)
            node = parents[node]
        return path[::-1]


POINT, IID = -2, -1  # `DraftTree.child_groups` of a point-mass node and of a node drawn i.i.d.


def merge(trees: list[DraftTree]) -> tuple[DraftTree, list[torch.Tensor]]:
    """One tree from several drafters' proposals at the same root (a merged arm, `speclab.routing.arms`), and for
    each member the merged index of each of its nodes. Point-mass nodes with the same token under the same merged
    parent become one node (shared prefixes merged: a looked-up continuation that an EAGLE-3 path already holds
    costs no row); a sampled node never merges (it is a candidate of its own q). Members keep their order, and so
    do siblings: verification tests the earlier member's candidates first. When any member sampled, every node
    carries the q it was drawn from (`DraftTree.child_dists`), so the recursive verifier tests each candidate
    against its own drafter's q, point masses and sampled nodes side by side (SpecInfer's multi-step speculative
    sampling over several draft models; without replacement within one member's siblings, Jeon et al. 2024). A
    merge of one non-empty tree is that tree."""
    full = [i for i, t in enumerate(trees) if len(t)]
    dev = trees[0].tokens.device
    if len(full) <= 1:
        keep = full[0] if full else 0
        return trees[keep], [torch.arange(len(t), device=dev) if i == keep else torch.zeros(0, dtype=torch.long,
                                                                                               device=dev)
                             for i, t in enumerate(trees)]
    tokens: list[int] = []
    parents: list[int] = []
    src: list[tuple[int, int]] = []  # (member, its node) of every merged node
    index: dict[tuple[int, int], int] = {}  # (merged parent, token) -> merged node, over point masses
    maps = []
    for m, t in enumerate(trees):
        point = not t.sampled
        mine: list[int] = []
        for x, par in zip(t.tokens.tolist(), t.parents.tolist()):
            key = (mine[par] if par >= 0 else -1, x)
            if point and key in index:
                mine.append(index[key])
                continue
            if point:
                index[key] = len(tokens)
            mine.append(len(tokens))
            tokens.append(x)
            parents.append(key[0])
            src.append((m, len(mine) - 1))
        maps.append(torch.tensor(mine, dtype=torch.long, device=dev))
    member = torch.tensor([m for m, _ in src])
    node = torch.tensor([i for _, i in src])
    probs = torch.cat([t.draft_probs.float().to(dev) for t in trees])
    offsets = torch.tensor([0] + [len(t) for t in trees]).cumsum(0)[:-1]
    tree = DraftTree(torch.tensor(tokens, dtype=torch.long, device=dev), torch.tensor(parents, dtype=torch.long,
                                                                                       device=dev),
                     probs[(offsets[member] + node).to(dev)])
    if any(t.sampled for t in trees):
        vocab = next(t.draft_dists.shape[-1] for t in trees if t.draft_dists is not None)
        tree.child_dists = torch.zeros(len(tokens), vocab, device=dev)
        tree.child_groups = torch.full((len(tokens),), POINT, dtype=torch.long, device=dev)
        for m, t in enumerate(trees):
            if t.draft_dists is None or not len(t):
                continue
            at = maps[m]  # a sampled member's nodes never merge: one merged node each
            tree.child_dists[at] = t.draft_dists[t.parents + 1].float().to(dev)
            tree.child_groups[at] = m if t.scheme == "wor" else IID
    return tree, maps


def depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of every node (children of the root have depth 1), by pointer doubling: no per-node Python loop."""
    n = parents.numel()
    depth = torch.ones(n, dtype=torch.long, device=parents.device)
    anc = parents.clone()
    while bool((anc >= 0).any()):
        has = anc >= 0
        safe = anc.clamp(min=0)
        depth = depth + torch.where(has, depth[safe], torch.zeros_like(depth))
        anc = torch.where(has, anc[safe], anc)
    return depth


def tree_attention_mask(anc: torch.Tensor, past_len: int, dtype: torch.dtype, with_root: bool) -> torch.Tensor:
    """Additive mask [1, 1, q, past_len + q] for verifying a tree (ancestor matrix `anc`) after `past_len` cached
    tokens.

    With `with_root`, the first query is the root token (the pending last committed token) and every node
    also sees it. 0 = attend, finfo(dtype).min = blocked (a bool or 0/1 mask is silently wrong with eager).
    """
    if with_root:
        n = anc.shape[0]
        full = torch.zeros(n + 1, n + 1, dtype=torch.bool, device=anc.device)
        full[:, 0] = True
        full[1:, 1:] = anc
        anc = full
    q = anc.shape[0]
    allowed = torch.cat([torch.ones(q, past_len, dtype=torch.bool, device=anc.device), anc], dim=1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=anc.device).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.view(1, 1, q, past_len + q)


def tree_position_ids(depth: torch.Tensor, past_len: int, with_root: bool) -> torch.Tensor:
    """Positions of the verification inputs: the root at past_len, a node at past_len + depth (- 1 without root)."""
    if with_root:
        return torch.cat([torch.zeros(1, dtype=torch.long, device=depth.device), depth]) + past_len
    return depth - 1 + past_len


def check_dynamic_tree(method: str, name: str, value: int, depth: int, topk: int) -> None:
    """A dynamic tree (`dynamic_tree`) of `depth` levels expands topk + (depth - 1) topk^2 candidates: refused
    (InvalidInput) beyond 64 verifications' worth of nodes."""
    from speclab.checks import MAX_TREE_NODES
    from speclab.errors import InvalidInput
    expanded = topk + (depth - 1) * topk ** 2
    if topk > 1 and expanded > 64 * MAX_TREE_NODES:
        raise InvalidInput(f"{method} tree: {name} {value} x tree_topk {topk} expands {expanded} candidate nodes, more "
                           f"than {64 * MAX_TREE_NODES}; lower {name} or tree_topk")


@dataclass(frozen=True)
class TreeDraw:
    """How a tree's children are drawn under sampling (`dynamic_tree`): `q(logp [f, V]) -> [f, V]` the drafter's
    distribution (`speclab.core.sampling.draft_probs`), the scheme (`speclab.core.sampling.draw`: "iid" or "wor"),
    the decode's generator and the target's vocabulary size (q rows of a reduced draft vocabulary are spread into
    it for verification)."""
    q: Callable[[torch.Tensor], torch.Tensor]
    scheme: str
    generator: torch.Generator | None
    vocab: int


def dynamic_tree(root_logp: torch.Tensor, expand, depth: int, k: int, total: int, state,
                 to_target: torch.Tensor | None = None, root_cands: torch.Tensor | None = None,
                 sampled: TreeDraw | None = None) -> DraftTree:
    """EAGLE-2's dynamic draft tree, for any drafter that can score children of a set of nodes.

    The root's top-k children form the frontier; then `depth - 1` times the frontier's nodes are expanded by
    their top-k children and the k best candidates (cumulative log-probability) become the next frontier. At the
    end the best `total` nodes of everything expanded form the tree: a score only falls along a path, so the kept
    set is closed under ancestors (ties broken against depth). `root_logp` [V] are the root's children's
    log-probs; `expand(level, tokens [f], state) -> (logp [f, V], new_state)` scores the children of frontier
    nodes at depth `level` (their tokens in target ids, their per-node `state`: a tuple of [f, ...] tensors, or
    None); the state of a kept candidate is its parent's row of `new_state`. `to_target` maps the drafter's
    vocabulary ids to the target's (a reduced draft vocabulary). Deterministic: verification treats the nodes
    as point masses, lossless under sampling as well. With a FlashHead, `root_cands` [C] are the root row's
    candidates and `expand` returns a third item, the frontier rows' candidates [f, C]: each node keeps those of
    the row that drafted it (`DraftTree.cands`).

    `sampled` (a sampled decode): each expanded node's k children are drawn from its q instead (`TreeDraw`), the
    frontier is still the k best by cumulative log q, and the tree is the first `total` nodes in the order they were
    drawn (level by level), not the best: how many children a node keeps must not depend on what they are, or the
    verified distribution is no longer the target's (the selection bias of DSpark's Appendix A). Each node keeps q of
    its children (`DraftTree.draft_dists`) for verification."""
    dev = root_logp.device
    ids = (lambda i: to_target[i]) if to_target is not None else (lambda i: i)

    def children(logp: torch.Tensor):  # [f, V] -> log q(child) [f, k], child ids [f, k], q [f, V] (sampled)
        if sampled is None:
            return *logp.topk(min(k, logp.shape[-1]), -1), None
        q = sampled.q(logp)
        idx = draw_children(q, k, sampled.scheme, sampled.generator)
        lq = torch.where(idx >= 0, q.gather(-1, idx.clamp(min=0)).log(), float("-inf"))
        return lq, idx.clamp(min=0), q

    vals, idx, q = children(root_logp[None])
    vals, idx = vals[0], idx[0]
    tok_l, par_l, lq_l, score_l, dep_l = [ids(idx)], [torch.full_like(idx, -1)], [vals], [vals], [torch.ones_like(idx)]
    q_l = [] if q is None else [(torch.tensor([-1], device=dev), q)]  # (node ids, their children's q rows)
    n = idx.numel()
    cand_l = None if root_cands is None else [root_cands[None].expand(n, -1)]
    front = torch.arange(n, device=dev)
    if sampled is not None:  # a child without mass (fewer than k tokens have some) is never expanded, nor kept
        front = front[vals > float("-inf")]
        state = None if state is None else tuple(t[front] for t in state)
    front_tok, front_score = tok_l[0][front], vals[front]
    for level in range(1, depth):
        if front.numel() == 0:
            break
        logp, out_state, *cands = expand(level, front_tok, state)
        vals, idx, q = children(logp)  # [f, k]
        if q is not None:
            q_l.append((front, q))
        if cand_l is not None:
            cand_l.append(cands[0].repeat_interleave(vals.shape[1], 0))
        cand = (front_score[:, None] + vals).flatten()
        kids = ids(idx.flatten())
        tok_l.append(kids)
        par_l.append(front.repeat_interleave(vals.shape[1]))
        lq_l.append(vals.flatten())
        score_l.append(cand)
        dep_l.append(torch.full_like(kids, level + 1))
        best = cand.topk(min(k, cand.numel())).indices
        if sampled is not None:
            best = best[cand[best] > float("-inf")]
        rows = best // vals.shape[1]
        front, front_tok, front_score = n + best, kids[best], cand[best]
        state = None if out_state is None else tuple(t[rows] for t in out_state)
        n += cand.numel()
    tokens, parents, logq = torch.cat(tok_l), torch.cat(par_l), torch.cat(lq_l)
    if sampled is None:
        score = torch.cat(score_l) - 1e-6 * torch.cat(dep_l)  # strictly falling along a path: closed under ancestors
        keep = score.topk(min(total, n)).indices.sort().values  # pool order is topological
    else:  # the first `total` drawn (pool order: level by level), never chosen by what was drawn
        keep = (logq > float("-inf")).nonzero().flatten()[:total]
    remap = torch.full((n,), -1, dtype=torch.long, device=dev)
    remap[keep] = torch.arange(keep.numel(), device=dev)
    par = parents[keep]
    tree = DraftTree(tokens[keep], torch.where(par >= 0, remap[par.clamp(min=0)], par), logq[keep].exp(),
                     cands=None if cand_l is None else torch.cat(cand_l)[keep])
    if sampled is not None:
        tree.draft_dists = _node_dists(q_l, remap, keep.numel(), sampled.vocab, to_target)
        tree.scheme = sampled.scheme
    return tree


def _node_dists(q_l, remap: torch.Tensor, n: int, vocab: int, to_target: torch.Tensor | None) -> torch.Tensor:
    """[n + 1, vocab]: row 0 the root's children's q, row i + 1 node i's (zeros for a node not expanded), from the
    (pool node ids [f] (-1: the root), q rows [f, V]) of each expansion, the draft vocabulary spread into the
    target's."""
    out = torch.zeros(n + 1, vocab, device=q_l[0][1].device)
    for nodes, q in q_l:
        rows = torch.where(nodes >= 0, remap[nodes.clamp(min=0)] + 1, 0)
        kept = (nodes < 0) | (rows > 0)
        q, rows = q[kept], rows[kept]
        out[rows] = q.float() if to_target is None else spread(q, to_target, vocab)
    return out


def tree_rows(ancestors: torch.Tensor, depth: torch.Tensor, past: int, with_root: bool) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    """(pos [n + 1], visible [n + 1, past + q]) of one extra row per row of a verification batch of a draft tree
    (ancestors [n, n], depth [n]) after `past` cached tokens (`speclab.core.protocol.ExtraRows`; ConFu's
    contemplate rows): row 0 follows the root (the last committed token, cached at past - 1, or leading the batch
    when `with_root`), row i + 1 follows node i and sees what node i saw (the committed tokens, the root, its path)
    and node i itself. q = n + with_root batch rows."""
    n, dev = depth.numel(), depth.device
    q = n + int(with_root)
    visible = torch.zeros(n + 1, past + q, dtype=torch.bool, device=dev)
    visible[:, :past] = True
    if with_root:
        visible[:, past] = True
        visible[1:, past + 1:] = ancestors
    else:
        visible[1:, past:] = ancestors
    root_pos = past + 1 if with_root else past  # the root sits at past (with_root) or past - 1
    pos = torch.cat([torch.tensor([root_pos], device=dev), root_pos + depth.to(dev)])
    return pos, visible
