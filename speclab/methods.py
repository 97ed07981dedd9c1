"""The registry of decoding methods: what the CLI, the app and the benchmarks list and build.

A method builds its drafters *and* its router, so a method can hold several drafters (a router then picks
one every round). AR is the method without drafters. New drafters and routers register here and appear
everywhere without other changes.

A method builds from the target and the drafter models it `needs`, by role: `draft` (a standalone draft LM,
a `Target`), `eagle3` (an `Eagle3Model`), `dflash` (a `DFlashModel`) and `router` (a `RouterMLP`). A method *spec* names a method with some of its parameters fixed,
`name:param=value+param=value` (`eagle3:tree_topk=1` is the EAGLE-3 chain): the bench and the CLI take specs, and a
run's `method` column keeps the spec, so variants of one method stay apart in every table.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from speclab.checks import MAX_TREE_NODES, Bound, check_number
from speclab.errors import InvalidInput
from speclab.routing.routers import FixedRouter


@dataclass
class Method:
    name: str
    description: str
    build: Callable | None  # (target, models by role, **params) -> (drafters by name, router); None for AR
    params: dict = field(default_factory=dict)  # parameter -> default (its type is the parameter's type)
    needs: tuple[str, ...] = ()  # drafter models by role: "draft" (a Target), "eagle3", "dflash" (see ROLES)
    bounds: Callable | None = None  # target -> {parameter: Bound}: the allowed values, from the model
    check: Callable | None = None  # (params, target) -> None: checks across parameters (raise InvalidInput)
    gpu_params: dict = field(default_factory=dict)  # defaults that differ on CUDA (the papers' GPU settings)
    same_decode: Callable | None = None  # params -> the params that decode alike (parameter grids run each once)
    grid: str = ""  # the parameter grid `speclab grid` sweeps by default (speclab.bench.run.parse_grid syntax)


EAGLE3_GPU_PRESET = {"depth": 8, "tree_topk": 10, "total_tokens": 60}  # EAGLE-3's evaluations, WhiFlash's Table 7
DFLASH_GPU_PRESET = {"block_size": 16}  # DFlash's evaluations
# CPU defaults, picked by `speclab grid` on the zoo in the default dtype (bf16 on CPUs with native bf16; the model
# cards have the tables): the one definition the methods, WhiFlash and the drafter builders read
EAGLE3_CPU = {"depth": 2, "tree_topk": 2, "total_tokens": 8}
DFLASH_CPU = {"block_size": 4, "markov": 1}

ROLES = {"draft": "a draft model (--draft PATH, or the zoo's default draft)",
         "router": "a neural router (--router-model PATH, or the zoo's router)",
         "eagle3": "an EAGLE-3 drafter (--eagle PATH, or the zoo's default EAGLE-3 drafter)",
         "dflash": "a DFlash drafter (--dflash PATH, or the zoo's default DFlash drafter)"}


def _sps(target, models, k=4, tree_topk=1, stop_prob=0.0):
    from speclab.drafters.sps import StandaloneDraft
    draft = models["draft"]
    if draft.vocab_size != target.vocab_size:
        raise InvalidInput(f"draft vocabulary ({draft.vocab_size}) differs from the target's ({target.vocab_size}): "
                           "sps needs a draft model with the target's tokenizer")
    return {"sps": StandaloneDraft(draft, k=k, tree_topk=tree_topk, stop_prob=stop_prob)}, FixedRouter("sps")


def _pld(target, models, k=8, max_ngram=3, min_ngram=1):
    from speclab.drafters.pld import PromptLookup
    return {"pld": PromptLookup(k=k, max_ngram=max_ngram, min_ngram=min_ngram)}, FixedRouter("pld")


def _eagle3(target, models, depth=EAGLE3_CPU["depth"], tree_topk=EAGLE3_CPU["tree_topk"],
            total_tokens=EAGLE3_CPU["total_tokens"]):
    from speclab.drafters.eagle3 import Eagle3Drafter
    return ({"eagle3": Eagle3Drafter(models["eagle3"], target, depth=depth, top_k=tree_topk, total_tokens=total_tokens)},
            FixedRouter("eagle3"))


def _dflash(target, models, block_size=DFLASH_CPU["block_size"], markov=DFLASH_CPU["markov"], tree_topk=1,
            total_tokens=16):
    from speclab.drafters.dflash import DFlashDrafter
    return ({"dflash": DFlashDrafter(models["dflash"], target, block_size=block_size, markov=bool(markov),
                                     tree_topk=tree_topk, total_tokens=total_tokens)}, FixedRouter("dflash"))


def _whiflash(policy: str):
    """WhiFlash: EAGLE-3 and DFlash under one router, each drafter configured as its standalone method (the
    paper's Table 7); `threshold` None = calibrated (speclab.routing.routers.default_threshold); `eager` = 1 keeps both
    drafters caught up every round (the naive scheme lazy catch-up is measured against)."""
    def build(target, models, threshold=None, eager=0, depth=EAGLE3_CPU["depth"], tree_topk=EAGLE3_CPU["tree_topk"],
              total_tokens=EAGLE3_CPU["total_tokens"], block_size=DFLASH_CPU["block_size"],
              markov=DFLASH_CPU["markov"], category=None):
        from speclab.routing.routers import EntropyRouter, NeuralRouter, default_threshold
        drafters = {**_eagle3(target, models, depth, tree_topk, total_tokens)[0],
                    **_dflash(target, models, block_size, markov)[0]}
        mlp = models.get("router") if policy == "neural" else None
        if threshold is None:
            threshold = default_threshold(policy, category, target.fingerprint, mlp)
        router = NeuralRouter(mlp, threshold, eager) if policy == "neural" else EntropyRouter(threshold, eager)
        return drafters, router
    return build


def _whiflash_bounds(policy: str):
    def bounds(target) -> dict:
        from speclab.routing.routers import threshold_bound
        return {"threshold": threshold_bound(policy, target.vocab_size), "eager": Bound(0, 1), **_eagle3_bounds(target),
                **{k: v for k, v in _dflash_bounds(target).items() if k in ("block_size", "markov")}}
    return bounds


def _whiflash_check(p: dict, target) -> None:
    _eagle3_check(p, target)


WHIFLASH_PARAMS = {"threshold": None, "eager": 0, **EAGLE3_CPU, **DFLASH_CPU}


def _dflash_bounds(target) -> dict:
    return {"block_size": Bound(2, min(MAX_TREE_NODES, target.max_context) + 1), "markov": Bound(0, 1),
            "tree_topk": Bound(1, target.vocab_size), "total_tokens": Bound(1, min(MAX_TREE_NODES, target.max_context))}


def _dflash_check(p: dict, target) -> None:
    _check_dynamic_tree("dflash", "block_size", p["block_size"], p["block_size"] - 1, p["tree_topk"])


def _dflash_same_decode(p: dict) -> dict:
    """Without a tree (tree_topk 1) total_tokens plays no part."""
    return {**p, "total_tokens": METHODS["dflash"].params["total_tokens"]} if p["tree_topk"] == 1 else p


def _eagle3_bounds(target) -> dict:
    return {"depth": Bound(1, target.max_context), "tree_topk": Bound(1, target.vocab_size),
            "total_tokens": Bound(1, min(MAX_TREE_NODES, target.max_context))}


def _check_dynamic_tree(method: str, name: str, value: int, depth: int, topk: int) -> None:
    """A dynamic tree (speclab.core.tree.dynamic_tree) of `depth` levels expands topk + (depth - 1) topk^2 candidates."""
    expanded = topk + (depth - 1) * topk ** 2
    if topk > 1 and expanded > 64 * MAX_TREE_NODES:
        raise InvalidInput(f"{method} tree: {name} {value} x tree_topk {topk} expands {expanded} candidate nodes, more "
                           f"than {64 * MAX_TREE_NODES}; lower {name} or tree_topk")


def _eagle3_check(p: dict, target) -> None:
    _check_dynamic_tree("eagle3", "depth", p["depth"], p["depth"], p["tree_topk"])


def _eagle3_same_decode(p: dict) -> dict:
    """A chain (tree_topk 1) drafts min(depth, total_tokens) tokens: that is all that tells two chains apart."""
    if p["tree_topk"] != 1:
        return p
    n = min(p["depth"], p["total_tokens"])
    return {**p, "depth": n, "total_tokens": n}


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
                  {"k": 4, "tree_topk": 1, "stop_prob": 0.0}, needs=("draft",), bounds=_sps_bounds,
                  check=_sps_check),
    "pld": Method("pld", "prompt lookup: n-gram match in prompt + output, no model", _pld,
                  {"k": 8, "max_ngram": 3, "min_ngram": 1}, bounds=_pld_bounds, check=_pld_check),
    "eagle3": Method("eagle3", "EAGLE-3: one-layer drafter on the target's features; dynamic tree (depth, tree_topk, "
                     "total_tokens), a chain when tree_topk = 1", _eagle3,
                     dict(EAGLE3_CPU), needs=("eagle3",), bounds=_eagle3_bounds,
                     check=_eagle3_check, gpu_params=EAGLE3_GPU_PRESET, same_decode=_eagle3_same_decode,
                     grid="depth=3,4,5,6;tree_topk=1,2,3,4;total_tokens=4,6,8,12,16"),
    "dflash": Method("dflash", "DFlash: a block of masks drafted in one forward from the target's features "
                     "(block_size rows: block_size - 1 tokens); markov = 1 adds DSpark's Markov head when the drafter "
                     "has one; tree_topk > 1 makes a tree of the rows' top-k (best total_tokens kept)", _dflash,
                     {**DFLASH_CPU, "tree_topk": 1, "total_tokens": 16}, needs=("dflash",),
                     bounds=_dflash_bounds, check=_dflash_check, gpu_params=DFLASH_GPU_PRESET,
                     same_decode=_dflash_same_decode, grid="markov=0,1;block_size=2,3,4,5,6,8,10,12,16"),
    "whiflash-entropy": Method("whiflash-entropy", "WhiFlash-Entropy: EAGLE-3 when the target's last entropy > "
                               "threshold (nats), else DFlash; threshold from data/zoo/calibration.json unless given; "
                               "eager = 1 keeps both drafters caught up every round", _whiflash("entropy"),
                               dict(WHIFLASH_PARAMS), needs=("eagle3", "dflash"), bounds=_whiflash_bounds("entropy"),
                               check=_whiflash_check, gpu_params={**EAGLE3_GPU_PRESET, **DFLASH_GPU_PRESET}),
    "whiflash-neural": Method("whiflash-neural", "WhiFlash-Neural: EAGLE-3 when the router MLP's predicted "
                              "AL_eagle3 - AL_dflash on the target's hidden state > threshold, else DFlash; threshold "
                              "calibrated (or the router's hardware-aware one) unless given", _whiflash("neural"),
                              dict(WHIFLASH_PARAMS), needs=("eagle3", "dflash", "router"), bounds=_whiflash_bounds("neural"),
                              check=_whiflash_check, gpu_params={**EAGLE3_GPU_PRESET, **DFLASH_GPU_PRESET}),
}


def parse_spec(spec: str) -> tuple[str, dict]:
    """`name` or `name:param=value+param=value` -> (registered method name, the parameters it fixes, as given).
    ('+' joins parameters, so a comma-separated list of specs stays unambiguous.)"""
    name, _, rest = str(spec).partition(":")
    if name not in METHODS:
        raise InvalidInput(f"unknown method '{name}'; registered: {', '.join(METHODS)}")
    fixed = {}
    for item in filter(None, (x.strip() for x in rest.split("+"))):
        key, eq, value = item.partition("=")
        if not eq or key.strip() not in METHODS[name].params:
            raise InvalidInput(f"method spec '{spec}': '{item}' is not param=value with a parameter of {name} "
                               f"({', '.join(METHODS[name].params) or 'none'})")
        fixed[key.strip()] = value.strip()
    return name, fixed


def get_method(spec: str) -> Method:
    return METHODS[parse_spec(spec)[0]]


def method_params(spec: str, given: dict, target) -> dict:
    """The method's parameters, checked against `target`: defaults overridden by the given ones that it knows
    (others ignored), and those by the ones the spec fixes. Defaults are the CPU ones (measured here), or the
    method's `gpu_params` when the target is on CUDA. A bad value raises InvalidInput naming the
    parameter, its value and what is allowed."""
    name, fixed = parse_spec(spec)
    m = METHODS[name]
    given = {**given, **fixed}
    bounds = m.bounds(target) if m.bounds else {}
    defaults = {**m.params, **(m.gpu_params if getattr(target.device, "type", "cpu") == "cuda" else {})}
    out = {k: _param(k, given.get(k), v, bounds.get(k, Bound())) for k, v in defaults.items()}
    if m.check:
        m.check(out, target)
    return out


def _param(name: str, value, default, bound: Bound):
    """One parameter: the given value (or the default), checked. A None default is an optional float (a router's
    threshold: None = calibrated)."""
    if default is None:
        return None if value is None or value == "" else check_number(name, value, float, bound)
    return check_number(name, default if value is None else value, type(default), bound)


def check_models(spec: str, models: dict) -> None:
    """Every drafter model the method needs is there (InvalidInput naming the missing one otherwise)."""
    for role in get_method(spec).needs:
        if models.get(role) is None:
            raise InvalidInput(f"method '{spec}' needs {ROLES[role]}")


def build_method(spec: str, target, models: dict, params: dict, category: str | None = None):
    """(drafters by name, router) of a method; AR has no drafter and no router. A routed method picks its
    calibrated threshold for `category` (the prompt's, when known)."""
    m = get_method(spec)
    if m.build is None:
        return {}, None
    return m.build(target, models, **params, **({"category": category} if "threshold" in m.params else {}))
