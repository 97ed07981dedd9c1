"""WhiFlash's evaluation on a bench: its profiles, threshold sweeps by replay (and live), calibration, and the
per-category table of the paper's Table 1 (drafters, oracles, routers), with the switch-cost and lazy-vs-eager
tables. Everything reads a bench in the trace (`speclab bench`) and the bench's profiles (`speclab.routing.replay`).

- tau (AL in the paper's tables, `speclab.metrics`): tokens committed per round. Tokens/s: tokens / decode time,
  pooled per category; speedup and model error as `speclab.metrics` defines them.
- Live figures come from the bench's traced runs; oracle taus from the profiles (under greedy decoding the replay
  of a policy is what a live run of it does, `replayed_runs` checks it on the bench's own runs).
- Oracle-Task and Oracle-Prompt pick, in hindsight, the drafter with the best value *of the column's metric*
  (tau for the tau column, measured tokens/s for the speed column) per category or per prompt. Oracle-Token's tau
  is the max-tau dynamic programme; its min-time variant is only modeled (the cost model), so it is shown apart.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import torch

from speclab.errors import InvalidInput
from speclab.metrics import model_error, speedup, tokens_per_s
from speclab.progress import Progress
from speclab.routing import replay
from speclab.routing.routers import DFLASH, EAGLE3
from speclab.viz import Report

ROUTED = ("whiflash-entropy", "whiflash-neural")


def bench_info(store, bench_id: str) -> pd.Series:
    b = store.query("SELECT * FROM benches WHERE bench_id = ?", [bench_id])
    if b.empty:
        known = store.query("SELECT bench_id FROM benches ORDER BY started_at DESC LIMIT 5").bench_id.tolist()
        raise InvalidInput(f"no bench {bench_id!r} in {store.path} (latest: {', '.join(known) or 'none'})")
    return b.iloc[0]


def latest_bench(store) -> str:
    b = store.query("SELECT bench_id FROM benches WHERE status = 'done' ORDER BY started_at DESC LIMIT 1")
    if b.empty:
        raise InvalidInput(f"no finished bench in {store.path}: run `speclab bench` first (with ar, eagle3, dflash)")
    return str(b.bench_id.iloc[0])


def check_profilable(store, bench_id: str):
    """(the bench's config, its finished traced AR runs); InvalidInput when it cannot be profiled (no AR run to
    replay, or sampled runs: replay is greedy-only). Cheap: call it before loading models."""
    from speclab.bench.run import BenchConfig

    b = bench_info(store, bench_id)
    cfg = BenchConfig(**{k: v for k, v in json.loads(b.config_json).items() if k in BenchConfig.__dataclass_fields__})
    ar = ar_runs(store, bench_id)
    if ar.empty:
        raise InvalidInput(f"bench {bench_id} has no finished traced AR run: its output is what profiles replay")
    for t in store.query("SELECT DISTINCT params_json FROM runs WHERE bench_id = ?", [bench_id]).params_json:
        replay.check_greedy(json.loads(t or "{}").get("temperature", 0.0))
    return cfg, ar


def bench_dtype(store, bench_id: str) -> str | None:
    """The dtype the bench's speculative runs computed in ('float32', 'bfloat16', ...; AR's where it has none; None
    for a trace without it). Profiles replay the bench's AR output in that dtype (`ar_runs`: a bench whose AR ran in
    another dtype also ran `ar@<dtype>`), so the drafters' inputs are rounded as they were live."""
    from speclab.metrics import AR_SQL
    for which in (f"NOT {AR_SQL} AND method NOT LIKE '%-untraced' AND method NOT LIKE 'hf\\_%' ESCAPE '\\'",
                  "method = 'ar'"):
        d = store.query(f"SELECT DISTINCT dtype FROM runs WHERE bench_id = ? AND {which} AND status = 'done' AND "
                        "dtype IS NOT NULL", [bench_id]).dtype.tolist()
        if len(d) > 1:
            raise InvalidInput(f"bench {bench_id} mixes runs in {', '.join(sorted(d))}: profile one dtype's bench")
        if d:
            return d[0]
    return None


def ar_runs(store, bench_id: str):
    """The bench's finished traced AR runs in its dtype (`bench_dtype`): run_id, prompt_id, category."""
    from speclab.metrics import AR_SQL
    return store.query(f"SELECT run_id, prompt_id, category FROM runs WHERE bench_id = ? AND {AR_SQL} AND "
                       "status = 'done' AND dtype IS NOT DISTINCT FROM ?", [bench_id, bench_dtype(store, bench_id)])


def check_bench_dtype(store, bench_id: str, target) -> None:
    """InvalidInput unless `target` computes in the bench's dtype."""
    from speclab.core.precision import dtype_option
    want, have = bench_dtype(store, bench_id), target.precision["dtype"]
    if want is not None and want != have:
        raise InvalidInput(f"bench {bench_id} ran in {want}, the target is loaded in {have}: profiles replay the "
                           f"bench's runs, so load it in {want} (--dtype {dtype_option(want)})")


