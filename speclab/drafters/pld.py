"""Prompt lookup decoding: match the last n tokens earlier in prompt + output and propose what followed.

The n-grams are indexed as tokens arrive (`NgramIndex`: for every n-gram, where the continuation after its latest
occurrence starts), so a lookup is a few dict reads, not a scan of the sequence.

`adaptive` sizes each proposal by how the last ones fared (`speclab.drafters.schedule`). Under sampling a looked-up
token is a point mass, accepted with the target's probability p(x), so long proposals are mostly rejected and each
costs a verification row. Measured on the zoo (32 prompts, bf16, Intel Xeon AMX): +4% tokens/s at T = 0.7 and at
T = 1, -5% at T = 0 (a greedy lookup that matched once tends to go on matching), so the default adapts under
sampling only.

`gate` (under sampling only): the target's distribution at every round's root row is the one the first looked-up
token is tested against, so its p(c_1) is known after every round, whether prompt lookup proposed or not: the exact
acceptance probability of the proposal it would have made, at no cost (`observe`). Prompt lookup proposes only while
the moving average of those p(c_1) (`GATE_EMA`) is at least `gate`; below it the round is a plain target step, which
costs one verification row less. The decision reads past rounds only, so the decode stays lossless. The default of
0.3 is measured (README "Sampling": +5% tokens/s at T = 0.7 and at T = 1 on the zoo, paired, over `gate=0`).
"""
from __future__ import annotations

import torch

from speclab.checks import Bound
from speclab.core.sampling import Sampling
from speclab.core.tree import DraftTree
from speclab.drafters.registry import DrafterEntry, Param, Shape
from speclab.drafters.schedule import LengthSchedule, adaptive_param
from speclab.errors import InvalidInput

MATCH_CAP = 32  # the longest match `probe` measures
GATE_EMA = 0.5  # the weight of the newest p(c_1) in the gate's moving average


