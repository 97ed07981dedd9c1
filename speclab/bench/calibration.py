"""Calibrating a router on a prompt suite, interactively (the app's calibration tab; `speclab calibrate` is the
batch form): find or run the suite's bench (AR for the sequences to profile, EAGLE-3 and DFlash for the cost
model), profile it, replay any threshold instantly, save the chosen one to the calibration file the routers read,
and confirm it live.

Three routers have a threshold: WhiFlash's `entropy` and `neural` (EAGLE-3 or DFlash; the bench's profiles and the
cost model fitted to it) and routing v2's `rule` (`route`'s min_match: prompt lookup's arm from that match on;
every arm of `route` profiled on the bench's AR outputs, each round modeled with the route router's arm costs,
`speclab.bench.arms.rule_sweep`).

A `Calibrator` holds one bench's profiles and cost model; every replay goes through `speclab.bench.routing` (the
sweep, the best threshold, the single drafters and the oracles of the routing report), so the figures here are the
report's. `GRIDS` are the thresholds every calibration sweeps (the CLI's defaults, the app's slider, the notebook
widget), so all of them save the same threshold for the same bench.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

import pandas as pd

from speclab.bench import routing
from speclab.errors import InvalidInput
from speclab.metrics import model_error, tau, tokens_per_s
from speclab.routing import replay
from speclab.routing.routers import (
    Calibration,
    calibration_path,
    load_calibration,
    threshold_bound,
)
from speclab.viz import Report

BENCH_METHODS = ["ar", "eagle3", "dflash"]
ROUTERS = ("entropy", "neural", "rule")
# start, stop (included), step of every calibration sweep: entropy in nats, neural in predicted Delta tau (tokens),
# rule in prompt lookup's match (tokens)
GRIDS = {"entropy": (0.0, 6.0, 0.05), "neural": (-3.0, 3.0, 0.05), "rule": (1.0, 16.0, 1.0)}
REFERENCES = ("eagle3", "dflash", "oracle-task", "oracle-prompt", "oracle-token", "oracle-token-time")


@dataclass(frozen=True)
class View:
    """How a router's calibration is named and drawn: the method and parameter its threshold belongs to, what the
    threshold is on, and which arm's share of rounds is shown."""
    method: str  # the registry method (its parameter's bound is the slider's)
    param: str  # that method's parameter the threshold sets
    label: str  # the policy in figures and messages
    signal: str  # the x axis: what the threshold is on, and which side picks what
    share: str  # the column of a sweep with the share of rounds shown
    share_name: str
    kind: type = float  # the threshold's type


VIEWS = {
    "entropy": View("whiflash-entropy", "threshold", "whiflash-entropy", "entropy (nats): EAGLE-3 above, DFlash below",
                    "eagle3_share", "EAGLE-3"),
    "neural": View("whiflash-neural", "threshold", "whiflash-neural",
                   "predicted Delta AL (tokens): EAGLE-3 above, DFlash below", "eagle3_share", "EAGLE-3"),
    "rule": View("route", "min_match", "route (rule)", "prompt lookup's match (tokens): prompt lookup from it on, "
                 "the other arm below", "pld_share", "prompt lookup", int),
}


def check_router(router: str) -> str:
    if router not in ROUTERS:
        raise InvalidInput(f"router must be one of {', '.join(ROUTERS)} (got {router!r})")
    return router


def check_threshold(router: str, threshold, vocab_size: int) -> float:
    from speclab.checks import check_number
    r = check_router(router)
    return float(check_number(VIEWS[r].param, threshold, VIEWS[r].kind, threshold_bound(r, vocab_size)))


def grid(router: str) -> list[float]:
    """The thresholds a calibration of `router` sweeps (`GRIDS`)."""
    return routing.threshold_range(*GRIDS[check_router(router)])


def grid_text(router: str) -> str:
    """`GRIDS[router]` as the CLI writes a grid: 'start:stop:step'."""
    return ":".join(f"{x:g}" for x in GRIDS[check_router(router)])


def find_bench(store, suite: str, limit: int, max_new_tokens: int, dtype: str | None = None) -> str | None:
    """The latest finished bench of `suite` with these settings (and runs in `dtype`) whose methods include AR,
    EAGLE-3 and DFlash."""
    b = store.query("SELECT bench_id, methods, config_json FROM benches WHERE suite = ? AND status = 'done' "
                    "ORDER BY started_at DESC", [suite])
    for bench_id, methods, cfg in zip(b.bench_id, b.methods, b.config_json):
        c = json.loads(cfg)
        if set(BENCH_METHODS) <= set(methods.split(",")) and c.get("limit") == limit and \
                c.get("max_new_tokens") == max_new_tokens and \
                (dtype is None or routing.bench_dtype(store, str(bench_id)) in (None, dtype)):
            return str(bench_id)
    return None