def profile_bench(store, bench_id: str, target, models: dict, params: dict | None = None, log=print, profiles=None):
    """Profile both drafters on every prompt of the bench (its AR run's output is the sequence) with the target in
    the bench's dtype, save them in the trace (with that dtype) and return them. `profiles(items, params)`: who
    profiles the prompts (`profile_prompt`'s arguments after the models, one tuple each; a Ray cluster:
    `speclab.cluster.bench_profiles`), returning the profiles in the items' order; default: this process."""
    from speclab.methods import build_method, method_params

    items = bench_items(store, bench_id, target)
    params = method_params("whiflash-entropy", params or {}, target)
    if profiles is None:
        drafters, _ = build_method("whiflash-entropy", target, models, params)
        prog = Progress(len(items), f"profile bench {bench_id}")
        out = []
        for i, item in enumerate(items):
            out.append(profile_prompt(target, drafters, *item))
            prog.update(i + 1)
    else:
        out = profiles(items, params)
    replay.save_profiles(store, bench_id, out, {**{k: v for k, v in params.items() if k not in ("threshold", "eager")},
                                                "dtype": target.precision["dtype"]})
    return out


def bench_items(store, bench_id: str, target) -> list[tuple]:
    """What profiling a bench's prompts takes, one tuple per AR run (`profile_prompt`'s arguments after the models):
    the suite's row, the run's output tokens, the bench's max new tokens, the prompt id and category. The target
    must be in the bench's dtype."""
    from speclab.bench.suites import load_suite
    cfg, ar = check_profilable(store, bench_id)
    check_bench_dtype(store, bench_id, target)
    rows = {str(r["prompt_id"]): r for r in load_suite(cfg.suite, cfg.limit)}
    items = []
    for r in ar.itertuples():
        row = rows.get(str(r.prompt_id))
        if row is None:
            raise InvalidInput(f"prompt {r.prompt_id} of bench {bench_id} is no longer in suite {cfg.suite}")
        toks = store.query("SELECT token_id FROM tokens WHERE run_id = ? ORDER BY pos", [int(r.run_id)]).token_id
        items.append((row, toks.to_numpy(np.int64), cfg.max_new_tokens, str(r.prompt_id), r.category))
    return items


def profile_prompt(target, drafters, row: dict, tokens: np.ndarray, max_new_tokens: int, prompt_id: str,
                   category: str, arms: tuple[str, ...] = replay.DRAFTERS):
    """One bench prompt's profile: each arm (by default WhiFlash's two drafters) at every position of its AR output
    `tokens`."""
    from speclab.bench.run import format_prompt
    return replay.profile_sequence(target, drafters, format_prompt(target, row), torch.from_numpy(tokens),
                                   max_new_tokens, prompt_id, category, arms=arms)


def get_profiles(store, bench_id: str, load=None, log=print):
    """The bench's profiles, made (with the models from `load()`) when there are none or when they were made in
    another dtype than the bench's runs (profiles saved before the dtype was recorded are taken as they are)."""
    want = bench_dtype(store, bench_id)
    try:
        profiles, meta = replay.load_profiles(store, bench_id)
        made = meta.get("dtype", want)
        if made == want:
            return profiles
        if load is None:
            raise InvalidInput(f"the profiles of bench {bench_id} were made in {made}, its runs in {want}: make them "
                               f"again with `speclab profile --bench {bench_id}`")
        log(f"the profiles of bench {bench_id} were made in {made}, its runs in {want}: profiling again")
    except InvalidInput:
        if load is None:
            raise
    target, models = load()
    return profile_bench(store, bench_id, target, models, log=log)


def signals_table(profiles, mlp=None) -> pd.DataFrame:
    """Per profiled position: the signals a router sees there (the target's entropy; the neural router's predicted
    Delta AL with `mlp`), what each drafter would have had accepted, the true Delta AL `delta_tau` (= tau_eagle3 -
    tau_dflash, WhiFlash 3.3.2) and the winner ('eagle3', 'dflash' or 'tie')."""
    rows = []
    for p in profiles:
        e, d = (p.accepted[replay.DRAFTERS.index(n)].astype(float) for n in (EAGLE3, DFLASH))
        df = pd.DataFrame({"prompt_id": p.prompt_id, "category": p.category, "pos": np.arange(p.n),
                           "entropy": p.entropy, f"{EAGLE3}_accepted": e, f"{DFLASH}_accepted": d, "delta_tau": e - d})
        if mlp is not None:
            df["predicted"] = replay.neural_signal(p, mlp)
        rows.append(df)
    out = pd.concat(rows, ignore_index=True)
    out["winner"] = np.select([out.delta_tau > 0, out.delta_tau < 0], [EAGLE3, DFLASH], "tie")
    return out


# -- policies ------------------------------------------------------------------------------------------------------
def threshold_policy(router: str, grid, mlp=None):
    """label -> (Profile -> choices [K, N], thresholds) for replay_table."""
    grid = [float(x) for x in grid]
    if router == "entropy":
        return {"whiflash-entropy": (lambda p: replay.entropy_choice(p, grid), grid)}
    if router == "neural":
        if mlp is None:
            raise InvalidInput("a neural sweep needs the neural router (--router-model, or the zoo's)")
        return {"whiflash-neural": (lambda p: replay.signal_choice(replay.neural_signal(p, mlp), grid), grid)}
    raise InvalidInput(f"--router must be entropy or neural (got {router!r})")


def threshold_range(start: float, stop: float, step: float) -> list[float]:
    """start, start + step, ... up to stop (included), rounded to 10 decimals: every threshold grid's points."""
    return [float(x) for x in np.round(np.arange(start, stop + step / 2, step), 10)]