class NgramIndex:
    """A token sequence with, for every n-gram of `min_n`..`max_n` tokens that has a token after it, where the
    continuation after its most recent such occurrence starts. `lookup` is what a scan of the whole sequence finds
    (`tests/test_pld.py` checks both on random sequences), in O(max_n) dict reads."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.toks: list[int] = []
        self.after: dict[tuple[int, ...], int] = {}

    def extend(self, ids: list[int]) -> None:
        toks, after = self.toks, self.after
        for t in ids:
            i = len(toks)  # every n-gram ending at i - 1 now has a token after it, starting at i
            for n in range(self.min_n, min(self.max_n, i) + 1):
                after[tuple(toks[i - n : i])] = i
            toks.append(t)

    def lookup(self) -> int:
        """Where the continuation starts after the most recent earlier occurrence of the longest n-gram (max_n down
        to min_n) ending at the last token; -1 where none occurs."""
        toks, n_toks = self.toks, len(self.toks)
        if n_toks <= self.max_n:  # as the scan it replaced: no n-gram is tried before the sequence is longer than max_n
            return -1
        for n in range(self.max_n, self.min_n - 1, -1):
            start = self.after.get(tuple(toks[n_toks - n :]))
            if start is not None:
                return start
        return -1


class PromptLookup:
    name = "pld"
    layers: tuple[int, ...] = ()

    def __init__(self, *, k: int, max_ngram: int, min_ngram: int, adaptive: str = "off", gate: float = 0.0):
        if k < 1 or min_ngram < 1 or max_ngram < min_ngram or not 0 <= gate <= 1:
            raise ValueError(f"pld needs k >= 1, 1 <= min_ngram <= max_ngram and 0 <= gate <= 1 "
                             f"(got k={k}, ngram {min_ngram}..{max_ngram}, gate {gate})")
        self.k, self.max_ngram, self.min_ngram, self.gate = k, max_ngram, min_ngram, gate
        self.schedule = LengthSchedule(k, adaptive)  # the next proposal's length where `adaptive` applies
        self.reset(torch.zeros(0, dtype=torch.long))

    def reset(self, prompt_ids: torch.Tensor, prompt_features=None, capacity: int | None = None) -> None:
        self.index = NgramIndex(self.min_ngram, self.max_ngram)
        self.index.extend(prompt_ids.detach().cpu().flatten().tolist())
        self.schedule.reset()
        self.accept_ema: float | None = None  # the gate's moving average of p(c_1); None: nothing observed yet
        self.first = -1  # the first token of the round's lookup, proposed or not (-1: no match)

    def catch_up(self, ids: torch.Tensor, features=None) -> None:
        if ids.numel():
            self.index.extend(ids.detach().cpu().tolist())

    def propose(self, max_depth: int, sampling: Sampling, generator=None) -> DraftTree:
        k = min(self.schedule.length(sampling), max_depth)
        start = self.index.lookup()
        self.first = self.index.toks[start] if start >= 0 else -1
        if k <= 0 or start < 0 or (not sampling.greedy and self.gated()):
            return DraftTree.empty()
        cont = torch.tensor(self.index.toks[start : start + k], dtype=torch.long)
        return DraftTree.chain(cont, torch.full((cont.numel(),), float("nan")))

    def gated(self) -> bool:
        """Whether the gate holds the next proposal back (under sampling): the recent p(c_1) average below `gate`."""
        return self.accept_ema is not None and self.accept_ema < self.gate

    def observe(self, probs: torch.Tensor) -> None:
        """The target's distribution at the round's root row under sampling (`speclab.core.protocol.Observing`): the
        acceptance probability p(c_1) of the first token its lookup found this round, proposed or not."""
        if self.first >= 0:
            p = float(probs[self.first])
            self.accept_ema = p if self.accept_ema is None else (1 - GATE_EMA) * self.accept_ema + GATE_EMA * p
        self.first = -1

    def probe(self) -> dict[str, float]:
        """What a router reads of prompt lookup at round start (`speclab.core.protocol.Probing`): `pld_match`, how
        many tokens before the root agree with those before the continuation it would propose (0: no match; at
        most MATCH_CAP), and `pld_tokens`, how many tokens that continuation holds (at most k)."""
        start, toks = self.index.lookup(), self.index.toks
        if start < 0:
            return {"pld_match": 0.0, "pld_tokens": 0.0}
        match, L = 0, len(toks)
        while match < min(start, MATCH_CAP) and toks[start - 1 - match] == toks[L - 1 - match]:
            match += 1
        return {"pld_match": float(match), "pld_tokens": float(min(self.k, L - start))}

    def commit(self, tree: DraftTree, accepted: torch.Tensor) -> None:
        self.schedule.update(len(tree), accepted.numel())


def _check(p: dict, target) -> None:
    if p["min_ngram"] > p["max_ngram"]:
        raise InvalidInput(f"pld: min_ngram ({p['min_ngram']}) must not exceed max_ngram ({p['max_ngram']})")


# the shapes the conformance suite checks for this drafter (tests/test_conformance.py: greedy equals AR, sampling
# keeps the target's distribution, catch-up, reset)
SHAPES = (Shape("chain", dict(k=2, gate=0.3)), Shape("long-chain", dict(k=6)),
          Shape("adaptive", dict(k=6, adaptive="always")))

ENTRY = DrafterEntry(
    name="pld", label="prompt lookup", color="#2ca02c", bench={"k": 8}, peer="hf_pld",
    build=lambda target, model, **params: PromptLookup(**params), check=_check,
    methods={"pld": "prompt lookup: n-gram match in prompt + output, no model"}, shapes=SHAPES,
    params=(Param("k", 8, lambda t: Bound(1, t.max_context), help="tokens proposed after a match"),
            Param("max_ngram", 3, lambda t: Bound(1, 64), help="longest n-gram matched"),
            Param("min_ngram", 1, lambda t: Bound(1, 64), help="shortest n-gram matched"),
            adaptive_param("sampled", "each proposal's length (at most k)"),
            Param("gate", 0.3, lambda t: Bound(0.0, 1.0), grid=(0.0, 0.05, 0.1, 0.2, 0.3),
                  help="at T > 0, propose only while the average target probability of the first looked-up token, "
                  "observed every round, is at least this (0 = always)")))
