"""Standalone speculative sampling (SpS): a smaller HF model with the target's tokenizer drafts a chain of
k tokens, or a top-k tree (each level expands the frontier by its top-k children and keeps the best
`tree_topk` by cumulative log-probability, EAGLE-style, one draft call per level).

A chain can stop early: after a token the draft gave a probability below `stop_prob` (the draft is
unsure, so the next tokens are unlikely to be accepted and their draft calls are wasted). This is what
Hugging Face's assisted generation does by default (`assistant_confidence_threshold` = 0.4).

The draft model's KV cache follows the committed sequence: `catch_up` forwards the backlog (one call, logits
of its last row only: the root's draft distribution), and `commit` keeps the KV of the accepted draft tokens
that were forwarded while drafting, so they are not forwarded again.
"""
from __future__ import annotations

import torch

from speclab.checks import MAX_TREE_NODES, Bound
from speclab.core import native
from speclab.core.sampling import Sampling, argmax, chain_dists, draft_probs, draw, draw_one
from speclab.core.target import Target, forward_clock, keep_cache, row_call
from speclab.core.tree import DraftTree
from speclab.drafters.flashhead import HEAD_PARAMS, head_same_decode, with_head
from speclab.drafters.registry import SAMPLING_PARAMS, DrafterEntry, ModelRole, Param, Shape
from speclab.drafters.schedule import pays_params
from speclab.errors import InvalidInput