def parse_thresholds(text: str) -> list[float]:
    """'0.5,1,2' or 'start:stop:step' (stop included) -> thresholds; InvalidInput otherwise."""
    try:
        if ":" in text:
            a, b, s = (float(x) for x in text.split(":"))
            if s <= 0 or b < a or (b - a) / s > 10000:
                raise ValueError
            vals = threshold_range(a, b, s)
        else:
            vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or not all(math.isfinite(v) for v in vals):
        raise InvalidInput(f"--grid must be thresholds separated by commas or start:stop:step (got {text!r})")
    return vals


def with_all(df: pd.DataFrame) -> pd.DataFrame:
    """Rows once per category and once more under category 'all'."""
    return pd.concat([df, df.assign(category="all")], ignore_index=True)


def sweep(profiles, cost, router: str, grid, mlp=None) -> pd.DataFrame:
    """Replayed tau and modeled tokens/s per (category, threshold), 'all' pooling every prompt."""
    t = replay.replay_table(profiles, threshold_policy(router, grid, mlp), cost)
    return replay.summarize_walks(with_all(t)).rename(columns={"value": "threshold"})


def best_per_category(sw: pd.DataFrame) -> pd.DataFrame:
    """The best threshold of a sweep: per category the row of the highest modeled tokens/s (the lowest threshold
    among equals), indexed by category. What `speclab calibrate`, the app and the notebook widget save."""
    best = sw.loc[sw.sort_values("threshold").groupby("category").tokens_per_s.idxmax()]
    return best.set_index("category", drop=False).rename_axis(None)


def best_thresholds(sw: pd.DataFrame) -> dict:
    """Per category the best threshold (`best_per_category`); '*' = the best single threshold over all."""
    best = best_per_category(sw)
    return {("*" if c == "all" else c): float(t) for c, t in zip(best.category, best.threshold)}


# -- oracles -------------------------------------------------------------------------------------------------------
def oracles(profiles, cost=None, switch_backlog: float = 16.0) -> pd.DataFrame:
    """tau per category (and 'all') of each drafter alone, Oracle-Task, Oracle-Prompt and Oracle-Token (max tau; and
    min modeled time when a cost model is given), all from the profiles."""
    pol = {name: (lambda p, n=name: replay.fixed_choice(p, n), [None]) for name in replay.DRAFTERS}
    pol["oracle-token"] = (replay.oracle_max_tau, [None])
    if cost is not None:
        pol["oracle-token-time"] = (lambda p: replay.oracle_min_time(p, cost, switch_backlog), [None])
    t = replay.replay_table(profiles, pol, cost)
    single = t[t.policy.isin(replay.DRAFTERS)]
    # Oracle-Prompt: per prompt the drafter with the fewest rounds; Oracle-Task: per category the fewest in total
    per_prompt = single.loc[single.groupby("prompt_id").rounds.idxmin()].assign(policy="oracle-prompt")
    by_cat = single.groupby(["category", "policy"]).rounds.sum().reset_index()
    best_cat = by_cat.loc[by_cat.groupby("category").rounds.idxmin()]
    per_task = single.merge(best_cat[["category", "policy"]], on=["category", "policy"]).assign(policy="oracle-task")
    rows = pd.concat([t, per_prompt, per_task], ignore_index=True)
    out = replay.summarize_walks(with_all(rows), by=("policy", "category"))
    # Oracle-Task over 'all' is the per-category choice pooled, not one drafter for everything
    return out


def oracle_speed(store, bench_id: str) -> pd.DataFrame:
    """Oracle-Task and Oracle-Prompt tokens/s from the bench's live eagle3 and dflash runs (hindsight best)."""
    r = store.query("SELECT method, prompt_id, category, new_tokens, elapsed_s, rounds FROM runs WHERE bench_id = ? "
                    "AND status = 'done' AND method IN (?, ?)", [bench_id, EAGLE3, DFLASH])
    if r.empty:
        return pd.DataFrame(columns=["policy", "category", "tokens_per_s"])
    prompt = r.loc[r.groupby("prompt_id").elapsed_s.idxmin()]
    cat = r.groupby(["category", "method"]).agg(t=("new_tokens", "sum"), s=("elapsed_s", "sum")).reset_index()
    cat["tps"] = [tokens_per_s(t, s) for t, s in zip(cat.t, cat.s)]
    best = cat.loc[cat.groupby("category").tps.idxmax()]
    task = r.merge(best[["category", "method"]], on=["category", "method"])
    rows = []
    for label, df in (("oracle-prompt", prompt), ("oracle-task", task)):
        for c, g in with_all(df).groupby("category"):
            rows.append({"policy": label, "category": c,
                         "tokens_per_s": tokens_per_s(g.new_tokens.sum(), g.elapsed_s.sum())})
    return pd.DataFrame(rows)


# -- the table -----------------------------------------------------------------------------------------------------
def live_table(store, bench_id: str) -> pd.DataFrame:
    """tau and tokens/s per (method, category) of the bench's traced runs, 'all' pooled, speedup vs AR: the
    bench's own tables (`speclab.bench.results`), which use the metric definitions of `speclab.metrics`."""
    from speclab.bench.results import bench_overall, bench_table
    t = pd.concat([bench_overall(store, bench_id).assign(category="all"), bench_table(store, bench_id)],
                  ignore_index=True)
    cols = ["method", "category", "prompts", "tau", "tokens_per_s", "speedup"]
    return t[t.tau.notna()][cols].reset_index(drop=True)


