"""`DraftTree`: what a drafter proposes. A chain is a tree with one child per node.

Nodes are stored flat in topological order (a parent always comes before its children); the root is
the last committed token and is not a node (parent -1 means "child of the root").
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


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
            self._anc = ancestor_matrix(self.parents)
        return self._anc

    @classmethod
    def empty(cls, device="cpu") -> "DraftTree":
        z = torch.zeros(0, dtype=torch.long, device=device)
        return cls.chain(z, torch.zeros(0, device=device))

    @classmethod
    def chain(cls, tokens: torch.Tensor, draft_probs: torch.Tensor, draft_dists: torch.Tensor | None = None) -> "DraftTree":
        n = tokens.numel()
        tree = cls(tokens, torch.arange(-1, n - 1, device=tokens.device), draft_probs, draft_dists)
        tree._chain = True
        return tree

    def to(self, device) -> "DraftTree":
        if self.tokens.device == torch.device(device):
            return self
        tree = DraftTree(self.tokens.to(device), self.parents.to(device), self.draft_probs.to(device),
                         None if self.draft_dists is None else self.draft_dists.to(device))
        tree._chain = self._chain
        return tree

    def __len__(self) -> int:
        return self.tokens.numel()

    @property
    def sampled(self) -> bool:
        return self.draft_dists is not None

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


def ancestor_matrix(parents: torch.Tensor) -> torch.Tensor:
    """A[i, j] = node j is node i or one of its ancestors ([n, n] bool), by repeated squaring of the parent relation."""
    n = parents.numel()
    eye = torch.eye(n, dtype=torch.bool, device=parents.device)
    if n == 0:
        return eye
    a = eye.clone()
    has = parents >= 0
    a[has.nonzero().flatten(), parents[has]] = True
    for _ in range(max(1, (n - 1).bit_length())):
        a = a | (a.float() @ a.float()).bool()
    return a


def tree_attention_mask(anc: torch.Tensor, past_len: int, dtype: torch.dtype, with_root: bool) -> torch.Tensor:
    """Additive mask [1, 1, q, past_len + q] for verifying a tree (ancestor matrix `anc`) after `past_len` cached tokens.

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
