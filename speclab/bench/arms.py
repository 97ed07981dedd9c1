"""Routing v2's evaluation on a prompt suite (`speclab route-table`): every arm profiled at every position of each
prompt's greedy AR output (`speclab.routing.replay.profile_sequence` with `arms`), then policies replayed on the
profiles exactly (each arm alone, the rule router, the learned router, Oracle-Token by accept length and by modeled
time) and tabled per category: tau and modeled tokens/s over AR's, from each arm's round time (the learned
router's `arm_ms`, measured when it was trained, or given). `model_error_table` holds the same per-arm round times
against a bench's live routed runs. The rule router's calibration replays it at every `min_match` on a bench's
profiles (`rule_sweep`, `rule_references`: `speclab.bench.calibration`).
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from speclab.metrics import model_error, speedup, tau, tokens_per_s
from speclab.progress import Progress
from speclab.routing import replay
from speclab.routing.arms import DEFAULT_ARMS, rule_other
from speclab.routing.routers import LOOKUP, MIN_MATCH, NONE, ArmCosts, arm_backlogs


def arm_profiles(target, drafters: dict, prompts: list[dict], arms: tuple[str, ...],
                 max_new_tokens: int) -> list[replay.Profile]:
    """Each prompt's greedy AR output (the target alone) and every arm profiled at every position of it."""
    from speclab.core.engine import decode
    prog = Progress(len(prompts), "profile every arm")
    out = []
    for i, p in enumerate(prompts):
        ids = torch.tensor(target.tokenizer(p["prompt"], add_special_tokens=False)["input_ids"])
        new = decode(target, ids, max_new_tokens=max_new_tokens).new_ids
        out.append(replay.profile_sequence(target, drafters, ids, new, max_new_tokens, p["prompt_id"], p["category"],
                                           arms=arms))
        prog.update(i + 1)
    return out


def position_ms(p: replay.Profile, costs: ArmCosts) -> np.ndarray:
    """[A, N] each arm's modeled round time at every position of a profile: its draft width there, no catch-up."""
    a = np.repeat(np.arange(len(p.arms))[:, None], p.n, 1)
    return costs.round_ms(a, p.width, np.zeros_like(p.width))


def policy_choices(profiles: list[replay.Profile], costs: ArmCosts, routers: dict) -> dict[str, list[np.ndarray]]:
    """Per policy label, its choices on every profile: each arm alone, the given routers (label -> router, replayed
    round by round), Oracle-Token by accept length (`oracle_max_tau`) and by modeled time (`oracle_min_ms`, each
    round at its arm's width there; catch-ups after switches are left out, so it is optimistic)."""
    arms = profiles[0].arms
    out: dict[str, list[np.ndarray]] = {a: [np.full((1, p.n), i) for p in profiles] for i, a in enumerate(arms)}
    for label, r in routers.items():
        out[label] = [replay.router_choice(p, r) for p in profiles]
    out["oracle-token (tau)"] = [replay.oracle_max_tau(p) for p in profiles]
    out["oracle-token (time)"] = [replay.oracle_min_ms(p, position_ms(p, costs)) for p in profiles]
    return out


def walk_ms(p: replay.Profile, w: replay.Walk, costs: ArmCosts, routed: bool) -> float:
    """Modeled decode ms of one replayed policy (prefill aside): every round at its arm's width there and its
    drafters' backlogs (`routers.arm_backlogs` over the rounds before it), plus the router's time when routed."""
    live = w.start[:, 0] >= 0
    arm, acc = w.drafter[live, 0], w.accepted[live, 0]
    names = [None if a == NONE else a for a in p.arms]
    backlog = [arm_backlogs([p.arms[c]], acc[:r].tolist(), [names[x] for x in arm[:r]])[0]
               for r, c in enumerate(arm)]
    return float(costs.round_ms(arm, p.width[arm, w.start[live, 0]], backlog, routed).sum())