def route_members(methods) -> set[str]:
    """The drafters among the arms of the `route` specs in `methods` (merged arms' members too)."""
    from speclab.methods import parse_spec
    from speclab.routing.arms import DEFAULT_ARMS, parse_arms
    out: set[str] = set()
    for m in methods:
        name, fixed = parse_spec(m)
        if name == "route":
            out |= {x for a in parse_arms(fixed.get("arms", DEFAULT_ARMS)) for x in a.members}
    return out


def routing_table(store, bench_id: str, orc: pd.DataFrame) -> pd.DataFrame:
    """The paper's Table 1 on a bench, with routing v2's N arms: rows = EAGLE-3, DFlash, every other drafter of the
    bench's `route` runs' arms that ran alone (prompt lookup), the oracles (`oracles` of the bench's profiles: over
    EAGLE-3 and DFlash) and the bench's routed methods (WhiFlash's, then `route`'s, merged arms run alone
    included); per category tau and speedup (`speclab.metrics`: over AR's, same bench)."""
    live = live_table(store, bench_id)
    spd = oracle_speed(store, bench_id)
    ar = live[live.method == "ar"].set_index("category").tokens_per_s
    rows = []
    names = live.method.unique()
    routed = [m for m in names if m.startswith("route")]
    methods = [EAGLE3, DFLASH] + sorted(m for m in route_members(routed) if m in names and m not in (EAGLE3, DFLASH)) \
        + sorted(m for m in names if m.startswith("whiflash")) + sorted(routed)
    for m in methods:
        for x in live[live.method == m].itertuples():
            rows.append({"method": m, "category": x.category, "tau": x.tau, "tokens_per_s": x.tokens_per_s,
                         "speedup": x.speedup, "source": "live"})
    for label in ("oracle-task", "oracle-prompt", "oracle-token", "oracle-token-time"):
        for x in orc[orc.policy == label].itertuples():
            tps = spd[(spd.policy == label) & (spd.category == x.category)].tokens_per_s
            modeled = label == "oracle-token-time"
            t = float(tps.iloc[0]) if len(tps) else (x.tokens_per_s if modeled else math.nan)
            rows.append({"method": label, "category": x.category, "tau": x.tau, "tokens_per_s": t,
                         "speedup": speedup(t, ar.get(x.category, math.nan)),
                         "source": "modeled" if modeled else ("profiles + live" if len(tps) else "profiles")})
    return pd.DataFrame(rows)


def wide(table: pd.DataFrame, cols=("tau", "speedup")) -> pd.DataFrame:
    """Rows = methods, columns = (category, metric): the paper's layout."""
    w = table.pivot_table(index="method", columns="category", values=list(cols), sort=False)
    w = w.swaplevel(0, 1, axis=1).sort_index(axis=1, level=0, sort_remaining=False)
    order = [m for m in table.method.unique()]
    w = w.reindex(order)
    w.columns = [f"{c} {m}" for c, m in w.columns]
    return w.reset_index()


def replayed_runs(store, bench_id: str, profiles, cost=None, mlp=None) -> pd.DataFrame:
    """Every live run of the bench drafted by EAGLE-3 / DFlash alone or routed between them, replayed on its
    prompt's profile with its own policy and threshold (from `router_decisions`): whether every round's drafter,
    accept length and committed tokens agree with the live run, and the run's modeled decode time."""
    runs = store.query("SELECT run_id, method, prompt_id, category, router, coalesce(eager, false) AS eager, "
                       "new_tokens FROM runs WHERE bench_id = ? AND status = 'done' AND (router IN ('entropy', "
                       "'neural') OR method IN (?, ?))",
                       [bench_id, EAGLE3, DFLASH])
    by_prompt = {p.prompt_id: p for p in profiles}
    rows = []
    for r in runs.itertuples():
        p = by_prompt.get(str(r.prompt_id))
        if p is None or (r.router == "neural" and mlp is None):
            continue
        live = store.query("SELECT x.round, x.drafter, x.n_accepted, x.committed, d.threshold FROM rounds x "
                           "JOIN router_decisions d USING (run_id, round) WHERE run_id = ? ORDER BY round",
                           [int(r.run_id)])
        thr = float(live.threshold.iloc[0]) if len(live) else math.nan
        if r.router == "neural":
            choice = replay.signal_choice(replay.neural_signal(p, mlp), [thr])
        elif r.router == "entropy":
            choice = replay.entropy_choice(p, [thr])
        else:
            choice = replay.fixed_choice(p, r.method)
        walk = replay.walk(p, choice, bool(r.eager))
        w = walk.one(0)
        n = min(len(w), len(live))
        cols = ("drafter", "n_accepted", "committed")
        match = np.ones(n, bool)
        for c in cols:
            match &= w[c].to_numpy()[:n] == live[c].to_numpy()[:n]
        rows.append({"run_id": int(r.run_id), "method": r.method, "category": r.category, "prompt_id": r.prompt_id,
                     "routed": r.router in ("entropy", "neural"), "threshold": thr, "live_rounds": len(live),
                     "replay_rounds": len(w), "identical": len(w) == len(live) and bool(match.all()),
                     "rounds_agreeing": float(match.mean()) if n else math.nan, "tokens": p.n,
                     "modeled_s": float(cost.walk_ms(p, walk)[0]) / 1e3 if cost is not None else math.nan})
    return pd.DataFrame(rows)


