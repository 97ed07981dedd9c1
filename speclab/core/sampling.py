"""Turning logits into the distribution we sample from (temperature, top-k, top-p), as gpt-fast's `logits_to_probs`."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from speclab.core import native


@dataclass
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(-1)`, bitwise (the first maximal index of each row; NaN counts as maximal), by `max(-1)`, whose CPU
    kernel is faster: 6 against 17 us on a row of 8,192 logits, 21 against 48 on five rows (measured here)."""
    return x.max(-1).indices


def logits_to_probs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """Rows of logits [..., V] -> the distribution decoding samples from. Greedy: a point mass at the argmax."""
    if s.greedy:
        return torch.nn.functional.one_hot(argmax(logits), logits.shape[-1]).to(torch.float32)
    logits = logits.float() if s.temperature == 1.0 else logits.float() / s.temperature  # x / 1 is x: one op less
    if s.top_k and s.top_k < logits.shape[-1]:
        kth = torch.topk(logits, s.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > s.top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    return torch.softmax(logits, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs [..., V], by inverse CDF with the session's generator (device independent). On the
    CPU where `speclab.core.native` runs, its one call (the same bits) instead of five ops."""
    u = uniforms(probs, generator)
    if _native_rows(probs):
        return native.draw_rows(probs.reshape(-1, probs.shape[-1]), u)[0].view(probs.shape[:-1])
    cdf = probs.cumsum(-1)
    idx = torch.searchsorted(cdf, u * cdf[..., -1:], right=True)  # first index with cdf > u: never a zero-mass token
    return idx.clamp_(max=probs.shape[-1] - 1).squeeze(-1)


def uniforms(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """The uniforms `sample` draws for rows of probs [..., V]: [..., 1], from the generator on the CPU."""
    return torch.rand(probs.shape[:-1] + (1,), generator=generator, device="cpu").to(probs.device)


def _native_rows(probs: torch.Tensor) -> bool:
    """Whether `native.draw_rows` draws from probs: fp32 on the CPU, where the native module runs."""
    return probs.dtype is torch.float32 and native.active(probs)


def draft_probs(logits: torch.Tensor, s: Sampling, draft_temp: float = 1.0) -> torch.Tensor:
    """The distribution q a drafter samples from: its logits (any shift: log-probs will do) through the same transform
    as the target's (`logits_to_probs`: top-k and top-p too), at `draft_temp` times the target's temperature.
    Any q keeps a sampled decode exact (verification tests min(1, p/q)); a cooler q trades coverage for acceptance."""
    return logits_to_probs(logits, Sampling(s.temperature * draft_temp, s.top_k, s.top_p))


def draw(q: torch.Tensor, k: int, scheme: str, generator: torch.Generator | None) -> torch.Tensor:
    """k children of each row of q [f, V] -> token ids [f, k], -1 where a row has fewer than k tokens of mass
    (scheme "wor" only). "iid": k independent draws (SpecInfer's siblings; a token may repeat); "wor": k draws
    without replacement (Gumbel top-k: the keys log q + Gumbel noise in falling order are sequential draws without
    replacement; Jeon et al. 2024, "Recursive Speculative Decoding"), in the order they were drawn."""
    if scheme == "iid":
        return sample(q[:, None, :].expand(-1, k, -1), generator)
    u = torch.rand(q.shape, generator=generator, device="cpu").to(q.device).clamp_(min=1e-20)
    keys = q.log() - (-u.log()).log()  # log q + Gumbel(0, 1); -inf where q is 0
    top = keys.topk(min(k, q.shape[-1]), -1)
    return torch.where(top.values > float("-inf"), top.indices, -1)


def draw_one(logits: torch.Tensor, s: Sampling, draft_temp: float, generator: torch.Generator | None,
             to_target: torch.Tensor | None = None, vocab: int = 0):
    """A sampled chain's step: one token per row of a drafter's logits [f, Vd] drawn from q (`draft_probs`), its
    q(x) and q itself for verification, spread into the target's vocabulary of `vocab` ids when the drafter's is
    reduced (`to_target` [Vd]: the target id of each draft id). Returns (token ids in target ids [f], q(x) [f],
    q [f, V])."""
    q = draft_probs(logits, s, draft_temp)
    if q.dim() == 2 and _native_rows(q):  # the draw, q(x) and the spread in one call (the same bits)
        tok, qx, spread_q = native.draw_rows(q, uniforms(q, generator), to_target, vocab)
        return tok, qx, q if spread_q is None else spread_q
    idx = sample(q, generator)
    qx = q.gather(-1, idx[..., None])[..., 0]
    if to_target is None:
        return idx, qx, q
    return to_target[idx], qx, spread(q, to_target, vocab)


def spread(q: torch.Tensor, to_target: torch.Tensor, vocab: int) -> torch.Tensor:
    """Rows of q over a reduced draft vocabulary [f, Vd] as rows over the target's `vocab` ids (`to_target` [Vd]: the
    target id of each draft id; zero elsewhere)."""
    return torch.zeros(q.shape[:-1] + (vocab,), device=q.device).index_add_(-1, to_target, q.float())


def chain_dists(rows: list[torch.Tensor]) -> torch.Tensor:
    """`DraftTree.draft_dists` of a sampled chain from the q rows its tokens were drawn from ([1, V] each, or blocks of
    them [n, V]): the last node has no child (a zero row)."""
    return torch.cat(rows + [torch.zeros_like(rows[0][:1])])