def check_suite(suite: str, limit: int) -> list[dict]:
    from speclab.bench.suites import load_suite
    rows = load_suite(suite, limit)
    if not rows:
        raise InvalidInput(f"suite '{suite}' has no prompts: nothing to calibrate on")
    return rows


@dataclass
class Calibrator:
    """One bench's profiles and fitted cost model, with the replayed curves cached per router."""
    store: object
    bench_id: str
    profiles: list
    cost: replay.CostModel
    mlp: object = None  # the neural router's MLP (neural curves need it)
    reused: bool = False  # profiles came from the trace, not made now
    curves: dict = field(default_factory=dict)
    grids: dict = field(default_factory=dict)  # router -> thresholds to sweep instead of `grid(router)`
    load: Callable | None = None  # () -> (target, models) in the bench's dtype: the rule's arms are profiled with them
    arms: dict = field(default_factory=dict)  # the rule's: every arm's profiles and round costs (`arm_view`)

    @classmethod
    def prepare(cls, store, target, models: dict, suite: str, limit: int, max_new_tokens: int, log=print,
                costs=None):
        """Reuse the trace's bench of this suite and these settings (and its profiles), or run and profile one.
        Every input is checked before any model work. `costs`: a hardware profile to replay under instead of the
        cost model fitted to the bench."""
        from speclab.bench.run import BenchConfig, run_bench
        from speclab.checks import Bound, check_number

        limit = check_number("prompts per category", limit, int, Bound(1, 64))
        max_new_tokens = check_number("max new tokens", max_new_tokens, int, Bound(8, 1024))
        check_suite(suite, limit)
        bench_id = find_bench(store, suite, limit, max_new_tokens, target.precision["dtype"])
        reused = bench_id is not None
        if bench_id is None:
            log(f"running bench of {', '.join(BENCH_METHODS)} on {suite} ...")
            cfg = BenchConfig(suite=suite, methods=list(BENCH_METHODS), limit=limit, max_new_tokens=max_new_tokens,
                              peers=False, untraced=False)
            bench_id = run_bench(cfg, target, models, store, log=log)
            store.drain()
        made = []

        def load():
            made.append(True)
            log(f"profiling bench {bench_id} ...")
            return target, models
        profiles = routing.get_profiles(store, bench_id, load, log=log)
        reused = reused and not made
        cost = costs.cost if costs is not None else replay.fit_costs(store, bench_id)
        return cls(store, bench_id, profiles, cost, models.get("router"), reused, load=lambda: (target, models))

    def routers(self) -> list[str]:
        """The routers this calibrator can replay: entropy always; neural with its MLP; rule with the models to
        profile its arms."""
        return [r for r in ROUTERS if r == "entropy" or (r == "neural" and self.mlp is not None)
                or (r == "rule" and self.load is not None)]

    def arm_view(self) -> dict:
        """The rule's replay: every arm of `route` profiled on the bench's AR outputs (made once, with progress) and
        each arm's round cost (the route router's: measured here by `speclab costs route`, else on its machine when
        it was trained)."""
        if not self.arms:
            from speclab.bench.arms import bench_arm_profiles
            from speclab.routing.local_costs import for_router
            if self.load is None:
                raise InvalidInput("the rule's calibration needs the models to profile every arm")
            if not self.cost.here:
                raise InvalidInput(f"the rule's calibration models its arms with the route router's costs, not with "
                                   f"{self.cost.label}: leave the hardware cost profile out to calibrate the rule")
            target, models = self.load()
            mlp = models.get("route")
            if mlp is None:
                raise InvalidInput("the rule's calibration models each arm's round time with the route router's cost "
                                   "model (--route-router PATH, or the zoo's)")
            profiles = bench_arm_profiles(self.store, self.bench_id, target, models)
            used = for_router(mlp, target, models)  # measured here (speclab costs route), else the shipped ones
            self.arms = {"profiles": profiles, "costs": used.costs.of(list(profiles[0].arms)), "machine": used.label}
        return self.arms

    def cost_label(self, router: str) -> str:
        """What the modeled tokens/s of a router's replay are modeled with."""
        if check_router(router) == "rule":
            return f"the route router's arm costs ({self.arm_view()['machine']})"
        return self.cost.label

    @property
    def categories(self) -> list[str]:
        return sorted({p.category for p in self.profiles if p.category}) + ["all"]

    def check_category(self, category: str) -> str:
        if category not in self.categories:
            raise InvalidInput(f"category must be one of {', '.join(self.categories)} (got {category!r})")
        return category

    def curve(self, router: str) -> pd.DataFrame:
        """tau and modeled tokens/s per (category, threshold) over the router's grid (replayed once, then cached)."""
        if router not in self.curves:
            if router == "neural" and self.mlp is None:
                raise InvalidInput("a neural calibration needs the neural router (--router-model, or the zoo's)")
            thresholds = self.grids.get(router) or grid(router)
            self.curves[router] = self._sweep(router, thresholds)
        return self.curves[router]

    def _sweep(self, router: str, thresholds, profiles=None) -> pd.DataFrame:
        """The replay of `router` at `thresholds` on the bench's prompts (or on `profiles`, some of them)."""
        if check_router(router) == "rule":
            from speclab.bench.arms import rule_sweep
            view = self.arm_view()
            ids = None if profiles is None else {p.prompt_id for p in profiles}
            mine = [p for p in view["profiles"] if ids is None or p.prompt_id in ids]
            return rule_sweep(mine, view["costs"], thresholds)
        return routing.sweep(self.profiles if profiles is None else profiles, self.cost, router, thresholds, self.mlp)

    def references(self, router: str = "entropy") -> pd.DataFrame:
        """Each drafter alone and the oracles, per category: tau and modeled tokens/s (the routing report's); and
        AR, tau 1 by definition, at the tokens/s its runs in the bench measured (`speclab.metrics.run_summary`).
        The rule's: each of its arms alone, AR (the none arm) and the two Oracle-Tokens, all modeled with its arm
        costs (`speclab.bench.arms.rule_references`)."""
        if check_router(router) == "rule":
            if "refs-rule" not in self.curves:
                from speclab.bench.arms import rule_references
                view = self.arm_view()
                self.curves["refs-rule"] = rule_references(view["profiles"], view["costs"])
            return self.curves["refs-rule"]
        if "refs" not in self.curves:
            from speclab.metrics import run_summary
            orc = routing.oracles(self.profiles, self.cost, routing.switch_backlog(self.store, self.bench_id))
            ids = routing.ar_runs(self.store, self.bench_id).run_id.tolist()
            ar = pd.concat([run_summary(self.store, ids, by="category"), run_summary(self.store, ids, by="method")
                            .assign(category="all")]) if ids else pd.DataFrame(columns=["category", "tokens_per_s"])
            ar = pd.DataFrame({"policy": "ar", "category": ar.category, "tau": 1.0, "tokens_per_s": ar.tokens_per_s})
            if not self.cost.here:  # another machine's costs: AR modeled under them too, not measured here
                ar["tokens_per_s"] = 1e3 / self.cost.ar_token_ms()
            self.curves["refs"] = pd.concat([orc[orc.policy.isin(REFERENCES)], ar], ignore_index=True)
        return self.curves["refs"]

    def ar_faster(self, router: str, category: str) -> float | None:
        """AR's tokens/s for the category where it beats the router's best modeled tokens/s (at these settings no
        threshold pays); None where the router's optimum is faster or AR has no runs."""
        refs = self.references(router)
        ar = refs[(refs.policy == "ar") & (refs.category == self.check_category(category))].tokens_per_s
        if ar.empty or pd.isna(ar.iloc[0]):
            return None
        best = float(self.best(router, category)["tokens_per_s"])
        return float(ar.iloc[0]) if float(ar.iloc[0]) > best else None

    def at_edge(self, router: str, category: str) -> bool:
        """Whether the optimum sits at an end of the swept grid (the best threshold may lie beyond it)."""
        g = self.grids.get(router) or grid(router)
        return float(self.best(router, category)["threshold"]) in (min(g), max(g))

    def at(self, router: str, threshold: float, category: str) -> dict:
        """The exact replay at one threshold (not the grid's nearest point) for one category."""
        sw = self._sweep(router, [float(threshold)])
        return sw[sw.category == self.check_category(category)].iloc[0].to_dict()

    def best(self, router: str, category: str) -> dict:
        """The best threshold's row of the curve for one category (`speclab.bench.routing.best_per_category`)."""
        return routing.best_per_category(self.curve(router)).loc[self.check_category(category)].to_dict()

    def confirm(self, target, models: dict, router: str, threshold: float, category: str, prompts: int,
                log=print) -> pd.DataFrame:
        """Decode `prompts` of the bench's prompts of `category` live at `threshold` (traced into the bench) and
        set measured tau and tokens/s beside the replayed / modeled ones for the same prompts (and the model error,
        `speclab.metrics.model_error`)."""
        view = VIEWS[check_router(router)]
        spec = f"{view.method}:{view.param}={view.kind(threshold):g}" + ("+router=rule" if router == "rule" else "")
        cat = self.check_category(category)
        chosen = [p for p in self.profiles if cat == "all" or p.category == cat][:prompts]
        routing.run_live(self.store, self.bench_id, target, models, [spec], log=log,
                         prompt_ids=[p.prompt_id for p in chosen])
        ids = [p.prompt_id for p in chosen]
        q = ",".join("?" * len(ids))
        runs = self.store.query(f"""SELECT run_id, new_tokens, rounds, elapsed_s FROM runs WHERE bench_id = ? AND
                                    method = ? AND status = 'done' AND prompt_id IN ({q}) ORDER BY run_id DESC
                                    LIMIT ?""", [self.bench_id, spec, *ids, len(ids)])
        sw = self._sweep(router, [float(threshold)], chosen)
        modeled = sw[sw.category == "all"].iloc[0]
        measured_tps = tokens_per_s(runs.new_tokens.sum(), runs.elapsed_s.sum())
        return pd.DataFrame([{"threshold": float(threshold), "category": cat, "prompts": len(runs),
                              "tau_live": tau(runs.new_tokens.sum(), runs.rounds.sum()), "tau_replay": modeled.tau,
                              "tokens_per_s_live": measured_tps, "tokens_per_s_modeled": modeled.tokens_per_s,
                              "model_error": model_error(modeled.tokens_per_s, measured_tps)}])