def modeled_table(replayed: pd.DataFrame, oracle: pd.DataFrame) -> pd.DataFrame:
    """Modeled tokens/s per (method, category) under one cost model: the bench's runs as replayed (no run-to-run
    timing noise: every method pays the same per-phase costs), and the oracles."""
    rows = []
    for (m, c), g in with_all(replayed).groupby(["method", "category"]):
        rows.append({"method": m, "category": c,
                     "modeled_tokens_per_s": tokens_per_s(g.tokens.sum(), g.modeled_s.sum())})
    for x in oracle[oracle.policy.str.startswith("oracle")].itertuples():
        rows.append({"method": x.policy, "category": x.category, "modeled_tokens_per_s": x.tokens_per_s})
    return pd.DataFrame(rows)


def router_rounds(store, run_id: int, profile=None) -> pd.DataFrame:
    """A routed run round by round: position, the router's signal, threshold and choice, accepted length, backlog,
    catch-up time, whether the drafter switched, and (given the prompt's greedy profile) what each drafter would
    have had accepted in a round starting there."""
    rr = store.query("""
        SELECT x.round, d.signal, d.threshold, d.choice, x.n_accepted, x.backlog, x.t_catchup_ms AS catchup_ms,
               coalesce(lag(x.drafter) OVER (ORDER BY x.round) <> x.drafter, false) AS switch,
               (SELECT min(t.pos) FROM tokens t WHERE t.run_id = x.run_id AND t.round = x.round) AS pos
        FROM rounds x JOIN router_decisions d USING (run_id, round) WHERE x.run_id = ? ORDER BY x.round""", [run_id])
    return with_counterfactual(rr, profile)


def event_rounds(evs) -> pd.DataFrame:
    """`router_rounds` of a run still decoding, from its RoundEvents (the live view's source)."""
    d = [e.decision for e in evs]
    drafter = [e.drafter for e in evs]
    return pd.DataFrame({
        "round": [e.round for e in evs], "signal": [x.signal if x else math.nan for x in d],
        "threshold": [x.threshold if x else math.nan for x in d], "choice": [x.choice if x else None for x in d],
        "n_accepted": [e.n_accepted for e in evs], "backlog": [e.backlog for e in evs],
        "catchup_ms": [e.timings_ms.get("catchup", 0.0) for e in evs],
        "switch": [i > 0 and a != b for i, (a, b) in enumerate(zip([None] + drafter, drafter))],
        "pos": [e.pos0 for e in evs]})


def with_counterfactual(rr: pd.DataFrame, profile=None) -> pd.DataFrame:
    """Add, per round, what each of the profile's arms would have had accepted in a round starting at its position
    (from the sequence's greedy profile; the columns stay absent without one)."""
    if profile is not None and len(rr):
        g = rr.pos.clip(upper=profile.n - 1).to_numpy()
        for i, name in enumerate(profile.arms):
            rr[f"{name}_would_accept"] = np.minimum(profile.accepted[i][g], profile.n - g)
    return rr


# -- switching -----------------------------------------------------------------------------------------------------
def volatility_table(profiles, mlp=None) -> pd.DataFrame:
    """The intra-sequence volatility figure in numbers (WhiFlash's Figure 2), per category and 'all': the share of
    profiled positions where EAGLE-3 or DFlash would have more accepted, or both the same; how often the leader
    changes along a sequence (per 100 positions, ties skipped); mean |Delta AL|; and how the routers' signals track
    Delta AL (Pearson r of the target's entropy and, with `mlp`, of the neural router's prediction)."""
    s = signals_table(profiles, mlp)
    rows = []
    for cat, g in [*s.groupby("category", sort=True), ("all", s)]:
        leaders = (q.winner[q.winner != "tie"].to_numpy() for _, q in g.groupby("prompt_id"))
        changes = sum(int((w[1:] != w[:-1]).sum()) for w in leaders)
        row = {"category": cat, "eagle3_better": (g.winner == EAGLE3).mean(),
               "dflash_better": (g.winner == DFLASH).mean(), "tie": (g.winner == "tie").mean(),
               "leader_changes_per_100": 100 * changes / len(g), "mean_abs_delta": g.delta_tau.abs().mean(),
               "r_entropy": g.entropy.corr(g.delta_tau)}
        if mlp is not None:
            row["r_neural"] = g.predicted.corr(g.delta_tau)
        rows.append(row)
    return pd.DataFrame(rows)


