"""Routing commands (WhiFlash) on a bench: `speclab profile` (counterfactual profiles), `sweep` (a router's
thresholds by replay, and live), `calibrate` (the best thresholds into the calibration file) and `routing` (the
paper's Table 1 and the rest of the report). Every figure and table comes from `speclab.routing`."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from speclab.cli.common import _num, _positive_int, add_ray_args, cluster_args, write_report
from speclab.errors import SpeclabError
from speclab.models import ModelPaths, add_model_args, load_models
from speclab.viz import Report


def _bench_store(a: argparse.Namespace):
    """The bench's trace (opened for writing: profiles and live runs go in) and the bench id (default: latest)."""
    from speclab.bench.routing import bench_info, latest_bench
    from speclab.trace import TraceStore

    if not Path(a.db).exists():
        raise SpeclabError(f"no trace database at {a.db}: run `speclab bench` first (with ar, eagle3 and dflash)")
    store = TraceStore(a.db)
    bench_id = a.bench or latest_bench(store)
    bench_info(store, bench_id)
    return store, bench_id


def _bench_paths(a: argparse.Namespace, store, bench_id: str) -> ModelPaths:
    """The models of the options in the bench's dtype (profiles and live runs added to a bench compute as its runs
    did): --dtype auto means the bench's; another dtype than the bench's is refused."""
    from dataclasses import replace

    from speclab.bench.routing import bench_dtype
    from speclab.core.precision import DTYPES, dtype_option

    paths, want = ModelPaths.from_args(a), bench_dtype(store, bench_id)
    paths.check()
    if want is None:
        return paths
    if paths.dtype in (None, "auto"):
        return replace(paths, dtype=want)
    if DTYPES[paths.dtype] != DTYPES[want]:
        raise SpeclabError(f"--dtype {paths.dtype}: bench {bench_id} ran in {want}; its profiles and live runs are "
                           f"made in the same dtype (leave --dtype out, or give {dtype_option(want)})")
    return paths


def _costs(a: argparse.Namespace):
    """The hardware cost profile of --costs (checked now, before any trace or model opens), or None."""
    from speclab.routing.hardware import load_profile
    return load_profile(a.costs) if getattr(a, "costs", None) else None


def _routing_setup(a: argparse.Namespace, store, bench_id: str, need_mlp: bool, profile=None, rule: bool = False):
    """Profiles (made when missing), the cost model (a hardware profile's, else fitted to the bench), the neural
    router when needed and the loader of the models (with `rule`, also route's arms and its router's arm costs)."""
    from speclab.bench.routing import check_profilable, get_profiles
    from speclab.routing.replay import fit_costs

    loaded, paths = {}, _bench_paths(a, store, bench_id)

    def load():
        if not loaded:
            roles = ("eagle3", "dflash") + (("router",) if need_mlp else ()) + (_rule_roles() if rule else ())
            loaded["m"] = load_models(paths, roles=tuple(dict.fromkeys(roles)))
        return loaded["m"]

    cost = fit_costs(store, bench_id)  # before any model loads: a bench without the drafters' rounds fails fast
    if profile is not None:
        cost = profile.cost
    check_profilable(store, bench_id)
    profiles = get_profiles(store, bench_id, load, log=lambda s: print(s, file=sys.stderr))
    mlp = load()[1]["router"] if need_mlp else None
    return profiles, cost, mlp, load


def _rule_roles() -> tuple[str, ...]:
    """The models the rule's calibration loads: its default arms' drafters and the route router (its arm costs)."""
    from speclab.methods import get_method
    return tuple(dict.fromkeys(get_method("route").needs + ("route",)))


