"""`speclab serve-bench`: batched serving under load (`speclab.core.batch`, `speclab.serve`): every draft-length
policy at every concurrency (closed loop) or arrival rate (open loop) on one prompt suite, one loaded target;
throughput, per-user tokens/s, TTFT, TPOT and ITL (P50, P95) per (policy, load), a plot of each against the load,
the calls per step, and with --check each request's output against its single-stream AR decode."""
from __future__ import annotations

import argparse
import json
import sys

from speclab.cli.common import DEFAULT_DB, _num, _positive_int, _positive_ints, repeated, write_report
from speclab.errors import SpeclabError
from speclab.models import ModelPaths, add_model_args

DEFAULT_POLICIES = ("none", "fixed:k=2", "fixed:k=4", "fixed:k=8", "table", "goodput:k=8", "dspark:k=8")
DEFAULT_METHOD = "dflash:block_size=9"  # DFlash (with DSpark's heads): blocks of up to 8 drafts


def cmd_serve_bench(a: argparse.Namespace) -> int:
    import time
    import uuid

    from speclab.bench.run import format_prompt
    from speclab.bench.suites import load_suite
    from speclab.core.batch import Batch
    from speclab.core.engine import decode
    from speclab.core.sampling import Sampling
    from speclab.equality import first_divergence, kind_of
    from speclab.methods import check_before_loading, get_method, method_params
    from speclab.progress import Progress
    from speclab.serve.load import closed_loop, drafters_for, open_loop, warm_up
    from speclab.serve.policies import StepCost, build_policy, needs_cost, parse_policy
    from speclab.serve.record import ServeRecorder, served_row
    from speclab.trace import TraceStore

    # every option checked before any model loads
    policies = a.policy or list(DEFAULT_POLICIES)
    for p in policies:
        parse_policy(p)
    if twice := repeated(policies):  # each policy is a row of the table and a curve of the plot, under its spec
        raise SpeclabError(f"--policy {', '.join(twice)} given more than once (--repeats runs each again)")
    if a.rate and a.concurrency:
        raise SpeclabError("--rate (open loop) and --concurrency (closed loop): give one of them")
    rates = [_rate(r) for r in a.rate.split(",") if r.strip()] if a.rate else []
    if a.rate and not rates:
        raise SpeclabError(f"--rate must be request rates per second separated by commas (got {a.rate!r})")
    if repeated(rates):
        raise SpeclabError(f"--rate lists a rate more than once (got {a.rate!r})")
    loads = rates or _positive_ints(a.concurrency or "1,2,4,8,16,32", "--concurrency")
    if not rates and max(loads) > a.max_batch:
        raise SpeclabError(f"--concurrency {max(loads)} is above --max-batch {a.max_batch}")
    if a.check and a.temperature > 0:
        raise SpeclabError("--check compares greedy outputs with AR's (T = 0); sampled outputs are checked by their "
                           "distribution (tests/test_batch.py)")
    m = get_method(a.method)
    if m.drafter is None or m.build is not None:
        raise SpeclabError(f"--method {a.method!r}: serve-bench batches one drafter per request (a drafter's method, "
                           "such as pld, eagle3, dflash or sps; not ar or a routed method)")
    if any(parse_policy(p)[0] == "dspark" for p in policies) and m.drafter != "dflash":
        raise SpeclabError(f"--policy dspark schedules by DSpark's confidence head, which sits on a DFlash drafter: "
                           f"--method dflash (got {a.method!r})")
    rows = load_suite(a.suite, a.limit)
    from speclab.trace import check_trace
    if not a.untraced:
        check_trace(a.db)  # the trace file is made once the models loaded
    paths = ModelPaths.from_args(a)
    paths.check()
    check_before_loading(a.method, {}, paths.target)
    from speclab.models import load_models
    target, models = load_models(paths, roles=m.needs)
    if any(parse_policy(p)[0] == "dspark" for p in policies) and not models["dflash"].has_confidence:
        raise SpeclabError(f"--policy dspark: the DFlash drafter at {paths.model_path('dflash')} has no confidence "
                           "head (`speclab train dspark --init-from` it adds one)")
    params = method_params(a.method, {}, target, sampled=a.temperature > 0)
    prompts = [format_prompt(target, r) for r in rows]

    def run_row(st, spec, load, serve_id):
        return dict(served_row(target, a.method, params, spec, st, rows[st.req.rid],
                               **{("rate" if rates else "concurrency"): load, "max_new_tokens": a.max_new_tokens,
                                  "temperature": a.temperature, "seed": st.req.seed, "max_batch": a.max_batch}),
                    bench_id=serve_id)

    sampling = Sampling(temperature=a.temperature, seed=a.seed)

    cost = None
    if any(needs_cost(p) for p in policies):
        print("profiling the batched step (the policies' step-time model) ...", file=sys.stderr, flush=True)
        cost = StepCost.profile(target, make_drafters=drafters_for("fixed", a.method, target, models, params))
        print(f"profiled: {cost.describe()}", file=sys.stderr, flush=True)
    reference = None
    if a.check:
        bar = Progress(len(prompts), "single-stream AR (the reference outputs)")
        reference = []
        for i, ids in enumerate(prompts):
            reference.append(decode(target, ids, None, None, a.max_new_tokens, sampling).new_ids)
            bar.update(i + 1)
    print("warming up (the drafters' first calls) ...", file=sys.stderr, flush=True)
    warm_up(target, drafters_for("fixed", a.method, target, models, params), prompts, sampling, a.max_batch)
    results, total = [], a.repeats * len(policies) * len(loads) * len(prompts)
    bar = Progress(total, "serve-bench")
    done0 = 0
    serve_id = f"serve-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    store = None if a.untraced else TraceStore(a.db)
    try:  # the policies take turns at each load (rotated every load and repeat): machine drift hits them alike
        for rep in range(a.repeats):
            for li, load in enumerate(loads):
                turn = (rep + li) % len(policies)
                for spec in policies[turn:] + policies[:turn]:
                    policy = build_policy(spec, StepCost(**vars(cost)) if cost is not None else None)
                    session = f"{serve_id} {spec} {'rate' if rates else 'c'}={load} #{rep}"
                    recorder = None if store is None else ServeRecorder(
                        store, target.tokenizer, session, spec,
                        lambda st, spec=spec, load=load: run_row(st, spec, load, serve_id))
                    batch = Batch(target, drafters_for(spec, a.method, target, models, params), policy, sampling,
                                  max_batch=a.max_batch, recorder=recorder)

                    def tick(n, base=done0):
                        bar.update(base + n)
                    served = (open_loop(batch, prompts, load, a.max_new_tokens, a.seed, on_step=tick) if rates else
                              closed_loop(batch, prompts, int(load), a.max_new_tokens, on_step=tick))
                    if recorder is not None:
                        recorder.flush()
                    done0 += len(prompts)
                    row = {"policy": spec, "load": "open" if rates else "closed",
                           ("rate" if rates else "concurrency"): load, "repeat": rep, **served.metrics,
                           **_step_counts(served.steps), "session": session}
                    if reference is not None:  # each request against its single-stream AR decode
                        kinds = [kind_of(first_divergence(target, ids, ref.tolist(), d.new_ids.tolist()))
                                 for d, ref, ids in zip(served.dones, reference, prompts)]
                        row.update({k.replace("-", "_"): kinds.count(k) for k in ("equal", "near-tie", "bug")})
                    results.append(row)
    finally:
        if store is not None:
            store.close()
    table = serve_table(results)
    if a.json:
        for row in table.to_dict("records"):
            print(json.dumps(row, default=float), flush=True)
    report = serve_report(table, results, a, target, cost)
    if a.json:  # the JSON lines are the output; the report goes to its file alone
        from speclab.viz import write_html_report
        if a.report:
            write_html_report(str(a.report).removesuffix(".md") + ".html", report.title, report.figs, report.text)
    else:
        write_report(report, a.report)
    return 0


