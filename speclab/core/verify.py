"""Lossless verification of a draft tree against the target's distributions.

`target_logits` has one row per tree position: row 0 is the distribution after the root (the last
committed token), row i + 1 the distribution after node i. Greedy: the deepest node whose every token on
the path equals the target's argmax at its parent, plus the target's bonus token. Sampling: speculative
sampling (Leviathan et al.; Chen et al.) generalised to several candidates per node by recursive rejection
over siblings (SpecInfer; EAGLE), which keeps the target distribution exactly. A sampled chain is verified as one
block (Sun et al., "Block Verification Accelerates Speculative Decoding", ICLR 2025): lossless too, never fewer
tokens in expectation than token by token, and the most among lossless rules for one chain.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kernels import ops as kernel_ops
from kernels.reference import (
    residual,  # norm(max(p - q, 0)): one definition, the kernels' twin
)
from speclab.core import native
from speclab.core.sampling import Sampling, argmax, logits_to_probs, sample
from speclab.core.tree import IID, POINT, DraftTree
from speclab.errors import InvalidInput

# How a sampled chain is verified: "block" (`block_accept`) or "token" (token by token: each node's own test, the
# first rejection ends the path). The same distribution either way; SPECLAB_CHAIN_VERIFY=token in the environment
# to compare (checked by `check_chain_rule` before any model loads)
CHAIN_RULES = ("block", "token")
CHAIN_RULE = os.environ.get("SPECLAB_CHAIN_VERIFY", "block")


def check_chain_rule() -> None:
    """SPECLAB_CHAIN_VERIFY names a rule of CHAIN_RULES (InvalidInput, one line, otherwise)."""
    if CHAIN_RULE not in CHAIN_RULES:
        raise InvalidInput(f"SPECLAB_CHAIN_VERIFY={CHAIN_RULE!r}: a sampled chain is verified by one of "
                           f"{', '.join(CHAIN_RULES)}")


@dataclass
class Verdict:
    accepted: torch.Tensor  # [a] node indices of the accepted path, root side first
    bonus: int  # the target's token after the accepted path (correction or bonus)
    probs: torch.Tensor | None = None  # [n + 1, V] under sampling: the target's distributions it tested against


def verify(tree: DraftTree, target_logits: torch.Tensor, sampling: Sampling,
           generator: torch.Generator | None = None) -> Verdict:
    if sampling.greedy:
        return verify_greedy(tree, target_logits)
    if native_block(tree, target_logits):  # the chain's block verification in one call (the same bits)
        n = len(tree)
        u = torch.rand(n + 1, generator=generator)  # as `_verify_sampled_chain` draws them, then `sample`'s one
        ub = torch.rand(1, generator=generator)
        probs, a, bonus = native.block_verify(target_logits, sampling.temperature, sampling.top_k, sampling.top_p,
                                              tree.draft_dists[:n] if n and tree.draft_dists is not None else None,
                                              tree.tokens, u[:n], ub)
        return Verdict(torch.arange(a, device=tree.tokens.device), bonus, probs)
    probs = logits_to_probs(target_logits, sampling)
    verdict = verify_sampling(tree, probs, generator)
    verdict.probs = probs
    return verdict


def native_block(tree: DraftTree, target_logits: torch.Tensor) -> bool:
    """Whether `verify` takes a sampled chain's block verification from `native.block_verify`: a chain of one
    drafter's nodes (sampled fp32 or point masses; none: the target's own draw) under the block rule, on the CPU where
    the native module runs."""
    return (CHAIN_RULE == "block" and tree.is_chain and tree.child_dists is None
            and (tree.draft_dists is None or tree.draft_dists.dtype is torch.float32) and native.active(target_logits))


def verify_greedy(tree: DraftTree, target_logits: torch.Tensor) -> Verdict:
    if tree.is_chain:  # the rows' argmaxes up to the first mismatch, in one call (the same verdict)
        got = native.greedy_chain(target_logits, tree.tokens)
        if got is not None:
            return Verdict(torch.arange(got[0], device=tree.tokens.device), got[1])
    return verify_tokens(tree, argmax(target_logits))


def verify_tokens(tree: DraftTree, target_argmax: torch.Tensor) -> Verdict:
    """Greedy verification from the target's token at every row [n + 1] (replay passes the AR sequence's)."""
    if len(tree) == 0:
        return Verdict(tree.tokens, int(target_argmax[0]))
    if tree.is_chain:  # accept length = the cumulative product of matches (gpt-fast), no ancestor matrix
        n_acc = int((tree.tokens == target_argmax[:-1]).cumprod(0).sum())
        return Verdict(torch.arange(n_acc, device=tree.tokens.device), int(target_argmax[n_acc]))
    # the first deepest node whose whole path matches (kernels.ops: one Triton kernel on CUDA)
    best, bonus, on_path = kernel_ops.greedy_accept(tree.tokens, tree.parents, target_argmax,
                                                    None if tree.tokens.is_cuda else tree.ancestors)
    return Verdict(on_path.nonzero().flatten(), bonus)  # topological order = root side first


def verify_sampling(tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator | None) -> Verdict:
    """Recursive rejection sampling. Sampled drafts (tree.draft_dists given): accept x with min(1, p(x)/q(x)),
    else p <- norm(max(p - q, 0)) and try the next sibling: siblings drawn i.i.d. from q (SpecInfer), or without
    replacement (`tree.scheme` "wor": then q <- q with x removed, renormalised, too; recursive rejection sampling
    without replacement, Jeon et al. 2024, "Recursive Speculative Decoding").
    Deterministic drafts: accept x with p(x), else p <- p with x removed, renormalised. A chain (one candidate
    per node) takes all its tests at once (`kernels.ops.sampling_accept`), with the same uniforms in the same
    order as the recursion. A merged tree (`speclab.core.tree.merge`) tests each candidate against the q it was
    drawn from (`DraftTree.child_dists`): point masses and several drafters' samples side by side."""
    if tree.is_chain and tree.child_dists is None:
        return _verify_sampled_chain(tree, target_probs, generator)
    parents = tree.parents.tolist()
    tokens = tree.tokens.tolist()
    # each candidate's sibling group: a merged tree's own (`DraftTree.child_groups`), else one group of all of a
    # node's children, drawn without replacement ("wor") or i.i.d. from the node's q
    groups = tree.child_groups.tolist() if tree.child_groups is not None else \
        [0 if tree.scheme == "wor" else IID] * len(tree)
    children: dict[int, list[int]] = {}
    for i, par in enumerate(parents):
        children.setdefault(par, []).append(i)
    u = torch.rand(len(tree) + 1, generator=generator).tolist()  # one uniform per candidate is enough
    accepted: list[int] = []
    node, draws = -1, 0
    p = target_probs[0]
    while True:
        kids = children.get(node, [])
        shared = tree.draft_dists[node + 1].to(p.device) if tree.draft_dists is not None and kids else None
        left: dict[int, torch.Tensor] = {}  # per group drawn without replacement: q without its rejected tokens
        nxt = None
        for c in kids:
            x, g = tokens[c], groups[c]
            q = shared if tree.child_dists is None else \
                None if g == POINT else tree.child_dists[c].to(p.device)
            q = left.get(g, q)
            px = float(p[x])
            ratio = min(1.0, px / max(float(q[x]), 1e-30)) if q is not None else px
            r, draws = u[draws], draws + 1  # a fresh uniform per candidate test (at most one test per node)
            if r < ratio:
                nxt = c
                break
            if q is not None:
                p = residual(p, q)
                if g >= 0:  # the group's next sibling was drawn from q without x (Jeon et al. 2024: RRSw)
                    q = q.clone()
                    q[x] = 0
                    left[g] = q / q.sum().clamp(min=1e-30)
            else:
                p = p.clone()
                p[x] = 0
                p = p / p.sum()
        if nxt is None:
            return Verdict(torch.tensor(accepted, dtype=torch.long), int(sample(p, generator)))
        accepted.append(nxt)
        node = nxt
        p = target_probs[node + 1]