def arms_table(profiles: list[replay.Profile], costs: ArmCosts, choices: dict[str, list[np.ndarray]],
               routed: tuple[str, ...] = ()) -> pd.DataFrame:
    """One row per (policy, category, 'all' too): tau, switches between arms, each arm's share of rounds, modeled
    tokens/s (`walk_ms`; the policies in `routed` pay the router's time) and the modeled speedup over AR (the none
    arm alone, where it is among the policies)."""
    arms = profiles[0].arms
    rows = []
    for label, per in choices.items():
        for p, c in zip(profiles, per):
            w = replay.walk(p, c)
            live = w.start[:, 0] >= 0
            used = w.drafter[live, 0]
            rows.append({"policy": label, "category": p.category, "prompt_id": p.prompt_id, "rounds": int(live.sum()),
                         "tokens": int(w.committed[live, 0].sum()), "ms": walk_ms(p, w, costs, label in routed),
                         "switches": int((used[1:] != used[:-1]).sum()),
                         **{f"share_{a}": float((used == i).mean()) for i, a in enumerate(arms)}})
    df = pd.DataFrame(rows)
    out = []
    shares = [f"share_{a}" for a in arms]
    for (label, cat), g in pd.concat([df, df.assign(category="all")]).groupby(["policy", "category"], sort=False):
        tps = tokens_per_s(g.tokens.sum(), g.ms.sum() / 1e3)
        ar = df[(df.policy == NONE) & (df.category.isin(g.category.unique()) | (cat == "all"))]
        out.append({"policy": label, "category": cat, "prompts": len(g), "tau": tau(g.tokens.sum(), g.rounds.sum()),
                    "switches": int(g.switches.sum()), "tokens_per_s_modeled": tps,
                    "speedup_modeled": speedup(tps, tokens_per_s(ar.tokens.sum(), ar.ms.sum() / 1e3))
                    if len(ar) else float("nan"),
                    **{s: float(np.average(g[s], weights=g.rounds)) for s in shares}})
    return pd.DataFrame(out)


def _learned(method: str) -> bool:
    """A route spec whose rounds the learned router picks (it pays the router's own time)."""
    from speclab.methods import parse_spec
    from speclab.routing.arms import DEFAULT_ARMS, ROUTER, parse_arms
    name, fixed = parse_spec(method)
    return name == "route" and fixed.get("router", ROUTER) == "learned" and \
        len(parse_arms(fixed.get("arms", DEFAULT_ARMS))) > 1


# -- the rule router's calibration (`speclab calibrate --router rule`, the app's calibration tab) ------------------
def bench_arm_profiles(store, bench_id: str, target, models: dict, arms: str = DEFAULT_ARMS) -> list[replay.Profile]:
    """Every arm of `arms` (route's default ones) profiled at every position of each AR output of a bench (the
    target in the bench's dtype), with progress. Not kept in the trace: the trace's profiles are WhiFlash's."""
    from speclab.bench.routing import bench_items, profile_prompt
    from speclab.routing.arms import build, parse_arms
    names = tuple(a.name for a in parse_arms(arms))
    items = bench_items(store, bench_id, target)
    drafters, _ = build(target, models, arms=arms, router="rule", min_match=MIN_MATCH)
    prog = Progress(len(items), f"profile every arm of bench {bench_id}")
    out = []
    for i, item in enumerate(items):
        out.append(profile_prompt(target, drafters, *item, arms=names))
        prog.update(i + 1)
    return out


def rule_sweep(profiles: list[replay.Profile], costs: ArmCosts, grid) -> pd.DataFrame:
    """The rule router replayed at every `min_match` of `grid` (the calibration's threshold): per (threshold,
    category, 'all' too) tau, modeled tokens/s, switches between arms and each arm's share of rounds (`<arm>_share`),
    in the columns of `speclab.bench.routing.sweep`'s."""
    from speclab.routing.routers import RuleRouter
    other = rule_other(profiles[0].arms)
    choices = {float(m): [replay.router_choice(p, RuleRouter(LOOKUP, other, round(m))) for p in profiles]
               for m in grid}
    return _as_sweep(arms_table(profiles, costs, choices)).rename(columns={"policy": "threshold"})