class StandaloneDraft:
    name = "sps"
    layers: tuple[int, ...] = ()
    flash = None  # a FlashHead over the draft model's head (speclab.drafters.flashhead), or None: its dense head
    root_cands = None  # with a FlashHead: the root row's candidates [1, C] (from the catch-up)

    def __init__(self, model: Target, *, k: int, tree_topk: int, stop_prob: float, draft_temp: float = 1.0,
                 scheme: str = "wor"):
        if k < 1 or tree_topk < 1 or not 0 <= stop_prob < 1:
            raise ValueError(f"sps needs k >= 1, tree_topk >= 1 and 0 <= stop_prob < 1 "
                             f"(got k={k}, tree_topk={tree_topk}, stop_prob={stop_prob})")
        self.model, self.k, self.tree_topk, self.stop_prob = model, k, tree_topk, stop_prob
        self.draft_temp, self.scheme = draft_temp, scheme
        self.cache = None
        self.backlog = torch.zeros(0, dtype=torch.long)
        self.root_logits = None  # [1, V]: the draft's distribution after the last committed token
        self.known = 0  # committed tokens whose KV the cache holds
        self.reused = 0  # of the next catch-up's tokens, how many `commit` already kept in the cache
        self.n_forwarded = 0  # nodes of the last proposal whose KV went into the cache while drafting

    def reset(self, prompt_ids: torch.Tensor, prompt_features=None, capacity: int | None = None) -> None:
        """`capacity` (committed tokens; None: the draft model's default cache, growing on demand): the draft
        model's cache is sized once for them and the nodes a draft forwards (every level but the last)."""
        self.cache = self.model.new_cache() if capacity is None else \
            self.model.new_cache(capacity + self.tree_topk * (self.k - 1))
        self.backlog = prompt_ids.detach().cpu().long().clone()
        self.root_logits, self.known, self.reused = None, 0, 0
        if self.flash is not None:  # the first catch-up picks the root's clusters greedily, never with the sampling
            self.flash.temperature, self.flash.generator = 0.0, None  # of the decode before (`propose` sets them)

    def catch_up(self, ids: torch.Tensor, features=None) -> None:
        """Forward every committed token the cache lacks (KV for all, logits of the last only)."""
        self.backlog = torch.cat([self.backlog, ids[self.reused:].detach().cpu().long()])
        self.reused = 0
        if self.backlog.numel():
            self.root_logits = self.model.forward(self.backlog, self.cache, last=1, head=self.flash).logits
            self.root_cands = self.flash.last_candidates if self.flash is not None else None  # [1, C]
            self.known += self.backlog.numel()
            self.backlog = self.backlog[:0]

    def propose(self, max_depth: int, sampling: Sampling, generator=None) -> DraftTree:
        depth = min(self.k, max_depth)
        self.n_forwarded = 0
        if self.flash is not None:  # a sampled chain draws its clusters (the root's were picked at catch-up)
            self.flash.temperature = 0.0 if self.tree_topk > 1 else sampling.temperature
            self.flash.generator = generator
        if depth <= 0:
            return DraftTree.empty()
        if self.scheme == "topk":  # deterministic drafts at T > 0 too (the comparison)
            sampling = Sampling()
        if self.tree_topk == 1:
            return self._chain(self.root_logits, depth, sampling, generator)
        return self._tree(self.root_logits, depth, self.known, None if sampling.greedy else sampling, generator)

    def _chain(self, logits, depth, sampling, generator) -> DraftTree:
        """Up to k tokens, one draft call each: argmax (greedy) or sampled from q (kept for verification);
        stops after a token with draft probability below `stop_prob`."""
        if self._native_ok(logits):
            return self._native_chain(logits, depth, sampling, generator)
        tokens, dprobs, dists, cands = [], [], [], []
        row_cands = self.root_cands  # FlashHead: the candidates of the row each token is drafted from
        for level in range(depth):
            if sampling.greedy:
                tok = argmax(logits)
                dprobs.append((logits[0, tok] - logits[0].logsumexp(-1)).exp())
            else:
                tok, qx, q = draw_one(logits, sampling, self.draft_temp, generator)
                dists.append(q)
                dprobs.append(qx)
            tokens.append(tok)
            if row_cands is not None:
                cands.append(row_cands)
            if level == depth - 1 or (self.stop_prob > 0 and float(dprobs[-1]) < self.stop_prob):
                break
            logits = self.model.forward(tok, self.cache, head=self.flash).logits
            row_cands = self.flash.last_candidates if self.flash is not None else None
            self.n_forwarded += 1
        tree = DraftTree.chain(torch.cat(tokens), torch.cat(dprobs), chain_dists(dists) if dists else None)
        tree.cands = torch.cat(cands) if cands else None
        return tree

    def _native_ok(self, logits) -> bool:
        """Whether `_chain`'s loop runs as one native call: the lean forward's native path (not exact mode), the
        dense head, every level drafted (no `stop_prob`: a chain that stops would draw fewer uniforms than it took)."""
        lean = self.model.lean
        return (self.flash is None and self.stop_prob == 0 and lean is not None and not lean.exact
                and logits.dtype is torch.float32 and native.active(lean.embed))

    def _native_chain(self, logits, depth: int, sampling: Sampling, generator) -> DraftTree:
        """`_chain`'s loop in one native call (`native.draft_chain`: the same ops, the same bits, the same uniforms in
        the same order), its depth - 1 forwards writing the cache from its length on."""
        lean, cache = self.model.lean, self.cache
        if cache.length + depth > lean.cos.shape[0]:  # as `LeanDecoder.forward` grows its rotary tables
            lean._rope_table(2 * (cache.length + depth))
        cache.reserve(depth - 1)
        t = 0.0 if sampling.greedy else sampling.temperature * self.draft_temp
        u = None if sampling.greedy else torch.rand(depth, generator=generator)  # `draw_one`'s, level by level
        self.model.calls += depth - 1
        with forward_clock(depth - 1):
            tokens, dprobs, q = native.draft_chain(lean, cache, logits, depth, t, sampling.top_k, sampling.top_p, u)
        cache.length += depth - 1
        self.n_forwarded = depth - 1
        return DraftTree.chain(tokens, dprobs, chain_dists([q]) if q is not None else None)

    def _tree(self, logits, depth, committed, sampling: Sampling | None = None, generator=None) -> DraftTree:
        """Top-k tree: each level expands the frontier by its top-k children and keeps the best `topk` by
        cumulative log-prob; the whole level is one draft call under a tree mask. Deterministic, so
        verification treats the children as point masses. At T > 0 (`sampling`) each level draws `topk` children of
        the frontier's best node (cumulative log q) from its q instead (`scheme`: without replacement or i.i.d.),
        all kept: which children a node has never depends on what they are (`speclab.core.tree.dynamic_tree`)."""
        m, dev, k = self.model, self.model.device, self.tree_topk
        n_max = depth * k
        tokens = torch.zeros(n_max, dtype=torch.long, device=dev)
        parents = torch.zeros(n_max, dtype=torch.long, device=dev)
        dprobs = torch.zeros(n_max, device=dev)
        dists = None if sampling is None else torch.zeros(n_max + 1, logits.shape[-1], device=dev)
        anc = torch.zeros(n_max, n_max, dtype=torch.bool, device=dev)
        frontier = torch.tensor([-1], device=dev)
        score = torch.zeros(1, device=dev)
        n = 0
        rows_cands, cands = self.root_cands, []  # FlashHead: the frontier rows' candidates, each node's
        for level in range(1, depth + 1):
            if sampling is None:
                logp = torch.log_softmax(logits, -1)  # [f, V]
                vals, idx = logp.topk(k, -1)  # [f, k]
                cand = (score[:, None] + vals).flatten()
                best = cand.topk(min(k, cand.numel())).indices
            else:  # the best frontier node's children, drawn from its q (-1: fewer than k tokens have mass)
                j = int(score.argmax())
                q = draft_probs(logits[j : j + 1], sampling, self.draft_temp)
                dists[int(frontier[j]) + 1] = q[0]
                drawn = draw(q, k, self.scheme, generator)[0]
                drawn = drawn[drawn >= 0]
                idx = torch.zeros(score.numel(), k, dtype=torch.long, device=dev)
                vals = torch.full((score.numel(), k), float("-inf"), device=dev)
                idx[j, : drawn.numel()], vals[j, : drawn.numel()] = drawn, q[0, drawn].log()
                cand = (score[:, None] + vals).flatten()
                best = j * k + torch.arange(drawn.numel(), device=dev)
            par_j, new_tok = best // k, idx.flatten()[best]
            new = torch.arange(n, n + new_tok.numel(), device=dev)
            par = frontier[par_j]
            tokens[new], parents[new], dprobs[new] = new_tok, par, vals.flatten()[best].exp()
            anc[new] = anc[par.clamp(min=0)] & (par >= 0)[:, None]
            anc[new, new] = True
            n += new.numel()
            if rows_cands is not None:
                cands.append(rows_cands[par_j])
            if level == depth:
                break
            allowed = torch.cat([torch.ones(new.numel(), committed, dtype=torch.bool, device=dev), anc[new, :n]], dim=1)
            mask = torch.zeros(allowed.shape, dtype=m.dtype, device=dev).masked_fill_(
                ~allowed, torch.finfo(m.dtype).min)
            pos = committed - 1 + level + torch.zeros_like(new)
            logits = m.forward(new_tok, self.cache, pos, mask.view(1, 1, *allowed.shape), head=self.flash).logits
            rows_cands = self.flash.last_candidates if self.flash is not None else None
            self.n_forwarded = n
            frontier, score = new, cand[best]
        tree = DraftTree(tokens[:n], parents[:n], dprobs[:n], None if dists is None else dists[: n + 1],
                         cands=torch.cat(cands) if cands else None)
        tree.scheme = self.scheme
        return tree

    def commit(self, tree: DraftTree, accepted: torch.Tensor) -> None:
        """Keep the KV of the accepted nodes that were forwarded (a prefix of the path: every level but the last
        was), drop the rest; the next catch-up skips them."""
        keep = accepted[accepted < self.n_forwarded]
        keep_cache(self.cache, self.known, keep.to(self.model.device))
        self.known += keep.numel()
        self.reused = keep.numel()


