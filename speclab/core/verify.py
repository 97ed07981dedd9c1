"""Lossless verification of a draft tree against the target's distributions.

`target_logits` has one row per tree position: row 0 is the distribution after the root (the last
committed token), row i + 1 the distribution after node i. Greedy: the deepest node whose every token on
the path equals the target's argmax at its parent, plus the target's bonus token. Sampling: speculative
sampling (Leviathan et al.; Chen et al.) generalised to several candidates per node by recursive rejection
over siblings (SpecInfer; EAGLE), which keeps the target distribution exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import ops as kernel_ops
from kernels.reference import (
    residual,  # norm(max(p - q, 0)): one definition, the kernels' twin
)
from speclab.core import native
from speclab.core.sampling import Sampling, argmax, logits_to_probs, sample
from speclab.core.tree import IID, POINT, DraftTree


@dataclass
class Verdict:
    accepted: torch.Tensor  # [a] node indices of the accepted path, root side first
    bonus: int  # the target's token after the accepted path (correction or bonus)
    probs: torch.Tensor | None = None  # [n + 1, V] under sampling: the target's distributions it tested against


def verify(tree: DraftTree, target_logits: torch.Tensor, sampling: Sampling,
           generator: torch.Generator | None = None) -> Verdict:
    if sampling.greedy:
        return verify_greedy(tree, target_logits)
    probs = logits_to_probs(target_logits, sampling)
    verdict = verify_sampling(tree, probs, generator)
    verdict.probs = probs
    return verdict


def verify_greedy(tree: DraftTree, target_logits: torch.Tensor) -> Verdict:
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
    q = tree.draft_dists[:n].to(p.device) if tree.draft_dists is not None else \
        torch.nn.functional.one_hot(tree.tokens.to(p.device), p.shape[-1]).to(p.dtype)  # a point mass at x
    x = tree.tokens.to(p.device)
    if native.active(p) and p.dtype is q.dtype is torch.float32:  # the tests in one call, the same bits
        a = native.chain_accept(p, q, x, u)
    else:
        accept, _ = kernel_ops.sampling_accept(p, q, x, u[:n].to(p.device))
        a = int(accept.long().cumprod(0).sum())  # the first rejection ends the path
    # the target's token after the path: p's after the last node, or the residual at the first rejection
    return Verdict(torch.arange(a, device=tree.tokens.device),
                   int(sample(target_probs[n] if a == n else residual(target_probs[a], q[a]), generator)))


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
