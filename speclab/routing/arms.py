"""Routing v2's arms and the `route` method: route among any registered drafters, merged arms and "none".

An *arm* is what one round drafts with:
- a registered drafter (`eagle3`, `pld`, ...), built with its own method's defaults;
- a *merged arm*, its members joined by '.' (`pld.eagle3`): every member proposes at the same root, the proposals
  become one tree (shared point-mass prefixes merged, `speclab.core.tree.merge`) and ONE target call verifies them
  all, greedy or by recursive rejection with each candidate tested against its own drafter's q (`Merged`);
- `none`: the target steps alone (one row; what a router picks where no drafter pays, as under sampling).

`route:arms=eagle3+dflash+pld+none` lists the arms ('+'-joined; in a method spec the items after `arms=` that hold
no '=' continue the list, `Param.many`). Every drafter is built once and shared by the arms it is in (the pool
catches each up as itself, lazily: a merged arm's members catch up when it is chosen, `speclab.core.pool`).

Routers (`router`): `rule` (the hand-written baseline: prompt lookup's arm while its current match is at least
`min_match` tokens, else the first other arm; `speclab.routing.routers.RuleRouter`; `min_match` calibrated per
category by `speclab calibrate --router rule` unless given). One arm alone is that arm
every round (a merged arm measured on its own: `route:arms=pld.eagle3`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from speclab.checks import Bound
from speclab.core.sampling import Sampling
from speclab.core.tree import DraftTree, merge
from speclab.drafters.registry import ModelRole, Param, build_drafter, drafters
from speclab.errors import InvalidInput
from speclab.routing.routers import JOIN, LOOKUP, MIN_MATCH, MIN_MATCH_RANGE, NONE, load_arm_router

DEFAULT_ARMS = "eagle3+dflash+pld+none"
ROUTERS = ("learned", "rule")
ROUTER = "rule"  # the default: it beat the learned router on the zoo, live and in replay (README, "Routing v2")

ROUTE_ROLE = ModelRole("route", "--route-router", "route router", "a routing v2 router",
                       lambda path, target, paths: load_arm_router(path, target), zoo="route",
                       card="data/zoo/route/README.md",
                       help="the learned router of the route method (default: the zoo's; speclab train route)")

DESCRIPTION = ("routing v2: a router picks each round's arm among registered drafters, merged arms (members joined "
               "by '.', verified in one call: pld.eagle3) and none (the target alone); rule = prompt lookup while "
               "its match is at least min_match tokens, else the first other arm")


@dataclass(frozen=True)
class Arm:
    name: str  # as written: "eagle3", "pld.eagle3", "none"
    members: tuple[str, ...]  # its drafters; () for none

    @property
    def merged(self) -> bool:
        return len(self.members) > 1


def parse_arms(text: str) -> list[Arm]:
    """The arms of `route:arms=...`, checked against the registry (InvalidInput, one line, before any model)."""
    items = [x.strip() for x in str(text).split("+")]
    if not items or any(not x for x in items):
        raise InvalidInput(f"arms {text!r}: give arms joined by '+', e.g. {DEFAULT_ARMS} (a merged arm joins "
                           f"drafters with '{JOIN}': pld{JOIN}eagle3)")
    known = drafters()
    arms = []
    for item in items:
        members = () if item == NONE else tuple(m.strip() for m in item.split(JOIN))
        if any(not m for m in members):
            raise InvalidInput(f"arms: {item!r} has an empty member (a merged arm joins drafters with '{JOIN}': "
                               f"pld{JOIN}eagle3)")
        for m in members:
            if m not in known:
                raise InvalidInput(f"arms: {m!r} (in arm {item!r}) is not a registered drafter; registered: "
                                   f"{', '.join(known)}, and {NONE} (no draft)")
        if len(set(members)) < len(members):
            raise InvalidInput(f"arms: the merged arm {item!r} names a drafter twice")
        if len(members) > 1:
            alone = [m for m in members if known[m].hooks]
            if alone:
                raise InvalidInput(f"arms: {alone[0]} cannot be merged ({item!r}): its own rows ride in the "
                                   "verification call, so it drafts alone")
        arms.append(Arm(item, members))
    names = [a.name for a in arms]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise InvalidInput(f"arms: {dup[0]} is listed twice")
    return arms


def needs(fixed: dict) -> tuple[str, ...]:
    """The model roles a route spec needs: its arms' drafters' models (`speclab.methods.Method.needs_of`)."""
    try:
        arms = parse_arms(fixed.get("arms", DEFAULT_ARMS))
    except InvalidInput:
        arms = parse_arms(DEFAULT_ARMS)  # the spec's own check says what is wrong
    roles = [drafters()[m].model.role for a in arms for m in a.members if drafters()[m].model is not None]
    if fixed.get("router", ROUTER) == "learned" and len(arms) > 1:
        roles.append(ROUTE_ROLE.role)
    return tuple(dict.fromkeys(roles))


# The rule's min_match at T > 0: the longest match prompt lookup's probe measures. The calibration is greedy; at T > 0 a
# looked-up token is accepted with the target's p(x), which on the zoo's prompts averages 0.1-0.35 after matches of 1-3
# tokens (session 54), and `route` at its calibrated thresholds ran 0.91x / 0.94x `route:min_match=32` at T = 0.7 / 1
# (benches zoo-20261204-200434-6ab8fb, -200351-887e85; README "Routing v2")
SAMPLED_MIN_MATCH = MIN_MATCH_RANGE[1]

PARAMS = (
    Param("arms", DEFAULT_ARMS, many=True,
          help=f"the arms a router picks from, '+'-joined: registered drafters, merged arms (members joined by "
               f"'{JOIN}', verified in one call) and {NONE} (the target alone)"),
    Param("router", ROUTER, choices=ROUTERS,
          help="how each round's arm is picked: learned (the trained router: the most predicted tokens per ms, "
               "speclab train route) or rule (prompt lookup while its match is at least min_match tokens, else the "
               "first other arm)"),
    Param("min_match", None, lambda t: Bound(*MIN_MATCH_RANGE), optional=int, sampled=SAMPLED_MIN_MATCH,
          help="the rule router: the prompt lookup match (tokens) from which prompt lookup's arm drafts; default: "
               f"calibrated (speclab calibrate --router rule: your file, else the zoo's), else {MIN_MATCH}; at T > 0 "
               f"{SAMPLED_MIN_MATCH} (a looked-up token is accepted with p(x), measured)"),
)


def check(p: dict, target) -> None:
    arms = parse_arms(p["arms"])
    if p["router"] == "rule" and len(arms) > 1 and not any(a.members == (LOOKUP,) for a in arms):
        raise InvalidInput(f"the rule router routes between prompt lookup and the others: arms {p['arms']!r} have no "
                           f"{LOOKUP} arm (add +{LOOKUP}, or give one arm to run it alone)")


class Merged:
    """A merged arm as one drafter of the decode (`speclab.core.protocol.Composite`): its members propose at the same
    root, `speclab.core.tree.merge` makes one tree of their proposals, and at commit each member keeps what it
    proposed of the accepted path (the longest accepted prefix inside its own tree). The pool catches the members
    up, each as itself; this drafter holds no sequence state of its own."""
    layers: tuple[int, ...] = ()

    def __init__(self, name: str, members: dict):
        self.name, self.parts = name, members
        self.members = tuple(members)
        self._trees: list[DraftTree] = []
        self._maps: list[torch.Tensor] = []

    def reset(self, prompt_ids: torch.Tensor, prompt_features=None, capacity: int | None = None) -> None:
        self._trees, self._maps = [], []

    def catch_up(self, ids: torch.Tensor, features=None) -> None:
        """Nothing: the pool catches the members up (`DrafterPool.catch_up`)."""

    def propose(self, max_depth: int, sampling: Sampling, generator: torch.Generator | None) -> DraftTree:
        self._trees = [d.propose(max_depth, sampling, generator) for d in self.parts.values()]
        tree, self._maps = merge(self._trees)
        return tree

    def commit(self, tree: DraftTree, accepted: torch.Tensor) -> None:
        path = accepted.tolist()
        for d, own, where in zip(self.parts.values(), self._trees, self._maps):
            mine = {int(j): i for i, j in enumerate(where.tolist())}  # merged node -> the member's
            kept = []
            for a in path:
                if a not in mine:
                    break
                kept.append(mine[a])
            d.commit(own, torch.tensor(kept, dtype=torch.long, device=own.tokens.device))


def rule_other(arms) -> str | None:
    """The arm the rule router takes where prompt lookup's match is short: the first arm that is not prompt lookup's
    (None for the none arm: the target alone)."""
    other = next(a for a in arms if a != LOOKUP)
    return None if other == NONE else other


def build(target, models, arms=DEFAULT_ARMS, router=ROUTER, min_match=None, category=None, sampled=False, **_):
    """(drafters by name, router) of a route spec: each drafter once (its method's defaults; at T > 0 for a
    `sampled` decode: EAGLE-3's shorter chain), each merged arm a
    `Merged` over those same instances, and the router over the arm names. The rule's `min_match` None = calibrated
    for `category` (`speclab.routing.routers.default_threshold`)."""
    from speclab.core.protocol import FixedRouter
    from speclab.routing.local_costs import for_router
    from speclab.routing.routers import ArmRouter, RuleRouter, default_threshold
    parsed = parse_arms(arms)
    built: dict = {}
    for a in parsed:
        for m in a.members:
            if m not in built:
                role = drafters()[m].model
                if role is not None and models.get(role.role) is None:
                    raise InvalidInput(f"arm {a.name!r} needs {role.noun} ({role.option} PATH, or the zoo's)")
                built[m] = build_drafter(m, target, models, sampled=sampled)
    for a in parsed:
        if a.merged:
            built[a.name] = Merged(a.name, {m: built[m] for m in a.members})
    names = [None if a.name == NONE else a.name for a in parsed]
    if len(names) == 1:
        return built, FixedRouter(names[0])
    if router == "learned":
        mlp = models.get(ROUTE_ROLE.role)
        if mlp is None:
            raise InvalidInput(f"route:router=learned needs {ROUTE_ROLE.noun} ({ROUTE_ROLE.option} PATH, or the zoo's)")
        unknown = [a.name for a in parsed if a.name not in mlp.config.arms]
        if unknown:
            raise InvalidInput(f"the route router at {getattr(mlp, 'name', '?')} knows the arms "
                               f"{'+'.join(mlp.config.arms)}, not {', '.join(unknown)}: pick among them, use "
                               "router=rule, or train one for these arms (speclab train route --arms ...)")
        return built, ArmRouter(mlp, [a.name for a in parsed], for_router(mlp, target, models).costs)
    look = next(a.name for a in parsed if a.members == (LOOKUP,))
    other = rule_other([a.name for a in parsed])
    if min_match is None:
        min_match = round(default_threshold("rule", category, target.fingerprint))
    return built, RuleRouter(look, other, min_match)