def calibrate(cal: Calibrator, routers) -> tuple[dict, Report]:
    """The best threshold per category (and '*': the best single one over all) of each router on the calibrator's
    bench, by replay over its grid: {router: {category: threshold}} (what `save_thresholds` writes) and the
    report (each drafter alone and the oracles for reference, each router's best rows and its sweep)."""
    from speclab import viz
    text, best, figs = [], {}, []
    families = (["entropy"] if set(routers) & {"entropy", "neural"} else []) + (["rule"] if "rule" in routers else [])
    for family in families:  # WhiFlash's references (both its routers') and the rule's
        refs = cal.references(family)
        text += [f"## For reference{' (route: its arms)' if family == 'rule' else ''}: each drafter alone and the "
                 f"oracles (replayed, modeled tokens/s)", "",
                 refs[["policy", "category", "tau", "tokens_per_s"]].to_markdown(index=False, floatfmt=".3f"), ""]
    for r in routers:
        sw, view = cal.curve(r), VIEWS[r]
        best[r] = routing.best_thresholds(sw)
        top = routing.best_per_category(sw)
        text += [f"## {view.label}: best {view.param} per category (modeled tokens/s)", "",
                 top[["category", "threshold", "tau", "tokens_per_s", "switches", view.share]]
                 .to_markdown(index=False, floatfmt=".3f"), ""]
        figs.append(viz.sweep_figure(sw, None, "tokens_per_s", f"{view.label}: modeled tokens/s by {view.param} "
                                     f"({cal.cost_label(r)})"))
    title = "Router calibration" if "rule" in routers else "WhiFlash calibration"
    return best, Report(title, "\n".join(text), figs)