def cmd_profile(a: argparse.Namespace) -> int:
    from speclab.bench.routing import check_profilable, profile_bench, profile_table

    store, bench_id = _bench_store(a)
    with store:
        check_profilable(store, bench_id)
        paths = _bench_paths(a, store, bench_id)
        cl = cluster_args(a)
        log = lambda s: print(s, file=sys.stderr)  # noqa: E731
        target, models = load_models(paths, roles=("eagle3", "dflash"))
        if cl is None:
            profs = profile_bench(store, bench_id, target, models, log=log)
        else:  # each prompt profiled on a worker, the models loaded there in the bench's dtype
            from speclab import cluster
            try:
                profs = profile_bench(store, bench_id, target, models, log=log,
                                      profiles=cluster.bench_profiles(cl, paths.absolute(), log))
            finally:
                cluster.stop(cl)
    write_report(Report(f"profiles of bench {bench_id}", profile_table(profs).to_markdown(index=False, floatfmt=".3f")),
                 None)
    print(f"\nprofiles of bench {bench_id}: tables profiles / profile_positions in {a.db}")
    return 0


def _router(text: str) -> str:
    if text not in ("entropy", "neural"):
        raise SpeclabError(f"--router must be entropy or neural (got {text!r})")
    return text


def cmd_sweep(a: argparse.Namespace) -> int:
    from speclab.bench.calibration import grid_text
    from speclab.bench.routing import live_specs, parse_thresholds, run_live, sweep_report

    router = _router(a.router)
    grid = parse_thresholds(a.grid or grid_text(router))
    live_pts = parse_thresholds(a.live) if a.live else []
    profile = _costs(a)
    if profile is not None and live_pts:
        raise SpeclabError("--live with --costs: live runs are measured on this machine, the replay under --costs "
                           "models another's; leave --costs out to set live runs beside the local cost model")
    store, bench_id = _bench_store(a)
    with store:
        profiles, cost, mlp, load = _routing_setup(a, store, bench_id, router == "neural", profile)
        if live_pts:
            target, models = load()
            run_live(store, bench_id, target, models, live_specs(router, live_pts),
                     log=lambda s: print(s, file=sys.stderr))
        report = sweep_report(store, bench_id, profiles, cost, router, grid, mlp, live_pts)
    write_report(report, a.report)
    return 0


def cmd_calibrate(a: argparse.Namespace) -> int:
    from speclab.bench.calibration import ROUTERS, Calibrator, calibrate, check_threshold, grid_text, save_thresholds
    from speclab.bench.routing import parse_thresholds
    from speclab.routing.routers import calibration_path

    routers = list(dict.fromkeys(r.strip() for r in a.router.split(",") if r.strip()))
    bad = [r for r in routers if r not in ROUTERS]
    if bad or not routers:
        raise SpeclabError(f"--router must be among {', '.join(ROUTERS)}, comma-separated (got {a.router!r})")
    given = {"entropy": a.entropy_grid, "neural": a.neural_grid, "rule": a.rule_grid}
    grids = {r: parse_thresholds(text) for r, text in given.items() if text}  # the rest: the calibration grid
    for t in grids.get("rule", []):  # whole tokens from 1 to 32, before anything opens
        check_threshold("rule", t, 0)
    out = Path(a.out) if a.out else calibration_path()
    profile = _costs(a)
    if profile is not None and "rule" in routers:
        raise SpeclabError("--costs with --router rule: the rule's calibration models route's arms with the route "
                           "router's arm costs, --costs holds WhiFlash's two drafters' (calibrate the rule without it)")
    store, bench_id = _bench_store(a)
    with store:
        profiles, cost, mlp, load = _routing_setup(a, store, bench_id, "neural" in routers, profile,
                                                   rule="rule" in routers)
        target = load()[0]
        cal = Calibrator(store, bench_id, profiles, cost, mlp, reused=True, grids=grids, load=load)
        best, report = calibrate(cal, routers)
        from dataclasses import asdict
        for r in routers:
            info = {"bench": bench_id, "db": str(a.db), "prompts": len(profiles),
                    "grids": {r: given[r] or grid_text(r)},
                    "cost_model": asdict(cal.arm_view()["costs"]) if r == "rule" else cost.to_dict(),
                    "costs": cal.cost_label(r), "command": "speclab calibrate " + " ".join(sys.argv[2:])}
            if r == "rule":  # the rule's provenance under its own key: WhiFlash's stays where it was
                info = {"rule": info}
            if profile is not None:  # another machine's thresholds: kept under its profile, not used by routers here
                info = {f"profile {profile.name}": info}
            save_thresholds(r, best[r], target.fingerprint, info, out, profile.name if profile else None)
    write_report(report, a.report)
    where = f" (the thresholds of profile {profile.name})" if profile is not None else ""
    print(f"wrote {out}{where}")
    return 0