def _verify_sampled_chain(tree: DraftTree, target_probs: torch.Tensor, generator) -> Verdict:
    n = len(tree)
    u = torch.rand(n + 1, generator=generator)  # as the recursion draws them: one per candidate test
    if n == 0:
        return Verdict(tree.tokens, int(sample(target_probs[0], generator)))
    p = target_probs[:n]
    x = tree.tokens.to(p.device)
    if CHAIN_RULE == "block":  # the whole chain at once; the correction from norm(max(w_a p_a - q_a, 0))
        q = tree.draft_dists[:n].to(p.device) if tree.draft_dists is not None else None  # None: point masses at x
        a, w = block_accept(target_probs, q, x, u)
        if a < n:
            rest = residual(w * target_probs[a], q[a] if q is not None else _point(x[a : a + 1], p)[0])
    else:
        q = tree.draft_dists[:n].to(p.device) if tree.draft_dists is not None else _point(x, p)
        if native.active(p) and p.dtype is q.dtype is torch.float32:  # the tests in one call, the same bits
            a = native.chain_accept(p, q, x, u)
        else:
            accept, _ = kernel_ops.sampling_accept(p, q, x, u[:n].to(p.device))
            a = int(accept.long().cumprod(0).sum())  # the first rejection ends the path
        if a < n:
            rest = residual(target_probs[a], q[a])
    # the target's token after the path: p's after the last node, or the residual at the first rejection
    return Verdict(torch.arange(a, device=tree.tokens.device),
                   int(sample(target_probs[n] if a == n else rest, generator)))