def switch_table(store, bench_id: str, edges=(1, 8, 16, 32, 64, 128, 10 ** 9)) -> pd.DataFrame:
    """Live switch cost: rounds whose drafter differs from the previous round's, by backlog bucket: the catch-up
    time as a share of that round's latency (the paper's Table 4, measured in real routed runs)."""
    df = store.query("""
        SELECT * FROM (SELECT x.*, lag(x.drafter) OVER (PARTITION BY x.run_id ORDER BY x.round) AS prev,
                              x.t_route_ms + x.t_catchup_ms + x.t_draft_ms + x.t_verify_ms + x.t_commit_ms
                              + coalesce(x.t_record_ms, 0) AS round_ms
                       FROM rounds x JOIN runs r USING (run_id)
                       WHERE r.bench_id = ? AND r.router IN ('entropy', 'neural') AND NOT coalesce(r.eager, false))
        WHERE prev IS NOT NULL AND prev <> drafter""", [bench_id])
    if df.empty:
        return pd.DataFrame()
    df["bucket"] = pd.cut(df.backlog, list(edges), right=False)
    g = df.groupby(["drafter", "bucket"], observed=True).agg(switches=("backlog", "size"),
                                                             mean_backlog=("backlog", "mean"),
                                                             catchup_ms=("t_catchup_ms", "mean"),
                                                             round_ms=("round_ms", "mean")).reset_index()
    g["share_of_round"] = g.catchup_ms / g.round_ms
    g["bucket"] = g.bucket.astype(str)
    return g


def eager_pairs(store, bench_id: str) -> dict[str, str]:
    """Each eager routed method of the bench (`runs.eager`) -> the lazy method of the same router with the same
    parameters otherwise."""
    r = store.query("SELECT DISTINCT method, router, coalesce(eager, false) AS eager, params_json FROM runs "
                    "WHERE bench_id = ? AND status = 'done' AND router IN ('entropy', 'neural')", [bench_id])

    def key(x) -> tuple:
        params = {k: v for k, v in json.loads(x.params_json or "{}").items() if k != "eager"}
        return x.router, json.dumps(params, sort_keys=True)
    lazy = {key(x): x.method for x in r.itertuples() if not x.eager}
    return {x.method: lazy[key(x)] for x in r.itertuples() if x.eager and key(x) in lazy}


def lazy_vs_eager(store, bench_id: str) -> pd.DataFrame:
    """tokens/s and tau of each routed method run lazily and eagerly (`eager_pairs`), per category and 'all';
    lazy_gain = the lazy run's speedup over the eager one - 1."""
    live = live_table(store, bench_id)
    rows = []
    for eager, lazy in eager_pairs(store, bench_id).items():
        for e in live[live.method == eager].itertuples():
            la = live[(live.method == lazy) & (live.category == e.category)]
            if len(la):
                tps = float(la.tokens_per_s.iloc[0])
                rows.append({"lazy": lazy, "eager": eager, "category": e.category, "lazy_tokens_per_s": tps,
                             "eager_tokens_per_s": e.tokens_per_s, "lazy_gain": speedup(tps, e.tokens_per_s) - 1,
                             "tau_lazy": float(la.tau.iloc[0]), "tau_eager": e.tau})
    return pd.DataFrame(rows)


def switch_backlog(store, bench_id: str, default: float = 16.0) -> float:
    t = switch_table(store, bench_id)
    return float((t.mean_backlog * t.switches).sum() / t.switches.sum()) if len(t) else default


# -- reports: what `speclab profile`, `sweep` and `routing` show -------------------------------------------------------
def profile_table(profiles) -> pd.DataFrame:
    """Per category, averaged over its prompts: tokens profiled, each drafter's mean accepted draft tokens per
    position and the share of positions where it beats the other."""
    rows = []
    for p in profiles:
        row = {"prompt_id": p.prompt_id, "category": p.category, "tokens": p.n}
        for i, name in enumerate(replay.DRAFTERS):
            row[f"{name}_accepted"] = p.accepted[i].mean()
        for i, name in enumerate(replay.DRAFTERS):
            row[f"{name}_better"] = (p.accepted[i] > p.accepted[1 - i]).mean()
        rows.append(row)
    return pd.DataFrame(rows).groupby("category").mean(numeric_only=True).reset_index()


def live_specs(router: str, thresholds) -> list[str]:
    """The method specs of a router at chosen thresholds, as `run_live` decodes them into a bench."""
    return [f"whiflash-{router}:threshold={t:g}" for t in thresholds]


def live_vs_replay(store, bench_id: str, profiles, cost, router: str, thresholds, mlp=None) -> pd.DataFrame:
    """The bench's live runs of `live_specs(router, thresholds)` per category and 'all', beside the replay of the same
    threshold: tau_live, tau_replay, tokens_per_s_live, tokens_per_s_modeled and model_error
    (`speclab.metrics.model_error`)."""
    at = dict(zip(live_specs(router, thresholds), (float(t) for t in thresholds)))
    lt = live_table(store, bench_id)
    lt = lt[lt.method.isin(at)].assign(threshold=lambda d: d.method.map(at))
    pts = sweep(profiles, cost, router, list(at.values()), mlp)
    live = lt.merge(pts[["category", "threshold", "tau", "tokens_per_s"]], on=["category", "threshold"],
                    suffixes=("_live", "_replay")).rename(columns={"tokens_per_s_replay": "tokens_per_s_modeled"})
    live["model_error"] = model_error(live.tokens_per_s_modeled, live.tokens_per_s_live)
    return live


