"""Equality of a speculative output with the AR baseline, and telling a numerical tie from a bug.

Greedy speculative decoding is lossless: its output equals AR token for token. On a GPU in bf16 a wide
verification forward and a one-row AR step run different kernels, so where the target's top two logits are
within rounding of each other the two can pick different tokens. `first_divergence` finds the first differing
position and the target's top-2 logit gap there (recomputed with one forward over the AR prefix), so a
near-tie is told apart from a bug at a glance.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

# A gap within this many units of rounding (the model dtype's epsilon x |top logit|) counts as a near-tie. In bf16
# on the zoo a 1-row and an n-row forward differ by at most ~0.09 in a logit (about one unit at |top| ~ 10), and
# the gaps at which bf16 outputs part from AR with fp32 logits measured 0.002-0.01 (`speclab bench`, 2026-11-23).
TIE_EPS = 4


def output_hash(token_ids: list[int]) -> str:
    """A short fingerprint of a token sequence: equal outputs (e.g. greedy speculative vs AR) have equal hashes."""
    return hashlib.sha1(",".join(map(str, token_ids)).encode()).hexdigest()[:16]


@dataclass
class Divergence:
    pos: int  # index in the generated tokens of the first difference
    ref_token: int  # the AR baseline's token there
    token: int  # the other output's token there
    top2_gap: float  # target's top-1 minus top-2 logit after the common prefix
    tolerance: float  # the gap below which this is a numerical near-tie for the target's dtype
    ref_prob: float = float("nan")  # the target's probability (softmax, T = 1) of the AR token there
    prob: float = float("nan")  # and of the other output's token

    @property
    def near_tie(self) -> bool:
        return self.top2_gap <= self.tolerance

    @property
    def kind(self) -> str:
        """'near-tie' (rounding) or 'bug' (anything else); an equal output has no Divergence (`kind_of`)."""
        return "near-tie" if self.near_tie else "bug"

    def describe(self, tokenizer=None) -> str:
        """One line: where, the two tokens (their text and the target's probabilities when a tokenizer is given,
        else their ids), the top-2 logit gap and the verdict."""
        kind = "a numerical near-tie" if self.near_tie else "NOT a near-tie: a bug until proven otherwise"
        if tokenizer is None:
            which = f"({self.ref_token} vs {self.token})"
        else:
            which = f"(AR {self._token(tokenizer, self.ref_token, self.ref_prob)} vs " \
                    f"{self._token(tokenizer, self.token, self.prob)})"
        return (f"differs from AR at token {self.pos} {which}: top-2 logit gap {self.top2_gap:.3g} (tolerance "
                f"{self.tolerance:.2g}), {kind}")

    @staticmethod
    def _token(tokenizer, token: int, prob: float) -> str:
        if token < 0:
            return "the end of the output"
        p = "" if prob != prob else f", p {prob:.3g}"
        return f"{tokenizer.decode([token])!r}{p}"


def kind_of(div: Divergence | None) -> str:
    """The three groups every report uses: 'equal' to AR, differing at a 'near-tie', or a 'bug' (SQL: metrics)."""
    return "equal" if div is None else div.kind


@torch.inference_mode()
def first_divergence(target, prompt_ids: torch.Tensor, ref_ids: list[int], ids: list[int]) -> Divergence | None:
    """None when `ids` equals `ref_ids` (or is a prefix / extension of it cut by max tokens), else the first
    difference with the target's top-2 logit gap at that position."""
    n = min(len(ref_ids), len(ids))
    diff = [i for i in range(n) if ref_ids[i] != ids[i]]
    if not diff and len(ref_ids) == len(ids):
        return None
    pos = diff[0] if diff else n
    if pos >= n:  # one is a strict prefix of the other (an EOS on one side): no logit comparison to make
        return Divergence(pos, ref_ids[pos] if pos < len(ref_ids) else -1, ids[pos] if pos < len(ids) else -1,
                          float("nan"), 0.0)  # no probabilities: one side has no token there
    prefix = torch.cat([prompt_ids.flatten().cpu().long(), torch.tensor(ref_ids[:pos], dtype=torch.long)])
    logits = target.forward(prefix, target.new_cache(), last=1).logits[0]
    top = logits.topk(2).values
    tol = TIE_EPS * torch.finfo(target.dtype).eps * max(1.0, abs(float(top[0])))
    probs = torch.softmax(logits.float(), -1)
    return Divergence(pos, ref_ids[pos], ids[pos], float(top[0] - top[1]), tol, float(probs[ref_ids[pos]]),
                      float(probs[ids[pos]]))
