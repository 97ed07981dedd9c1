"""Routing v2's round costs measured on this machine (`speclab costs route`), kept in the per-user cache.

The learned router (`routers.ArmRouter`) divides each arm's predicted tokens by that arm's modeled round time
(`routers.ArmCosts`). The router's config ships the costs measured where it was trained (`speclab train route`: one
machine, one dtype, the code of that day); elsewhere, or once the code got faster, they are another machine's. On
the AMD EPYC (session 37) the zoo router's costs, fitted on an Intel Xeon, modeled the live routed runs of a bench
27-34% slower than they ran; the same model measured here in a few seconds came within 7% (README, "Routing v2").

`speclab costs route` measures them here, as training does (`speclab.train.route.measure_costs`: each arm's rounds
live on a few corpus prompts, and the router's own time a round), and keeps them in `cache_dir()/route-costs.json`
under a key of everything they depend on: this machine (`precision.machine`: CPU, cores and threads, torch, how
products and attention run, the native code's hash), the target, its dtype, the router's arms and the shapes of
their drafters' models. `for_router` hands a router the costs measured here where the key matches, else the ones
it shipped with, and says which (`RouteCosts.label`: route-table's report names it).
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from speclab.core import precision
from speclab.drafters.registry import drafters
from speclab.files import cache_dir, write_atomic
from speclab.routing.routers import JOIN, NONE, ArmCosts

FORMAT, VERSION = "speclab-route-costs", 1


@dataclass
class RouteCosts:
    """The round costs a learned router uses, and where they come from."""
    costs: ArmCosts  # over the router's own arms (`ArmCosts.of` picks a route's)
    label: str  # one line for reports: measured here (when), or shipped (where they were measured)
    here: bool  # measured on this machine (`speclab costs route`)


def cache_path() -> Path:
    return cache_dir() / "route-costs.json"


def key(target, models: dict, arms: list) -> str:
    """The cache key of costs measured for the router's `arms` with these models on this machine."""
    roles = sorted({drafters()[m].model.role for a in arms if a != NONE for m in a.split(JOIN)
                    if drafters()[m].model is not None})
    shapes = {r: [(n, list(t.shape), str(t.dtype)) for n, t in models[r].state_dict().items()]
              for r in roles if models.get(r) is not None}
    what = [precision.machine(), target.fingerprint, str(target.dtype), list(arms), shapes]
    return hashlib.sha1(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def _entries() -> dict:
    """The cache's entries; {} for a missing, unreadable or foreign file (the router then uses its shipped costs)."""
    try:
        data = json.loads(cache_path().read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    ok = isinstance(data, dict) and data.get("format") == FORMAT and data.get("version") == VERSION \
        and isinstance(data.get("entries"), dict)
    return data["entries"] if ok else {}


def for_router(mlp, target, models: dict) -> RouteCosts:
    """The costs a learned router `mlp` (`routers.ArmRouterMLP`) uses with these models on this machine: measured
    here when the cache holds them for this key, else those it shipped with."""
    arms = list(mlp.config.arms)
    entry = _entries().get(key(target, models, arms))
    if isinstance(entry, dict):
        try:
            costs = ArmCosts(**entry["costs"])
            terms = [costs.draft, costs.catchup0, costs.catchup1, costs.other, costs.width]
            numbers = [x for t in terms for x in t] + [costs.verify0, costs.verify1, costs.router_ms]
            if costs.arms == arms and all(len(t) == len(arms) for t in terms) and \
                    all(isinstance(x, (int, float)) and math.isfinite(x) for x in numbers):
                return RouteCosts(costs, f"measured here ({entry.get('machine_label', '?')}, "
                                         f"{entry.get('measured_at', '?')}: speclab costs route)", True)
        except (KeyError, TypeError, ValueError):
            pass  # a malformed entry: the shipped costs, as with none
    return RouteCosts(ArmCosts(**mlp.config.costs), f"shipped with the router: measured on {mlp.config.machine} "
                      "when it was trained (speclab costs route measures this machine's)", False)


def store(mlp, target, models: dict, costs: ArmCosts, how: dict) -> Path:
    """Keep `costs` (over the router's arms, measured here) for this key; the file's other entries stay, a corrupt
    or foreign file is replaced. Written whole (a temporary file, then one rename)."""
    entries = _entries()
    entries[key(target, models, list(mlp.config.arms))] = {
        "costs": asdict(costs), "how": how, "machine_label": f"{precision.cpu_label()}, {target.precision['dtype']}",
        "measured_at": time.strftime("%Y-%m-%d %H:%M"), "machine": precision.machine()}
    return write_atomic(cache_path(), json.dumps({"format": FORMAT, "version": VERSION, "entries": entries},
                                                 indent=1) + "\n")
