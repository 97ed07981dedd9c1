"""The registry of decoding methods: what the CLI, the app and the benchmarks list and build.

A method builds its drafters *and* its router, so a method can hold several drafters (a router then picks
one every round). AR is the method without drafters. New drafters and routers register here and appear
everywhere without other changes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from speclab.checks import MAX_TREE_NODES, Bound, check_number
from speclab.errors import InvalidInput
from speclab.routers import FixedRouter


@dataclass
class Method:
    name: str
    description: str
    build: Callable | None  # (target, draft_model, **params) -> (drafters by name, router); None for AR
    params: dict = field(default_factory=dict)  # parameter -> default (its type is the parameter's type)
    needs_draft_model: bool = False
    bounds: Callable | None = None  # target -> {parameter: Bound}: the allowed values, from the model
    check: Callable | None = None  # (params, target) -> None: checks across parameters (raise InvalidInput)


def _sps(target, draft, k=4, tree_topk=1, stop_prob=0.0):
    from speclab.drafters.sps import StandaloneDraft
    if draft.vocab_size != target.vocab_size:
        raise InvalidInput(f"draft vocabulary ({draft.vocab_size}) differs from the target's ({target.vocab_size}): "
                           "sps needs a draft model with the target's tokenizer")
    return {"sps": StandaloneDraft(draft, k=k, tree_topk=tree_topk, stop_prob=stop_prob)}, FixedRouter("sps")


def _pld(target, draft, k=8, max_ngram=3, min_ngram=1):
    from speclab.drafters.pld import PromptLookup
    return {"pld": PromptLookup(k=k, max_ngram=max_ngram, min_ngram=min_ngram)}, FixedRouter("pld")


def _sps_bounds(target) -> dict:
    return {"k": Bound(1, target.max_context), "tree_topk": Bound(1, target.vocab_size),
            "stop_prob": Bound(0.0, 1.0, hi_open=True)}


def _sps_check(p: dict, target) -> None:
    nodes = p["k"] * p["tree_topk"]
    most = min(MAX_TREE_NODES, target.max_context)
    if p["tree_topk"] > 1 and nodes > most:
        raise InvalidInput(f"sps tree: k x tree_topk = {p['k']} x {p['tree_topk']} = {nodes} nodes, more than the "
                           f"{most} one verification takes; lower k or tree_topk")


def _pld_bounds(target) -> dict:
    return {"k": Bound(1, target.max_context), "max_ngram": Bound(1, 64), "min_ngram": Bound(1, 64)}


def _pld_check(p: dict, target) -> None:
    if p["min_ngram"] > p["max_ngram"]:
        raise InvalidInput(f"pld: min_ngram ({p['min_ngram']}) must not exceed max_ngram ({p['max_ngram']})")


METHODS: dict[str, Method] = {
    "ar": Method("ar", "autoregressive baseline: one target call per token", None),
    "sps": Method("sps", "standalone draft model (SpS): chain of k, or a top-k tree", _sps,
                  {"k": 4, "tree_topk": 1, "stop_prob": 0.0}, needs_draft_model=True, bounds=_sps_bounds,
                  check=_sps_check),
    "pld": Method("pld", "prompt lookup: n-gram match in prompt + output, no model", _pld,
                  {"k": 8, "max_ngram": 3, "min_ngram": 1}, bounds=_pld_bounds, check=_pld_check),
}


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise InvalidInput(f"unknown method '{name}'; registered: {', '.join(METHODS)}")
    return METHODS[name]


def method_params(name: str, given: dict, target) -> dict:
    """The method's parameters, checked against `target`: defaults overridden by the given ones that it knows
    (others ignored). A bad value raises InvalidInput naming the parameter, its value and what is allowed."""
    m = get_method(name)
    bounds = m.bounds(target) if m.bounds else {}
    out = {k: check_number(k, given[k] if given.get(k) is not None else v, type(v), bounds.get(k, Bound()))
           for k, v in m.params.items()}
    if m.check:
        m.check(out, target)
    return out


def build_method(name: str, target, draft, params: dict):
    """(drafters by name, router) of a method; AR has no drafter and no router."""
    m = get_method(name)
    if m.build is None:
        return {}, None
    return m.build(target, draft, **params)