def _point(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Point masses at the tokens x, as rows like p's (a deterministic chain's q)."""
    return torch.nn.functional.one_hot(x, p.shape[-1]).to(p.dtype)


def block_tests(p: torch.Tensor, q: torch.Tensor | None, x: torch.Tensor) -> tuple[list[float], list[float]]:
    """Block verification's tests of a sampled chain (Sun et al. 2025, Algorithm 2): node i's token x[i] drawn from
    q[i] ([n, V]; None: point masses at x, a deterministic chain), p [>= n + 1, V] the target's distributions (row
    i: after i nodes). The weights w_0 = 1, w_i = min(w_{i-1} p_{i-1}(x_{i-1}) / q_{i-1}(x_{i-1}), 1) (rows numbered
    from 0) and the tests h_1..h_n: h_n = w_n and, below n, h_i = S_i / (S_i + 1 - w_i) with
    S_i = sum_v max(w_i p_i(v) - q_i(v), 0) (a point mass at x_i: w_i (1 - p_i(x_i)), since w_i p_i(x_i) <= 1).
    Returns (h [n], w [n + 1])."""
    n = x.numel()
    rows = torch.arange(n, device=p.device)
    px = p[rows, x]
    ratios = px if q is None else px / q[rows, x].clamp(min=1e-30)
    w = [1.0]
    for r in ratios.tolist():
        w.append(min(w[-1] * r, 1.0))
    if q is None:
        mass = [wi * (1.0 - pi) for wi, pi in zip(w[1:n], px[1:n].tolist())]
    else:
        mass = (torch.tensor(w[1:n], dtype=p.dtype, device=p.device)[:, None] * p[1:n] - q[1:n]).clamp(min=0) \
            .sum(-1).tolist()
    h = [m / max(m + 1.0 - wi, 1e-30) for m, wi in zip(mass, w[1:n])] + [w[n]]
    return h, w


def block_accept(p: torch.Tensor, q: torch.Tensor | None, x: torch.Tensor, u: torch.Tensor) -> tuple[int, float]:
    """Block verification of a sampled chain (`block_tests`; u [>= n] uniforms): the path keeps the largest i whose
    test passes, u[i - 1] < h_i (none: 0 nodes). Returns (the nodes kept, a; w_a): the target's token after them is
    drawn from p_n (a = n) or from norm(max(w_a p_a - q_a, 0)). Lossless: the decoded sequence has the target's
    distribution (tests/test_sampling.py computes it exactly on a small vocabulary)."""
    h, w = block_tests(p, q, x)
    uu = u[: len(h)].tolist()
    for i in range(len(h), 0, -1):
        if uu[i - 1] < h[i - 1]:
            return i, w[i]
    return 0, 1.0


def greedy_table(tree: DraftTree, target_logits: torch.Tensor):
    """Why each node of a greedy round was accepted or not (a DataFrame, one row per node): its token and draft
    probability, the target's probability of it and the target's own argmax at its parent's row, whether they
    match, and whether the node is on the accepted path (every node from the root to it matches)."""
    import pandas as pd
    probs = torch.softmax(target_logits.float(), -1)
    rows = tree.parents + 1
    top = target_logits.argmax(-1)
    accepted = torch.zeros(len(tree), dtype=torch.bool)
    accepted[verify_greedy(tree, target_logits).accepted.cpu()] = True
    return pd.DataFrame({"node": range(len(tree)), "parent": tree.parents.tolist(), "depth": tree.depth.tolist(),
                         "token_id": tree.tokens.tolist(), "draft_p": tree.draft_probs.float().tolist(),
                         "target_p": probs[rows, tree.tokens].tolist(), "target_argmax": top[rows].tolist(),
                         "match": (tree.tokens == top[rows]).tolist(), "accepted": accepted.tolist()})