def merged(old: dict, new: dict) -> dict:
    """`old` updated by `new`, a key whose values are both dicts merged the same way, so that one router's
    provenance (its sweep's `grids` entry, a profile's or the rule's section) never drops another's."""
    out = dict(old)
    for k, v in new.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def save_thresholds(router: str, thresholds: dict, fingerprint: str, info: dict, path=None,
                    profile: str | None = None) -> Calibration:
    """Write `thresholds` ({category, or '*' / 'all' for the global one: value}) for `router` into the calibration
    file (the routers' one by default), keeping the other entries; a file calibrated for another target starts
    afresh. With `profile` (a hardware cost profile's name) they go to that profile's entry, not to the thresholds
    the routers here use."""
    from pathlib import Path

    from speclab.files import check_writable
    out = Path(path) if path else calibration_path()
    try:  # a file that cannot be written is one message, and the file keeps its earlier thresholds
        check_writable(out, "the calibration file")
    except ValueError as e:
        raise InvalidInput(f"cannot save to {out}: {e}; nothing was saved") from e
    cal = load_calibration(out) if out.exists() else Calibration()
    if cal.target and cal.target != fingerprint:
        cal = Calibration()
    cal.target = fingerprint
    per = (cal.profiles.setdefault(profile, {}) if profile else cal.thresholds).setdefault(router, {})
    per.update({("*" if k == "all" else str(k)): float(v) for k, v in thresholds.items()})
    cal.info = merged(cal.info, info)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        cal.save(out)  # written whole, then renamed
    except OSError as e:
        raise InvalidInput(f"cannot save to {out}: {e.strerror or e}; nothing was saved") from e
    return cal