def sweep_report(store, bench_id: str, profiles, cost, router: str, grid, mlp=None, live_thresholds=()) -> Report:
    """A router's threshold sweep on a bench by replay (modeled tokens/s and tau per category), with the live runs at
    `live_thresholds` (already in the bench: `run_live`) beside their replay."""
    import time

    from speclab import viz
    t0 = time.perf_counter()
    sw = sweep(profiles, cost, router, grid, mlp)
    replay_s = time.perf_counter() - t0
    live = live_vs_replay(store, bench_id, profiles, cost, router, live_thresholds, mlp) if len(live_thresholds) \
        else pd.DataFrame()
    method = f"whiflash-{router}"
    wide_tps = sw.pivot_table(index="threshold", columns="category", values="tokens_per_s").reset_index()
    wide_tau = sw.pivot_table(index="threshold", columns="category", values="tau").reset_index()
    text = [f"# {method} threshold sweep on bench `{bench_id}`", "",
            f"Replayed from profiles: {len(grid)} thresholds x {len(profiles)} prompts in {replay_s:.2f} s. Tokens/s "
            f"modeled: the round-cost model {cost.label}.", "", f"## Modeled tokens/s per category ({cost.label})", "",
            wide_tps.to_markdown(index=False, floatfmt=".2f"), "",
            "## AL (tau: tokens per round) per category", "", wide_tau.to_markdown(index=False, floatfmt=".3f")]
    shown = None
    if len(live):
        cols = ["threshold", "category", "tau_live", "tau_replay", "tokens_per_s_live", "tokens_per_s_modeled",
                "model_error"]
        text += ["", "## Live runs at chosen thresholds (same bench) vs replay (model error: modeled / measured "
                 "tokens/s - 1)", "", live[cols].sort_values(["threshold", "category"])
                 .to_markdown(index=False, floatfmt=".3f")]
        shown = live.rename(columns={"tokens_per_s_live": "tokens_per_s", "tau_live": "tau"})
    figs = [viz.sweep_figure(sw, shown, "tokens_per_s",
                             f"{method}: modeled tokens/s by threshold ({cost.label}; lines: replay + cost model; "
                             "diamonds: live, measured here)"),
            viz.sweep_figure(sw, shown, "tau", f"{method}: AL (tau) by threshold")]
    return Report(f"{method} threshold sweep", "\n".join(text), figs)


def bench_routers(store, bench_id: str) -> set[str]:
    """The routing policies of the bench's runs ('entropy', 'neural', 'fixed', ...)."""
    return set(store.query("SELECT DISTINCT router FROM runs WHERE bench_id = ? AND router IS NOT NULL",
                           [bench_id]).router)


def routed_runs(store, bench_id: str, prompt_id: str) -> pd.DataFrame:
    """The bench's finished routed runs of a prompt (run_id, method): neural ones first."""
    return store.query("SELECT run_id, method FROM runs WHERE bench_id = ? AND prompt_id = ? AND router IN "
                       "('neural', 'entropy') AND status = 'done' ORDER BY router DESC, run_id", [bench_id, prompt_id])


def profile_rows(profile) -> pd.DataFrame:
    """A profile as rows (pos, drafter, accepted), by drafter then position (the volatility figure's input)."""
    n = profile.n
    df = pd.DataFrame({"pos": np.tile(np.arange(n), len(replay.DRAFTERS)), "drafter": np.repeat(replay.DRAFTERS, n),
                       "accepted": profile.accepted.reshape(-1)})
    return df.sort_values(["drafter", "pos"], ignore_index=True)


def replay_agreement(store, bench_id: str, agree: pd.DataFrame) -> str:
    """How many routed runs replay identically, and why the others do not: an output that leaves AR's at a near-tie
    (the profile follows AR's output), or, outside float32, a draft that rounds differently."""
    if not len(agree):
        return "no routed runs in this bench"
    text = (f"{int(agree.identical.sum())} of {len(agree)} routed runs replay identically (every round's drafter, "
            f"accept length and committed tokens); rounds agreeing overall: {agree.rounds_agreeing.mean():.4f}.")
    off = agree[~agree.identical]
    if not len(off):
        return text
    eq = store.query("SELECT run_id, equal_to_ar FROM run_metrics WHERE bench_id = ?", [bench_id])
    off_ar = int((off.merge(eq, on="run_id").equal_to_ar == 0).sum())
    dtype = bench_dtype(store, bench_id) or "float32"
    why = (f"in {dtype} a profile's target features come from one forward over AR's output and a live run's from its "
           "verification forwards: they round differently, and a drafter's near-tie can flip (in float32 every run "
           "replays identically: tests/test_routing.py)" if dtype != "float32" else
           "in float32 this is not rounding: a bug to report")
    return (f"{text} Of the {len(off)} that differ, {off_ar} leave AR's output at a near-tie (their profile follows "
            f"AR's output); {len(off) - off_ar} keep AR's output but draft differently somewhere: {why}.")


