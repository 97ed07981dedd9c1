"""`speclab adapt`: serve a stream of prompts with SpecBlock under each adaptation policy (static, the
always-update OSD baseline, the cost-aware bandit), every query traced with its decision (`speclab.adaptation`);
a report of accepted length and tokens/s over the stream, the bandit's actions and the time spent updating."""
from __future__ import annotations

import argparse

from speclab.cli.common import DEFAULT_DB, _num, _positive_int, write_report
from speclab.errors import SpeclabError
from speclab.models import ModelPaths, add_model_args, load_models


def cmd_adapt(a: argparse.Namespace) -> int:
    import copy

    from speclab.adaptation import POLICIES, AdaptConfig, adapt_stream
    from speclab.bench.suites import load_suite
    from speclab.methods import method_params
    from speclab.trace import TraceStore

    policies = [p.strip() for p in a.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if not policies or bad:
        raise SpeclabError(f"--policies {a.policies}: each one of {', '.join(POLICIES)}")
    prompts = load_suite(a.suite, a.limit)
    if not prompts:
        raise SpeclabError(f"suite '{a.suite}' has no prompts")
    target, models = load_models(ModelPaths.from_args(a), roles=("specblock",))
    params = method_params("specblock", {}, target)
    frames = []
    with TraceStore(a.db) as store:
        for policy in policies:
            model = copy.deepcopy(models["specblock"])  # every policy starts from the same drafter
            cfg = AdaptConfig(policy=policy, lr=a.lr, seed=a.seed)
            frames.append(adapt_stream(target, model, prompts, cfg, params, a.max_new_tokens, store,
                                       stream=f"{a.suite}:{policy}"))
    write_report(adapt_report(frames, a.suite), a.report)
    return 0


def adapt_report(frames, suite: str):
    """Per policy: accepted length and tokens/s over the whole stream and its second half, the actions, the
    updates and their time, the reverts; the curves over the stream (rolling mean of 8 queries)."""
    import pandas as pd

    from speclab import viz
    from speclab.viz import Report

    df = pd.concat(frames, ignore_index=True)
    half = df["query"] >= df.groupby("policy")["query"].transform("max") / 2
    rows = []
    for policy, g in df.groupby("policy", sort=False):
        h = g[half[g.index]]
        rows.append({"policy": policy, "queries": len(g), "tau": g.tau.mean(), "tau_2nd_half": h.tau.mean(),
                     "tokens_per_s": g.tokens_per_s.mean(), "tokens_per_s_2nd_half": h.tokens_per_s.mean(),
                     **{f"n_{act}": int((g.action == act).sum()) for act in ("skip", "head", "full")},
                     "updates": int(g.trained.notna().sum()), "update_s": g.update_ms.sum() / 1e3,
                     "reverts": int(g.reverted.sum())})
    table = pd.DataFrame(rows)
    roll = df.assign(tau_roll=df.groupby("policy").tau.transform(lambda s: s.rolling(8, min_periods=1).mean()),
                     tps_roll=df.groupby("policy").tokens_per_s.transform(
                         lambda s: s.rolling(8, min_periods=1).mean()))
    figs = [viz.lines_figure(roll, "query", "tau_roll", "policy", f"Accepted length over the {suite} stream "
                             "(rolling mean of 8 queries)", "query", "tau"),
            viz.lines_figure(roll, "query", "tps_roll", "policy", f"Tokens/s over the {suite} stream (rolling mean "
                             "of 8 queries; update time charged to the queries after it)", "query", "tokens/s")]
    text = (f"# Serving-time adaptation on {suite}\n\n" + table.to_markdown(index=False, floatfmt=".3f") + "\n")
    return Report(f"speclab adapt: {suite}", text, figs)


def add_parsers(sub) -> None:
    from speclab.adaptation import POLICIES
    from speclab.bench.suites import SUITES
    p = sub.add_parser("adapt", help="serve a prompt stream with SpecBlock under each adaptation policy (static, "
                       "OSD, the cost-aware bandit): accepted length and tokens/s over the stream")
    add_model_args(p)
    p.add_argument("--suite", choices=list(SUITES), default="math", help="the stream (default: math)")
    p.add_argument("--limit", type=_positive_int, default=None, help="prompts per category (default: all)")
    p.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated: {', '.join(POLICIES)}")
    p.add_argument("--max-new-tokens", type=_positive_int, default=96)
    p.add_argument("--lr", type=_num(float, 1e-8, 1.0), default=1e-4, help="the updates' learning rate")
    p.add_argument("--seed", type=_num(int, 0, 2**63 - 1), default=0)
    p.add_argument("--db", default=DEFAULT_DB)
    p.add_argument("--report", default="reports/adapt.md")
    p.set_defaults(fn=cmd_adapt)
