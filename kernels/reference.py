"""The torch twins: what every kernel must compute, written plainly (and what runs wherever there is no GPU)."""
from __future__ import annotations

import torch


def softmax_entropy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of logits [R, V] (any float dtype) -> (logsumexp [R], entropy in nats [R]), in fp32. The log-probability
    of token t in row r is logits[r, t] - lse[r]; the entropy is lse - sum_t p_t * logits_t."""
    x = logits.float()
    logp = torch.log_softmax(x, -1)  # torch's fused kernel: the cheapest way on CPU
    # max(logp) = max(x) - lse, and max(logp) >= -ln V, so this is as exact as logsumexp without a third pass
    # sum(p * logp) as a product and a sum: linalg.vecdot takes a path 7x slower over a few hundred rows on CPU
    return x.amax(-1) - logp.amax(-1), -(logp.exp() * logp).sum(-1)


def greedy_accept(tokens: torch.Tensor, parents: torch.Tensor, target_argmax: torch.Tensor,
                  ancestors: torch.Tensor | None = None):
    """Greedy acceptance of a draft tree: node i (token tokens[i], parent parents[i], -1 = the root; parents come
    before children) matches when its token is the target's argmax at its parent's row
    (target_argmax[parents[i] + 1]); it is alive when it and every ancestor match. Returns (best: the first deepest
    alive node, -1 if none; bonus: the target's token after it; on_path [n] bool: the nodes from the root to best).
    `ancestors` ([n, n] bool, ancestors[i, j]: j is on the path to i, i included; `ancestor_mask`) is computed
    here when the caller does not have it (a verification has: its tree mask is built from it)."""
    n = tokens.numel()
    match = tokens == target_argmax[parents + 1]
    if ancestors is None:
        ancestors = ancestor_mask(parents)
    alive = ~(ancestors & ~match[None, :]).any(1)
    score = torch.where(alive, ancestors.sum(1), torch.zeros_like(parents))
    best = int(score.argmax()) if n and bool(alive.any()) else -1  # argmax: the first of the deepest
    on_path = ancestors[best] if best >= 0 else torch.zeros(n, dtype=torch.bool, device=tokens.device)
    return best, int(target_argmax[best + 1]), on_path


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """[n, n] bool: [i, j] = node j is on the path from the root to node i (i included), for parents [n] (-1 = a
    child of the root, parents before children). The one definition: draft trees (`speclab.core.tree`) use it too.
    By repeated squaring of the parent relation: log2(n) matmuls and no host sync, so it stays on a GPU."""
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


def sampling_accept(p: torch.Tensor, q: torch.Tensor, x: torch.Tensor, u: torch.Tensor):
    """Speculative-sampling tests for a batch of positions: row b drafted token x[b] from q[b]; it is accepted when
    u[b] < min(1, p[b, x] / q[b, x]). Returns (accept [B] bool, residual [B, V] = norm(max(p - q, 0)), p itself
    where that has no mass)."""
    rows = torch.arange(p.shape[0], device=p.device)
    px, qx = p[rows, x].float(), q[rows, x].float()
    return u < torch.clamp(px / qx.clamp(min=1e-30), max=1.0), residual(p, q)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What the target samples from after rejecting a draft drawn from q, per row of [..., V]: norm(max(p - q, 0)),
    and p itself where q covers p everywhere (no mass left)."""
    r = (p.float() - q.float()).clamp(min=0)
    s = r.sum(-1, keepdim=True)
    return torch.where(s > 0, r / s.clamp(min=1e-30), p.float())


def flash_gather_score(h: torch.Tensor, weight: torch.Tensor, index: torch.Tensor, clusters: torch.Tensor,
                       scale: float = 1.0):
    """FlashHead's second stage: row r's candidates are the tokens of its clusters (clusters [R, P] into index
    [c, b]), and their exact logits are h[r] . weight[token] * scale, accumulated in fp32. Returns (candidates
    [R, P * b] long, logits [R, P * b] float32)."""
    cands = index[clusters].flatten(1)
    logits = torch.einsum("rh,rkh->rk", h.float(), weight[cands].float()) * scale
    return cands, logits