def _build(target, model: Target, **params) -> StandaloneDraft:
    if model.vocab_size != target.vocab_size:
        raise InvalidInput(f"draft vocabulary ({model.vocab_size}) differs from the target's ({target.vocab_size}): "
                           "sps needs a draft model with the target's tokenizer")
    return StandaloneDraft(model, **params)


def _check(p: dict, target) -> None:
    nodes = p["k"] * p["tree_topk"]
    most = min(MAX_TREE_NODES, target.max_context)
    if p["tree_topk"] > 1 and nodes > most:
        raise InvalidInput(f"sps tree: k x tree_topk = {p['k']} x {p['tree_topk']} = {nodes} nodes, more than the "
                           f"{most} one verification takes; lower k or tree_topk")


def _load(path, target, paths) -> Target:
    """The draft model, its logits in its own dtype whatever `--logits` says: `--logits fp32` refines the logits
    verification accepts by, the target's, and a draft's need no refining (in bf16 that refinement cost sps about 3%
    of its decode time)."""
    return Target.load(path, device=paths.device, dtype=paths.dtype, backend=paths.backend, logits="model")


# the shapes the conformance suite checks for this drafter (tests/test_conformance.py: greedy equals AR, sampling
# keeps the target's distribution, catch-up, reset), each with the random model `ModelRole.random` builds
SHAPES = (Shape("chain", dict(k=5)),
          Shape("chain-1", dict(k=1)),
          Shape("early-stop", dict(k=6, stop_prob=0.5)),
          Shape("tree", dict(k=3, tree_topk=2)),
          Shape("tree-wide", dict(k=4, tree_topk=3)),
          Shape("flash", dict(head="flash", clusters=64, probes=8)),
          Shape("flash-tree", dict(k=3, tree_topk=2, head="flash", clusters=64, probes=8)))