def _rate(text: str) -> float:
    from speclab.checks import Bound, check_number
    return check_number("--rate", text.strip(), float, Bound(0.01, 1000.0))


def _step_counts(steps) -> dict:
    """Per step: requests, verification rows, target calls and drafter model calls (means)."""
    n = max(1, len(steps))
    return {"steps": len(steps), "requests_per_step": sum(len(s.rids) for s in steps) / n,
            "rows_per_step": sum(s.rows for s in steps) / n,
            "target_calls_per_step": sum(s.target_calls for s in steps) / n,
            "drafter_calls_per_step": sum(s.drafter_calls for s in steps) / n,
            "drafted_per_request_step": sum(sum(s.drafted) for s in steps) / max(1, sum(len(s.rids) for s in steps))}


def serve_table(results: list[dict]):
    """One row per (policy, load): each figure's median over the repeats, and throughput over no speculation's
    paired by repeat (the same load, run in the same turn): its mean and 95% interval (Student's t) over the
    repeats."""
    import numpy as np
    import pandas as pd

    from speclab.metrics import ci95
    df = pd.DataFrame(results)
    x = "rate" if "rate" in df else "concurrency"
    none = df[df.policy == "none"].set_index([x, "repeat"]).throughput_tok_s
    if len(none):
        df["vs_none"] = df.throughput_tok_s / pd.Series(list(zip(df[x], df.repeat))).map(none).to_numpy()
    num = [c for c in df.columns if c not in ("policy", "load", x, "repeat", "session") and
           pd.api.types.is_numeric_dtype(df[c])]
    rows = []
    for (policy, load), g in df.groupby(["policy", x], sort=False):
        row = {"policy": policy, "load": g.load.iloc[0], x: load, "repeats": len(g), **g[num].median().to_dict(),
               "session": g.session.iloc[-1]}
        if "vs_none" in g and len(g) > 1:
            row["vs_none"] = float(g.vs_none.mean())
            row["vs_none_ci"] = float(ci95(float(np.std(g.vs_none, ddof=1)), len(g)))
        rows.append(row)
    return pd.DataFrame(rows)


