"""The decoding methods, made from the registry: what the CLI, the app and the benchmarks list and build.

Every drafter's methods come from its registry entry (`speclab.drafters.registry`), the routed ones from
`speclab.routing.whiflash`; AR is the method without drafters. A method builds its drafters *and* its router,
so a method can hold several drafters (a router then picks one every round).

A method builds from the target and the models it `needs`, by role (`ROLES`: `draft`, `eagle3`, `dflash`,
`router`). A method *spec* names a method with some of its parameters fixed, `name:param=value+param=value`
(`eagle3:tree_topk=1` is the EAGLE-3 chain): the bench and the CLI take specs, and a run's `method` column keeps
the spec, so variants of one method stay apart in every table.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from speclab.checks import Bound, check_number
from speclab.core.protocol import FixedRouter
from speclab.drafters.registry import ModelRole, Param, build_drafter, drafters
from speclab.drafters.schedule import PaysRouter
from speclab.errors import InvalidInput


@dataclass(frozen=True)
class Method:
    name: str
    description: str
    params: tuple[Param, ...] = ()
    needs: tuple[str, ...] = ()  # models by role (`ROLES`)
    drafter: str | None = None  # a single-drafter method: its registered drafter (built with a FixedRouter)
    build: Callable | None = None  # a routed method: (target, models, category=..., **params) -> (drafters, router)
    check: Callable | None = None  # (params, target) -> None: checks across parameters (raise InvalidInput)
    same_decode: Callable | None = None  # params -> the params that decode alike (parameter grids run each once)
    needs_of: Callable | None = None  # the parameters a spec fixes -> the roles it needs, where they depend on them
    # (a route's arms); `needs` holds the defaults'

    @property
    def defaults(self) -> dict:
        """Parameter -> CPU default (its type is the parameter's type; None: an optional value, calibrated)."""
        return {p.name: p.default for p in self.params}

    @property
    def gpu_params(self) -> dict:
        """The defaults that differ on CUDA (the papers' GPU settings)."""
        return {p.name: p.gpu for p in self.params if p.gpu is not None}

    def bounds(self, target) -> dict[str, Bound]:
        return {p.name: p.bound(target) for p in self.params}

    @property
    def grid(self) -> str:
        """The parameter grid `speclab grid` sweeps by default (`speclab.bench.grid.parse_grid` syntax)."""
        return ";".join(f"{p.name}={','.join(map(str, p.grid))}" for p in self.params if p.grid)


@functools.lru_cache(maxsize=4)
def _methods(registered: tuple[str, ...]) -> dict[str, Method]:
    from speclab.routing import arms, whiflash
    out = {"ar": Method("ar", "autoregressive baseline: one target call per token")}
    for e in drafters().values():
        for name, description in e.methods.items():
            out[name] = Method(name, description, e.params, (e.model.role,) if e.model else (), drafter=e.name,
                               check=e.check, same_decode=e.same_decode)
    out["route"] = Method("route", arms.DESCRIPTION, arms.PARAMS, arms.needs({}), build=arms.build, check=arms.check,
                          needs_of=arms.needs)
    for policy in ("entropy", "neural"):
        name = f"whiflash-{policy}"
        out[name] = Method(name, whiflash.DESCRIPTIONS[policy], whiflash.params(policy),
                           ("eagle3", "dflash", "router") if policy == "neural" else ("eagle3", "dflash"),
                           build=whiflash.build(policy), check=whiflash.check)
    return out


@functools.lru_cache(maxsize=4)
def _roles(registered: tuple[str, ...]) -> dict[str, ModelRole]:
    from speclab.routing.arms import ROUTE_ROLE
    from speclab.routing.whiflash import ROUTER_ROLE
    return {**{e.model.role: e.model for e in drafters().values() if e.model}, ROUTER_ROLE.role: ROUTER_ROLE,
            ROUTE_ROLE.role: ROUTE_ROLE}


class _FromRegistry(Mapping):
    """A read-only view made from the drafter registry as it is now: a drafter registered at run time
    (`registry.register`) appears in it at once (made again only when the registered drafters change)."""

    def __init__(self, make: Callable[[tuple[str, ...]], dict]):
        self._make = make

    def _now(self) -> dict:
        return self._make(tuple(drafters()))

    def __getitem__(self, key):
        return self._now()[key]

    def __iter__(self):
        return iter(self._now())

    def __len__(self) -> int:
        return len(self._now())


METHODS: Mapping[str, Method] = _FromRegistry(_methods)
ROLES: Mapping[str, ModelRole] = _FromRegistry(_roles)  # every model a method may need, by role


def all_params() -> dict[str, list[Param]]:
    """Every parameter name any method takes -> its declarations (the CLI makes one option per name)."""
    return _all_params(tuple(drafters()))


@functools.lru_cache(maxsize=4)
def _all_params(registered: tuple[str, ...]) -> dict[str, list[Param]]:
    out: dict[str, list[Param]] = {}
    for m in METHODS.values():
        for p in m.params:
            if all(q.help != p.help for q in out.setdefault(p.name, [])):
                out[p.name].append(p)
    return out


SPEC_DTYPES = ("fp32", "bf16", "fp16")


def split_dtype(spec: str) -> tuple[str, str | None]:
    """A spec may pin the dtype its run decodes in with a suffix: 'eagle3:depth=6@bf16' -> ('eagle3:depth=6',
    'bf16'); without one, (spec, None): the run takes the command's --dtype."""
    base, at, dt = str(spec).partition("@")
    if at and dt not in SPEC_DTYPES:
        raise InvalidInput(f"method spec '{spec}': '@{dt}' is not a dtype a method runs in: write "
                           f"{', '.join('@' + d for d in SPEC_DTYPES)}")
    return base, dt or None


def parse_spec(spec: str) -> tuple[str, dict]:
    """`name` or `name:param=value+param=value` (optionally `@dtype`, `split_dtype`) -> (registered method name, the
    parameters it fixes, as given). ('+' joins parameters, so a comma-separated list of specs stays unambiguous.)"""
    name, _, rest = split_dtype(spec)[0].partition(":")
    if name not in METHODS:
        raise InvalidInput(f"unknown method '{name}'; registered: {', '.join(METHODS)}")
    fixed: dict[str, str] = {}
    many = {p.name for p in METHODS[name].params if p.many}
    key = ""
    for item in filter(None, (x.strip() for x in rest.split("+"))):
        if "=" not in item and key in many:  # the next item of a '+'-joined list (`Param.many`)
            fixed[key] += "+" + item
            continue
        key, eq, value = item.partition("=")
        if not eq or key.strip() not in METHODS[name].defaults:
            raise InvalidInput(f"method spec '{spec}': '{item}' is not param=value with a parameter of {name} "
                               f"({', '.join(METHODS[name].defaults) or 'none'})")
        key = key.strip()
        fixed[key] = value.strip()
    for p in METHODS[name].params:  # named choices need no target: checked here, before any model loads
        if p.choices and p.name in fixed:
            _choice(p, fixed[p.name])
    return name, fixed


def get_method(spec: str, given: dict | None = None) -> Method:
    """The method of a spec; its `needs` those of the spec's parameters (and the `given` ones under them: a
    command's options), where they depend on them (a route's arms)."""
    name, fixed = parse_spec(spec)
    m = METHODS[name]
    if m.needs_of is None:
        return m
    from dataclasses import replace
    return replace(m, needs=m.needs_of({**{k: v for k, v in (given or {}).items() if v is not None}, **fixed}))


def method_params(spec: str, given: dict, target, sampled: bool = False) -> dict:
    """The method's parameters, checked against `target`: defaults overridden by the given ones that it knows
    (others ignored), and those by the ones the spec fixes. Defaults are the CPU ones (measured here; for a
    `sampled` decode, T > 0, those measured there), or the GPU presets when the target is on CUDA. A bad value
    raises InvalidInput naming the parameter, its value and what is allowed."""
    name, fixed = parse_spec(spec)
    m = METHODS[name]
    given = {**given, **fixed}
    out = {p.name: _param(p, given.get(p.name), p.default_on(target, sampled), target) for p in m.params}
    if m.check:
        m.check(out, target)
    return out


def check_before_loading(spec: str, given: dict, target_dir=None) -> None:
    """The method's parameters checked before any weights load (InvalidInput, one line): against the shape the
    target's config.json gives (its vocabulary and context, what the bounds read; `target_dir` None: the zoo's). A
    check that needs more of the loaded target is left to `method_params` after loading, and so is a target without
    a readable config.json (the loader names the missing model)."""
    import contextlib
    import json
    from pathlib import Path
    from types import SimpleNamespace

    from speclab import zoo
    from speclab.errors import ModelNotFound
    try:
        c = json.loads((Path(target_dir or zoo.default_target()) / "config.json").read_text())
        shape = SimpleNamespace(vocab_size=int(c["vocab_size"]), device=SimpleNamespace(type="cpu"),
                                max_context=int(c.get("max_position_embeddings", 2048)))
    except (OSError, ValueError, KeyError, TypeError, ModelNotFound):
        return
    with contextlib.suppress(AttributeError, TypeError):  # a bound or check reading more of the target than its shape
        method_params(spec, given, shape)


def _param(p: Param, value, default, target):
    """One parameter: the given value (or the default), checked. A None default is an optional value of the
    parameter's `kind` (a router's threshold: None = calibrated)."""
    if p.choices:
        return _choice(p, default if value is None else value)
    if p.many:  # a list, checked by the method's own `check`
        return str(default if value is None else value).strip()
    if default is None:
        return None if value is None or value == "" else check_number(p.name, value, p.kind, p.bound(target))
    return check_number(p.name, default if value is None else value, type(default), p.bound(target))


def _choice(p: Param, value) -> str:
    v = str(value).strip()
    if v not in p.choices:
        raise InvalidInput(f"{p.name} must be one of {', '.join(p.choices)} (got {value!r})")
    return v


def check_models(spec: str, models: dict) -> None:
    """Every model the method needs is there (InvalidInput naming the missing one otherwise)."""
    for role in get_method(spec).needs:
        if models.get(role) is None:
            r = ROLES[role]
            raise InvalidInput(f"method '{spec}' needs {r.noun} ({r.option} PATH, or the zoo's)")


def build_method(spec: str, target, models: dict, params: dict, category: str | None = None, sampled: bool = False):
    """(drafters by name, router) of a method; AR has no drafter and no router. A routed method picks its
    calibrated threshold for `category` (the prompt's, when known), and builds the drafters its parameters do not
    set (a route's arms) with their defaults at T > 0 for a `sampled` decode."""
    m = get_method(spec)
    if m.build is not None:
        return m.build(target, models, category=category, sampled=sampled, **params)
    if m.drafter is None:
        return {}, None
    pays = params.get("pays") or 0  # stand down where drafting does not pay (`speclab.drafters.schedule`)
    router = PaysRouter(m.drafter, pays, params.get("probe") or 0) if pays > 0 else FixedRouter(m.drafter)
    return {m.drafter: build_drafter(m.drafter, target, models, **params)}, router