def routing_report(store, bench_id: str, profiles, cost, mlp=None, prompt_id: str | None = None) -> Report:
    """WhiFlash on a bench: the paper's Table 1 (tau and speedup per category: the drafters, the oracles, the
    routers), tokens/s live and modeled, live vs replay, the cost model and its error, the switch cost, lazy vs
    eager, the volatility of one prompt (`prompt_id`, default: the first profiled) and its routed run."""
    from speclab import viz
    orc = oracles(profiles, cost, switch_backlog(store, bench_id))
    table = routing_table(store, bench_id, orc)
    replayed = replayed_runs(store, bench_id, profiles, cost, mlp)
    agree = replayed[replayed.routed] if len(replayed) else replayed
    modeled = modeled_table(replayed, orc).pivot_table(index="method", columns="category",
                                                        values="modeled_tokens_per_s", sort=False)
    err = replay.model_error_table(cost, store, bench_id)
    sw = switch_table(store, bench_id)
    le = lazy_vs_eager(store, bench_id)
    pid = prompt_id or profiles[0].prompt_id
    profile = next((p for p in profiles if p.prompt_id == pid), None)
    if profile is None:
        raise InvalidInput(f"prompt {pid!r} has no profile in bench {bench_id}")
    routed = routed_runs(store, bench_id, pid)
    fmt = dict(index=False, floatfmt=".2f")
    tps = table.pivot_table(index="method", columns="category", values="tokens_per_s", sort=False)
    md = [f"# WhiFlash on bench `{bench_id}`", "",
          "AL = tau = tokens per round; speedup = tokens/s over AR's in the same bench. Live rows: the bench's traced "
          "runs (routing v2's `route` methods and the drafters of their arms among them). Oracle taus: replayed from "
          "profiles of EAGLE-3 and DFlash; Oracle-Task/Prompt speedups: the bench's live eagle3/dflash runs "
          "picked in hindsight; oracle-token-time: modeled (cost model), not measured. Oracle-Token over route's "
          "N arms: `speclab route-table`.", "",
          "## AL (tau) and speedup per category", "", wide(table).to_markdown(**fmt), "",
          "## Tokens/s per category", "", tps.reset_index().to_markdown(**fmt), "",
          f"## Modeled tokens/s (the same runs replayed under one cost model, {cost.label}: no run-to-run timing "
          "noise)", "",
          "Live tokens/s of one method and category vary by about 10% from run to run on this machine even for "
          "identical rounds; replayed through one cost model every method pays the same per-phase costs.", "",
          modeled.reset_index().to_markdown(**fmt), "",
          "## Intra-sequence volatility (from the profiles)", "",
          "Per profiled position, which drafter would have more accepted in a round starting there; leader changes "
          "along each sequence; and the Pearson r of the routers' signals with Delta AL = AL_eagle3 - AL_dflash.", "",
          volatility_table(profiles, mlp).to_markdown(index=False, floatfmt=".3f"), "",
          "## Live vs replay (routed runs)", "",
          replay_agreement(store, bench_id, agree), "",
          f"## Cost model ({cost.label})", "", cost.table().to_markdown(index=False, floatfmt=".3f"), "",
          f"prefill ms = {cost.prefill0:.2f} + {cost.prefill1:.3f} x prompt tokens; fitted to {cost.rounds_fitted} "
          f"rounds of {cost.runs_fitted} runs", "",
          "Modeled vs measured tokens/s of the live runs (model error = modeled / measured - 1):", "",
          err.to_markdown(index=False, floatfmt=".3f"), ""]
    if len(sw):
        md += ["## Switch cost (live: rounds whose drafter differs from the previous round's)", "",
               sw.to_markdown(index=False, floatfmt=".3f"), ""]
    if len(le):
        md += ["## Lazy vs eager catch-up", "", le.to_markdown(index=False, floatfmt=".3f"), ""]
    figs = [viz.bench_bars(table, "tau", "AL (tau: tokens per round) per category"),
            viz.bench_bars(table[table.source != "profiles"], "speedup", "Speedup over AR per category"),
            viz.volatility_figure(profile_rows(profile), f"Intra-sequence volatility: prompt {pid} (from its profile)")]
    if len(routed):
        rr = router_rounds(store, int(routed.run_id.iloc[0]), profile)
        figs.append(viz.router_figure(rr, f"{routed.method.iloc[0]} on prompt {pid}: router signal, choices and "
                                          "accept lengths"))
    return Report(f"WhiFlash on bench {bench_id}", "\n".join(md), figs)


def run_live(store, bench_id: str, target, models: dict, specs: list[str], log=print,
             prompt_ids: list[str] | None = None) -> None:
    """Decode the bench's prompts (or those of `prompt_ids`) with more method specs (routers at chosen thresholds),
    traced into the same bench (after one untraced warm-up decode), so they sit beside its other runs in every
    table."""
    from speclab.bench.run import BenchConfig, format_prompt
    from speclab.bench.suites import load_suite
    from speclab.generate import generate

    b = bench_info(store, bench_id)
    cfg = BenchConfig(**{k: v for k, v in json.loads(b.config_json).items() if k in BenchConfig.__dataclass_fields__})
    done = set(ar_runs(store, bench_id).prompt_id)
    rows = [r for r in load_suite(cfg.suite, cfg.limit) if r["prompt_id"] in done
            and (prompt_ids is None or r["prompt_id"] in prompt_ids)]
    if not rows:
        raise InvalidInput(f"bench {bench_id} has none of these prompts with a finished AR run")
    generate(target, format_prompt(target, rows[0]), specs[0], models=models, max_new_tokens=8)
    prog = Progress(len(rows) * len(specs), f"live runs in bench {bench_id}")
    i = 0
    for r in rows:
        ids = format_prompt(target, r)
        for spec in specs:
            generate(target, ids, spec, models=models, max_new_tokens=cfg.max_new_tokens, trace=store,
                     prompt_id=r["prompt_id"], category=r["category"], bench_id=bench_id)
            i += 1
            prog.update(i, method=spec)
    store.drain()