def serve_report(df, results: list[dict], a, target, cost=None):
    from speclab import viz
    from speclab.core.precision import machine
    from speclab.metrics import SERVING_HELP
    from speclab.viz import Report

    x = "rate" if "rate" in df else "concurrency"
    cols = [c for c in ["policy", x, "throughput_tok_s", "vs_none", "vs_none_ci", "per_user_tok_s", "ttft_p50_ms",
                        "ttft_p95_ms", "tpot_p50_ms", "tpot_p95_ms", "itl_p50_ms", "requests_per_step",
                        "rows_per_step", "drafted_per_request_step", "target_calls_per_step",
                        "drafter_calls_per_step", "equal", "near_tie", "bug"] if c in df]
    mc = machine()
    where = (f"{mc['cpu']} ({mc['threads']} threads), {target.precision['dtype']}, method {a.method}, suite {a.suite} "
             f"({int(df.requests.max())} requests of {a.max_new_tokens} tokens), T = {a.temperature}, "
             f"{a.repeats} repeat(s), medians")
    figs = [viz.lines_figure(df, x, "throughput_tok_s", "policy", f"Throughput against {x} ({where})", x,
                             "output tokens/s"),
            viz.lines_figure(df, x, "per_user_tok_s", "policy", f"Per-user tokens/s against {x}", x,
                             "tokens/s per user")]
    defs = "\n".join(f"- **{k}**: {v}" for k, v in SERVING_HELP.items())
    table = df[cols].to_markdown(index=False, floatfmt=".2f")
    sessions = "" if a.untraced else (f"\nEvery request is a run in {a.db}; each (policy, {x}, repeat) is one session "
                                      "(the runs' `decode_group`, the `steps` table's `session`), e.g. "
                                      + ", ".join(f"`{r}`" for r in df.session.head(2)) + "\n")
    profiled = "" if cost is None else f"The policies' step-time model, profiled at start: {cost.describe()}.\n\n"
    text = (f"# Serving under load\n\n{where}\n\n{profiled}{table}\n\n{defs}\n- **vs_none**: throughput over no "
            f"speculation's at the same {x} and repeat (paired), mean over the repeats; **vs_none_ci**: its 95% "
            f"interval (half-width)\n- **equal / near_tie / bug** (`--check`): requests whose greedy output equals "
            f"their single-stream AR decode, differs at a numerical near-tie, or otherwise\n{sessions}")
    return Report("speclab serve-bench", text, figs, summary=f"{where}\n\n{table}")


def add_parsers(sub) -> None:
    from speclab.bench.suites import SUITES
    s = sub.add_parser("serve-bench", help="batched serving under load: throughput, per-user tokens/s, TTFT and "
                       "TPOT of each draft-length policy against concurrency (closed loop) or arrival rate")
    add_model_args(s)
    s.add_argument("--method", default=DEFAULT_METHOD, help="the drafter every request uses (a drafter's method "
                   f"spec, e.g. pld, eagle3:depth=6, dflash); default {DEFAULT_METHOD}")
    s.add_argument("--policy", action="append", help="a draft-length policy, repeatable: none, fixed:k=K, "
                   "table:1-4=4,5-16=2,17-64=0, goodput:k=K,alpha0=A, dspark:k=K,measured=1|0,release=1|0 (default: "
                   + " ".join(DEFAULT_POLICIES) + ")")
    s.add_argument("--concurrency", default=None, help="closed loop: clients in flight, comma-separated "
                   "(default 1,2,4,8,16,32)")
    s.add_argument("--rate", default=None, help="open loop instead: Poisson arrivals, requests per second, "
                   "comma-separated")
    s.add_argument("--suite", choices=list(SUITES), default="zoo")
    s.add_argument("--limit", type=_positive_int, default=None, help="prompts per category (default: all)")
    s.add_argument("--max-new-tokens", type=_num(int, 1, 4096), default=128)
    s.add_argument("--max-batch", type=_num(int, 1, 512), default=64, help="most requests in one step")
    s.add_argument("--repeats", type=_num(int, 1, 20), default=1, help="runs of every (policy, load), the policies "
                   "taking turns: medians, and the ratio to no speculation paired by repeat with its interval")
    s.add_argument("--temperature", type=_num(float, 0.0, 10.0), default=0.0)
    s.add_argument("--seed", type=_num(int, 0, 2**63 - 1), default=0, help="sampling and open-loop arrivals")
    s.add_argument("--check", action="store_true", help="compare every request's output with its single-stream "
                   "AR decode (one more pass over the suite): equal, a numerical near-tie (the target's top-2 logit "
                   "gap at the first difference within rounding), or a bug")
    s.add_argument("--json", action="store_true", help="one JSON object per (policy, load) on stdout")
    s.add_argument("--db", default=DEFAULT_DB, help="the trace: every request a run (rounds, tokens, its serving "
                   "times), every batched step a row of `steps`, one session per (policy, load)")
    s.add_argument("--untraced", action="store_true", help="write no trace (no per-round recording)")
    s.add_argument("--report", default="reports/serve.md")
    s.set_defaults(fn=cmd_serve_bench)
