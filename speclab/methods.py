"""The registry of decoding methods: what the CLI, the app and the benchmarks list and build.

A method builds its drafters *and* its router, so a method can hold several drafters (a router then picks
one every round). AR is the method without drafters. New drafters and routers register here and appear
everywhere without other changes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from speclab.errors import InvalidInput
from speclab.routers import FixedRouter


@dataclass
class Method:
    name: str
    description: str
    build: Callable | None  # (target, draft_model, **params) -> (drafters by name, router); None for AR
    params: dict = field(default_factory=dict)  # parameter -> default
    needs_draft_model: bool = False


def _sps(target, draft, k=4, tree_topk=1, stop_prob=0.0):
    from speclab.drafters.sps import StandaloneDraft
    if draft is None:
        raise InvalidInput("method 'sps' needs a draft model (--draft PATH, or the zoo's default draft)")
    if draft.vocab_size != target.vocab_size:
        raise InvalidInput(f"draft vocabulary ({draft.vocab_size}) differs from the target's ({target.vocab_size}): "
                           "sps needs a draft model with the target's tokenizer")
    return {"sps": StandaloneDraft(draft, k=k, tree_topk=tree_topk, stop_prob=stop_prob)}, FixedRouter("sps")


def _pld(target, draft, k=8, max_ngram=3, min_ngram=1):
    from speclab.drafters.pld import PromptLookup
    return {"pld": PromptLookup(k=k, max_ngram=max_ngram, min_ngram=min_ngram)}, FixedRouter("pld")


METHODS: dict[str, Method] = {
    "ar": Method("ar", "autoregressive baseline: one target call per token", None),
    "sps": Method("sps", "standalone draft model (SpS): chain of k, or a top-k tree", _sps,
                  {"k": 4, "tree_topk": 1, "stop_prob": 0.0}, needs_draft_model=True),
    "pld": Method("pld", "prompt lookup: n-gram match in prompt + output, no model", _pld,
                  {"k": 8, "max_ngram": 3, "min_ngram": 1}),
}


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise InvalidInput(f"unknown method '{name}'; registered: {', '.join(METHODS)}")
    return METHODS[name]


def method_params(name: str, given: dict) -> dict:
    """The method's parameters: defaults overridden by the given ones that it knows (others ignored)."""
    m = get_method(name)
    return {k: type(v)(given[k]) if given.get(k) is not None else v for k, v in m.params.items()}


def build_method(name: str, target, draft, params: dict):
    """(drafters by name, router) of a method; AR has no drafter and no router."""
    m = get_method(name)
    if m.build is None:
        return {}, None
    return m.build(target, draft, **params)
