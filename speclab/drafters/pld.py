"""Prompt lookup decoding: match the last n tokens earlier in prompt + output and propose what followed."""
from __future__ import annotations

import torch

from speclab.checks import Bound
from speclab.core.sampling import Sampling
from speclab.core.tree import DraftTree
from speclab.drafters.registry import DrafterEntry, Param, Shape
from speclab.errors import InvalidInput


class PromptLookup:
    name = "pld"
    layers: tuple[int, ...] = ()

    def __init__(self, *, k: int, max_ngram: int, min_ngram: int):
        if k < 1 or min_ngram < 1 or max_ngram < min_ngram:
            raise ValueError(f"pld needs k >= 1 and 1 <= min_ngram <= max_ngram "
                             f"(got k={k}, ngram {min_ngram}..{max_ngram})")
        self.k, self.max_ngram, self.min_ngram = k, max_ngram, min_ngram
        self.ids = torch.zeros(0, dtype=torch.long)

    def reset(self, prompt_ids: torch.Tensor, prompt_features=None, capacity: int | None = None) -> None:
        self.ids = prompt_ids.detach().cpu().long().clone()

    def catch_up(self, ids: torch.Tensor, features=None) -> None:
        if ids.numel():
            self.ids = torch.cat([self.ids, ids.detach().cpu().long()])

    def propose(self, max_depth: int, sampling: Sampling, generator=None) -> DraftTree:
        k = min(self.k, max_depth)
        ids = self.ids
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if k <= 0 or ids.numel() <= n:
                break
            windows = ids[:-1].unfold(0, n, 1)  # every earlier n-gram that has at least one token after it
            hits = (windows == ids[-n:]).all(1).nonzero().flatten()
            if hits.numel():
                start = int(hits[-1]) + n  # the most recent occurrence
                cont = ids[start : start + k]
                return DraftTree.chain(cont.clone(), torch.full((cont.numel(),), float("nan")))
        return DraftTree.empty()

    def commit(self, tree: DraftTree, accepted: torch.Tensor) -> None:
        pass


def _check(p: dict, target) -> None:
    if p["min_ngram"] > p["max_ngram"]:
        raise InvalidInput(f"pld: min_ngram ({p['min_ngram']}) must not exceed max_ngram ({p['max_ngram']})")


# the shapes the conformance suite checks for this drafter (tests/test_conformance.py: greedy equals AR, sampling
# keeps the target's distribution, catch-up, reset)
SHAPES = (Shape("chain", dict(k=2)), Shape("long-chain", dict(k=6)))

ENTRY = DrafterEntry(
    name="pld", label="prompt lookup", color="#2ca02c", bench={"k": 8}, peer="hf_pld",
    build=lambda target, model, **params: PromptLookup(**params), check=_check,
    methods={"pld": "prompt lookup: n-gram match in prompt + output, no model"}, shapes=SHAPES,
    params=(Param("k", 8, lambda t: Bound(1, t.max_context), help="tokens proposed after a match"),
            Param("max_ngram", 3, lambda t: Bound(1, 64), help="longest n-gram matched"),
            Param("min_ngram", 1, lambda t: Bound(1, 64), help="shortest n-gram matched")))