def cmd_routing(a: argparse.Namespace) -> int:
    from speclab.bench.routing import bench_routers, routing_report

    profile = _costs(a)
    store, bench_id = _bench_store(a)
    with store:
        neural = "neural" in bench_routers(store, bench_id)
        profiles, cost, mlp, _ = _routing_setup(a, store, bench_id, neural, profile)
        report = routing_report(store, bench_id, profiles, cost, mlp, a.prompt_id)
    write_report(report, a.report)
    return 0


def cmd_route_table(a: argparse.Namespace) -> int:
    """`speclab route-table`: every arm profiled on a suite's prompts, each arm alone, the rule and learned routers
    and the oracles replayed on the profiles (modeled at each arm's round time), and with --bench the model error
    against that bench's live routed runs."""
    from speclab.bench import arms as evaluation
    from speclab.bench.suites import load_suite
    from speclab.methods import build_method, get_method, method_params
    from speclab.routing.arms import parse_arms

    prompts = load_suite(a.suite, a.limit)
    store = None
    if a.bench:
        from speclab.bench.routing import bench_info
        from speclab.trace import TraceStore
        if not Path(a.db).exists():
            raise SpeclabError(f"no trace database at {a.db}")
        store = TraceStore(a.db, read_only=True)
        if a.bench == "latest":
            from speclab.bench.routing import latest_bench
            a.bench = latest_bench(store)
        bench_info(store, a.bench)
    paths = ModelPaths.from_args(a)
    learned = f"route:arms={a.arms}" if a.arms else "route"
    arms = [x.name for x in parse_arms(a.arms)] if a.arms else None  # checked by name, before any model
    target, models = load_models(paths, roles=tuple(dict.fromkeys(get_method(learned).needs + ("route",))))
    mlp = models["route"]
    arms = arms or list(mlp.config.arms)
    spec = f"route:arms={'+'.join(arms)}"
    drafters, router = build_method(f"{spec}+router=learned", target, models,
                                    method_params(f"{spec}+router=learned", {}, target))
    rule_spec = f"{spec}+router=rule" + (f"+min_match={a.min_match}" if a.min_match is not None else "")
    routers = {"learned": router}
    if "pld" in arms:
        routers["rule"] = build_method(rule_spec, target, models, method_params(rule_spec, {}, target))[1]
    profiles = evaluation.arm_profiles(target, drafters, prompts, tuple(arms), a.max_new_tokens)
    import pandas as pd

    from speclab.routing.local_costs import for_router
    used = for_router(mlp, target, models)  # measured here (speclab costs route), else the router's shipped costs
    full = used.costs
    costs = full.of(arms)
    table = evaluation.arms_table(profiles, costs, evaluation.policy_choices(profiles, costs, routers),
                                  routed=("learned",))
    errors = evaluation.model_error_table(store, a.bench, full) if store is not None else pd.DataFrame()
    report = evaluation.arms_report(table, errors, costs, f"suite {a.suite} ({len(prompts)} prompts, "
                                    f"{a.max_new_tokens} tokens)", used.label)
    write_report(report, a.report)
    return 0


