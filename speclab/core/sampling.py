"""Turning logits into the distribution we sample from (temperature, top-k, top-p), as gpt-fast's `logits_to_probs`."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def logits_to_probs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """Rows of logits [..., V] -> the distribution decoding samples from. Greedy: a point mass at the argmax."""
    if s.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(torch.float32)
    logits = logits.float() / s.temperature
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
    """One token per row of probs [..., V], by inverse CDF with the session's generator (device independent)."""
    u = torch.rand(probs.shape[:-1] + (1,), generator=generator, device="cpu").to(probs.device)
    cdf = probs.cumsum(-1)
    idx = torch.searchsorted(cdf, u * cdf[..., -1:], right=True)  # first index with cdf > u: never a zero-mass token
    return idx.clamp_(max=probs.shape[-1] - 1).squeeze(-1)