def rule_references(profiles: list[replay.Profile], costs: ArmCosts) -> pd.DataFrame:
    """Each arm alone (the none arm as 'ar') and Oracle-Token by accept length and by modeled time, per category:
    tau and modeled tokens/s (the reference lines of the rule's calibration)."""
    t = _as_sweep(arms_table(profiles, costs, policy_choices(profiles, costs, {})))
    return t.assign(policy=t.policy.replace({NONE: "ar", "oracle-token (tau)": "oracle-token",
                                             "oracle-token (time)": "oracle-token-time"}))


def _as_sweep(table: pd.DataFrame) -> pd.DataFrame:
    """`arms_table`'s rows under the names of a threshold sweep's (`tokens_per_s`, `<arm>_share`)."""
    shares = {c: f"{c.removeprefix('share_')}_share" for c in table.columns if c.startswith("share_")}
    return table.rename(columns={"tokens_per_s_modeled": "tokens_per_s", **shares})


def model_error_table(store, bench_id: str, costs: ArmCosts) -> pd.DataFrame:
    """Per method of a bench whose rounds the cost model knows (route specs and AR): each live run's rounds at their
    modeled time (its arm, width and catch-up backlog; the learned router's own time where it routed) against its
    measured rounds (the prefill left out of both): modeled and live tokens/s pooled, `metrics.model_error`, and the
    mean absolute error over runs."""
    df = store.query("""
        SELECT u.run_id, u.method, x.drafter, x.committed, x.n_drafted, x.backlog,
               x.t_route_ms + x.t_catchup_ms + x.t_draft_ms + x.t_verify_ms + x.t_commit_ms
               + coalesce(x.t_record_ms, 0) AS round_ms
        FROM rounds x JOIN runs u USING (run_id)
        WHERE u.bench_id = ? AND u.status = 'done' AND (u.method LIKE 'route%' OR u.method = 'ar')""", [bench_id])
    if df.empty:
        return pd.DataFrame()
    df["arm"] = df.drafter.fillna(NONE)
    df = df[df.arm.isin(costs.arms)]
    learned = {m: _learned(m) for m in df.method.unique()}
    df["modeled_ms"] = costs.round_ms(df.arm.map(costs.arms.index).to_numpy(), df.n_drafted, df.backlog) \
        + np.where(df.method.map(learned), costs.router_ms, 0.0)
    per = df.groupby("run_id").agg(method=("method", "first"), tokens=("committed", "sum"), live_ms=("round_ms", "sum"),
                                   modeled_ms=("modeled_ms", "sum"))
    per["error"] = model_error(per.tokens / per.modeled_ms, per.tokens / per.live_ms)
    out = per.groupby("method").agg(runs=("error", "size"), tokens=("tokens", "sum"), live_ms=("live_ms", "sum"),
                                    modeled_ms=("modeled_ms", "sum"),
                                    mean_abs_model_error=("error", lambda e: e.abs().mean())).reset_index()
    out["tokens_per_s_live"] = out.tokens / out.live_ms * 1e3
    out["tokens_per_s_modeled"] = out.tokens / out.modeled_ms * 1e3
    out["model_error"] = model_error(out.tokens_per_s_modeled, out.tokens_per_s_live)
    return out[["method", "runs", "tokens_per_s_live", "tokens_per_s_modeled", "model_error", "mean_abs_model_error"]]