def add_parsers(sub) -> None:
    """`profile`, `sweep`, `calibrate` and `routing`."""
    def bench_args(p, report: str | None = None) -> None:
        """The options of the commands that read a bench (profile, sweep, calibrate, routing)."""
        p.add_argument("--bench", help="bench id (default: the latest finished bench in --db)")
        p.add_argument("--db", default="traces/bench.duckdb")
        if report:
            p.add_argument("--report", default=report)
        add_model_args(p)

    def costs_arg(p) -> None:
        p.add_argument("--costs", help="a hardware cost profile (JSON, `speclab costs measure --out`; shipped: "
                       "data/costs/) to replay under instead of the cost model fitted to the bench here: every "
                       "tokens/s figure is modeled for that machine")

    pr = sub.add_parser("profile", help="counterfactual acceptance profiles of EAGLE-3 and DFlash at every position of "
                        "a bench's AR outputs (greedy), for replay, oracles, sweeps and calibration")
    bench_args(pr)
    add_ray_args(pr, "each worker profiles whole prompts, saved in the trace together at the end")
    pr.set_defaults(fn=cmd_profile)

    sw = sub.add_parser("sweep", help="a WhiFlash router's threshold sweep on a bench: by replay of its profiles "
                        "(instant) and live at chosen thresholds")
    sw.add_argument("--router", required=True, help="entropy | neural")
    sw.add_argument("--grid", default=None, help="thresholds: start:stop:step or a comma-separated list (default: the "
                    "router's calibration grid, speclab.bench.calibration.GRIDS)")
    sw.add_argument("--live", default="", help="thresholds to also run live on the bench's prompts (into the bench)")
    bench_args(sw, "reports/sweep.html")
    costs_arg(sw)
    sw.set_defaults(fn=cmd_sweep)

    ca = sub.add_parser("calibrate", help="the best threshold per category (and a global one) of the WhiFlash "
                        "routers and of route's rule (its min_match) by replay on a bench, written to "
                        "data/zoo/calibration.json")
    ca.add_argument("--router", default="entropy,neural", help="entropy, neural, rule (route's min_match: every arm "
                    "profiled on the bench's AR outputs), comma-separated")
    ca.add_argument("--entropy-grid", default=None, help="thresholds in nats (default: the calibration grid, "
                    "speclab.bench.calibration.GRIDS, which the app and the notebook widget sweep too)")
    ca.add_argument("--neural-grid", default=None, help="thresholds on the predicted Delta tau (default: the "
                    "calibration grid)")
    ca.add_argument("--rule-grid", default=None, help="the rule's min_match values in tokens, whole numbers from 1 to "
                    "32 (default: the calibration grid, 1:16:1)")
    ca.add_argument("--out", help="calibration file (default: data/zoo/calibration.json)")
    bench_args(ca, "reports/calibration.html")
    costs_arg(ca)
    ca.set_defaults(fn=cmd_calibrate)

    ro = sub.add_parser("routing", help="WhiFlash's Table 1 on a bench (EAGLE-3, DFlash, oracles, routers: AL and "
                        "speedup per category), live vs replay, cost-model error, switch cost, lazy vs eager")
    ro.add_argument("--prompt-id", help="the sequence of the volatility figure (default: the first profiled)")
    bench_args(ro, "reports/routing.html")
    costs_arg(ro)
    ro.set_defaults(fn=cmd_routing)

    rt = sub.add_parser("route-table", help="routing v2 on a suite: every arm profiled, each arm alone, the rule and "
                        "learned routers and Oracle-Token replayed (tau, modeled speedup per category); with --bench, "
                        "the model error against its live routed runs")
    rt.add_argument("--suite", default="zoo")
    rt.add_argument("--limit", type=_positive_int, default=8, help="prompts per category")
    rt.add_argument("--max-new-tokens", type=_num(int, 2, 4096), default=128)
    rt.add_argument("--arms", default=None, help="the arms ('+'-joined; default: the learned router's)")
    rt.add_argument("--min-match", type=_num(int, 1, 32), default=None, help="the rule router's prompt lookup match "
                    "(default: calibrated, `speclab calibrate --router rule`, else 3)")
    rt.add_argument("--bench", default=None, help="a bench in --db (or 'latest') whose live route runs the model "
                    "error is computed against")
    rt.add_argument("--db", default="traces/bench.duckdb")
    rt.add_argument("--report", default="reports/route_table.md")
    add_model_args(rt)
    rt.set_defaults(fn=cmd_route_table)