# stand down where drafting does not pay (`speclab.drafters.schedule.PaysRouter`), measured by `speclab grid` at T >
# 0: no value above 2 faster at T = 0.7 and 1 on the zoo, AMD EPYC, 2026-12-02
PAYS = pays_params(0.0)

ENTRY = DrafterEntry(
    name="sps", label="SpS", color="#1f77b4", bench={"k": 4}, peer="hf_assisted",
    build=with_head(_build, "draft", lambda model, target: model.head_weight), check=_check,
    same_decode=head_same_decode(),
    methods={"sps": "standalone draft model (SpS): chain of k, or a top-k tree"},
    model=ModelRole("draft", "--draft", "draft", "a draft model", _load, zoo="draft", card="data/zoo/README.md",
                    help="draft model for sps (default: the zoo draft)",
                    random=lambda target, seed, **kw: random_draft(target, seed, **kw),
                    call=lambda target, model, ids, context: row_call(model, ids, context), own_dtype=True),
    shapes=SHAPES,
    params=(Param("k", 4, lambda t: Bound(1, t.max_context), help="draft length (a chain) or depth (a tree)"),
            Param("tree_topk", 1, lambda t: Bound(1, t.vocab_size), help="children per level (1 = a chain)"),
            Param("stop_prob", 0.0, lambda t: Bound(0.0, 1.0, hi_open=True),
                  help="end a chain after a draft token below this probability (0 = always k tokens)"))
    + SAMPLING_PARAMS + PAYS + HEAD_PARAMS)


# ---- random drafters: `ModelRole.random` (the conformance suite's and the smoke tests' models, no files) ------------

def random_draft(target: Target, seed: int, noise: float = 0.15) -> Target:
    """A draft model for `target` built in memory: the target's own weights plus seeded noise (`noise` x each
    tensor's std), so it agrees with the target often but not always; the target's tokenizer, dtype, device and
    forward."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):  # the throwaway init leaves the global generator as it was
        model = AutoModelForCausalLM.from_config(target.config)
    model.load_state_dict(target.model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.float().std())
    model = model.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
    draft = Target(model, target.tokenizer, backend=target.backend, logits=target.logits)
    draft.eos_ids = list(target.eos_ids)
    return draft