def arms_report(table: pd.DataFrame, errors: pd.DataFrame, costs: ArmCosts, where: str, source: str):
    """The route table as a `viz.Report`: per category tau and modeled speedup of every arm alone, the routers and
    the oracles (bars of the speedup), the cost model (`source`: where its costs come from,
    `routing.local_costs.RouteCosts.label`) and, with a bench, its error against the live runs."""
    from speclab.viz import Report, bench_bars
    order = list(dict.fromkeys(table.policy))
    cats = [c for c in dict.fromkeys(table.category) if c != "all"] + ["all"]
    wide = table.pivot(index="policy", columns="category", values="speedup_modeled").loc[order, cats]
    taus = table.pivot(index="policy", columns="category", values="tau").loc[order, cats]
    fmt = {"floatfmt": ".3f"}
    model = cost_terms(costs)
    text = [f"Profiles of {where}; every policy replayed on them exactly (greedy). Modeled tokens/s: every round at "
            f"its modeled time under the learned router's cost model ({source}), speedup over the none arm alone (AR).",
            "", "## Modeled speedup over AR", "", wide.reset_index().to_markdown(index=False, **fmt), "",
            "## tau (tokens per round)", "", taus.reset_index().to_markdown(index=False, **fmt), "",
            "## Each policy's rounds by arm (share)", "",
            table[table.category == "all"][["policy"] + [c for c in table.columns if c.startswith("share_")]]
            .to_markdown(index=False, **fmt), "",
            "## The round-cost model", "",
            f"verify {costs.verify0:.2f} ms + {costs.verify1:.3f} ms per row; the learned router's own time "
            f"{costs.router_ms:.2f} ms a round.", "", model.to_markdown(index=False, **fmt)]
    if not errors.empty:
        text += ["", "## Model error against the bench's live runs", "",
                 "Each live run's rounds at their modeled time (arm, width, backlog, router) against its measured "
                 "rounds (prefill left out of both); `model_error` = modeled / live tokens/s - 1.", "",
                 errors.to_markdown(index=False, **fmt)]
    fig = bench_bars(table.rename(columns={"policy": "method", "speedup_modeled": "speedup"}), "speedup",
                     "Routing v2: modeled speedup over AR by category")
    body = "\n".join(text)
    return Report("Routing v2: arms, routers and oracles", body, [fig], summary=body)


def cost_terms(costs: ArmCosts) -> pd.DataFrame:
    """The per-arm terms of a round-cost model, one row per arm (the route table's and `speclab costs route`'s)."""
    return pd.DataFrame({"arm": costs.arms, "draft_ms": costs.draft, "catchup_ms": costs.catchup0,
                         "catchup_ms_per_token": costs.catchup1, "other_ms": costs.other, "mean_width": costs.width})


def route_costs_report(before, costs: ArmCosts, how: dict, path):
    """`speclab costs route`'s report: the round-cost model measured here (`costs`, kept at `path`) beside the one
    the learned router used before (`before`: a `routing.local_costs.RouteCosts`), term by term, and each arm's
    modeled round (its mean width, no catch-up) in both, as bars."""
    from speclab.core.precision import cpu_label
    from speclab.viz import Report, bench_bars
    tables = []
    for name, c in (("before", before.costs), ("measured here", costs)):
        t = cost_terms(c).assign(verify_ms=c.verify0, verify_ms_per_row=c.verify1, router_ms=c.router_ms,
                                 round_ms=c.round_ms(np.arange(len(c.arms)), c.width, np.zeros(len(c.arms))))
        t.insert(0, "costs", name)
        tables.append(t)
    rows = pd.concat(tables, ignore_index=True)
    bars = rows.rename(columns={"costs": "method", "arm": "category"})
    text = (f"Routing v2's round costs on {cpu_label()}, measured from {how['rounds']} live rounds of "
            f"{how['prompts']} corpus prompts ({how['runs']}) and kept in {path}, where the learned router "
            f"(`route:router=learned`) and `speclab route-table` read them on this machine. Before: {before.label}. "
            "round_ms: an arm's round at its mean width without catch-up (the router's own time aside).\n\n"
            + rows.to_markdown(index=False, floatfmt=".3f"))
    fig = bench_bars(bars, "round_ms", "Each arm's modeled round: the costs before and measured here")
    return Report("Routing v2's round costs", text, [fig])
