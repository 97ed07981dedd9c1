"""The cost micro-benchmarks as one command group: `speclab costs forward | dtype | switch | measure | kernels`,
and each drafter's own from its registry entry (`catchup`, `block`, `contemplate`) (`speclab.bench.costs`: every
table and curve; the kernels' own timing loop is handed speclab's)."""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from speclab.cli.common import _num, _positive_int, _positive_ints, write_report
from speclab.drafters.registry import drafters
from speclab.errors import SpeclabError
from speclab.models import ModelPaths, add_model_args, check_model_args, load_models


def cmd_forward(a: argparse.Namespace) -> int:
    from speclab.bench.costs import dtype_costs, dtype_costs_report, forward_costs, forward_costs_report

    ns = _positive_ints(a.n or ("1,2,4,8,16,32,64" if a.by_dtype else "1,5,9"), "--n")
    if a.by_dtype:
        from speclab.core.precision import check_dtype
        dtypes = [check_dtype(d.strip()) for d in a.dtypes.split(",") if d.strip()]
        if not dtypes or "auto" in dtypes:
            raise SpeclabError(f"--dtypes {a.dtypes!r}: name the dtypes to compare, e.g. fp32,bf16")
        check_model_args(a)

        def load(dt):
            a.dtype = dt
            target, models = load_models(ModelPaths.from_args(a), roles=("draft", "eagle3", "dflash"))
            a.exact = True
            exact, _ = load_models(ModelPaths.from_args(a), roles=())
            a.exact = False
            return target, exact, models
        df = dtype_costs(load, dtypes, ns, context=a.context, reps=a.reps)
        write_report(dtype_costs_report(df, a.context), a.report)
        return 0
    target, models = load_models(ModelPaths.from_args(a), roles=("draft",))
    df = forward_costs({"target": target, "draft": models["draft"]}, ns=ns, context=a.context, reps=a.reps)
    if df.empty:
        raise SpeclabError("neither model runs on the lean forward (see speclab.core.lean.supports): nothing to "
                           "compare")
    write_report(forward_costs_report(df, a.context), a.report)
    return 0


def cmd_dtype(a: argparse.Namespace) -> int:
    """`speclab costs dtype`: --dtype auto's decision for these models on this machine, measured again (or, with
    --cached, as the cache holds it) and kept in the cache."""
    from dataclasses import replace

    from speclab.bench.costs import dtype_decision_report
    from speclab.models import resolve_dtype

    check_model_args(a)
    if a.dtype not in (None, "auto"):
        raise SpeclabError(f"costs dtype measures what --dtype auto chooses; --dtype {a.dtype} chooses nothing")
    paths = replace(ModelPaths.from_args(a), dtype="auto")
    _, d = resolve_dtype(paths, remeasure=not a.cached)
    write_report(dtype_decision_report(d), a.report)
    return 0


def cmd_switch(a: argparse.Namespace) -> int:
    from speclab.bench.costs import switch_costs, switch_costs_report

    backlogs = _positive_ints(a.backlog, "--backlog")
    contexts = _positive_ints(a.context, "--context")
    target, models = load_models(ModelPaths.from_args(a), roles=("eagle3", "dflash"))
    df = switch_costs(target, models, contexts=contexts, backlogs=backlogs, reps=a.reps)
    write_report(switch_costs_report(df), a.report)
    return 0


def cmd_drafter_costs(a: argparse.Namespace) -> int:
    """`speclab costs NAME` of a drafter's own micro-benchmark (its registry entry's `costs`: the function of
    speclab.bench.costs that times it and how its curves are drawn)."""
    from speclab.bench import costs

    c, drafter = a.cost, a.drafter
    values = _positive_ints(getattr(a, c.option.lstrip("-").replace("-", "_")), c.option)
    if min(values) < c.low:
        raise SpeclabError(f"{c.option}: {c.low_why + ', so ' if c.low_why else ''}the values start at {c.low} "
                           f"(got {min(values)})")
    role = drafters()[drafter].model.role
    target, models = load_models(ModelPaths.from_args(a), roles=(role,))
    try:
        df = getattr(costs, c.fn)(target, models[role], **{c.axis: values}, context=a.context, reps=a.reps)
    except ValueError as e:
        raise SpeclabError(str(e)) from e
    write_report(costs.cost_curves_report(df, c.x, [p for p in c.parts if p in df], c.part, c.title,
                                          c.ylabel.format(context=a.context), c.xlabel), a.report)
    return 0


def cmd_kernels(a: argparse.Namespace) -> int:
    import pandas as pd
    import torch

    from kernels import bench
    from speclab.bench.costs import kernels_report, timeit_interleaved
    from speclab.progress import Progress

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SpeclabError("--device cuda: no CUDA device here")
    if device != "cuda":
        print(f"speclab costs kernels: no GPU ({device}): Triton runs here only in interpreter mode (correctness "
              "tests, not speed), so only the torch twins are timed")
    prog = Progress(sum(len(s) for s in bench.SIZES.values()), "costs kernels")
    df = pd.DataFrame(bench.run(device, a.reps, on_step=lambda i, n, op: prog.update(i, op=op),
                                timeit=timeit_interleaved))
    write_report(kernels_report(df, device), a.report)
    return 0


def cmd_measure(a: argparse.Namespace) -> int:
    from speclab.bench.costs import measure_profile, profile_report
    from speclab.cli.common import _check_writable

    widths = _positive_ints(a.rows, "--rows")
    backlogs = _positive_ints(a.backlog, "--backlog")
    name = (a.name or "").strip()
    if not name or len(name) > 64 or any(not (c.isalnum() or c in "-_.") for c in name):
        raise SpeclabError(f"--name {a.name!r}: a short name of letters, digits, '-', '_' or '.' (it names the "
                           "profile in tables, plots and calibration files)")
    _check_writable(a.out, "--out")
    target, models = load_models(ModelPaths.from_args(a), roles=("eagle3", "dflash"))
    if max(widths) + a.context > target.max_context or max(backlogs) + a.context > target.max_context:
        raise SpeclabError(f"--context {a.context} with {max(max(widths), max(backlogs))} more tokens does not fit "
                           f"the target's context of {target.max_context}")
    profile = measure_profile(target, models, name, widths=widths, backlogs=backlogs, context=a.context, reps=a.reps)
    write_report(profile_report(profile), a.report)
    print(f"\ncost profile {profile.label}: {profile.save(a.out)}")
    return 0


def cmd_roofline(a: argparse.Namespace) -> int:
    """`speclab costs roofline`: the target and every drafter model at hand by rows, against the bandwidth bound."""
    import json

    from speclab.bench.roofline import bandwidths, gap_costs, records, roofline, roofline_report
    from speclab.methods import ROLES

    rows = _positive_ints(a.rows, "--rows")
    gaps = _gaps(a.gaps)
    gap_rows = _positive_ints(a.gap_rows, "--gap-rows")
    for opt in ("large_mb", "small_mb"):
        v = getattr(a, opt)
        if v is not None and not 0 < v <= 65536:
            raise SpeclabError(f"--{opt.replace('_', '-')} {v:g}: a size in MB, above 0 and at most 65536")
    check_model_args(a)
    roles = tuple(r for r, role in ROLES.items() if role.call is not None)
    target, models = load_models(ModelPaths.from_args(a), roles=roles)
    widest = max(rows + (gap_rows if gaps else []))
    if widest + a.context + 1 > target.max_context:
        raise SpeclabError(f"--context {a.context} with {widest} rows does not fit the target's context of "
                           f"{target.max_context}")
    bw = bandwidths(a.large_mb, a.small_mb)
    df = roofline(target, models, rows=rows, context=a.context, reps=a.reps, bw=bw)
    after = gap_costs(target, gap_rows, gaps, context=a.context, reps=a.reps) if gaps else None
    if a.json:
        for r in records(df, after):
            print(json.dumps(r), flush=True)
        return 0
    write_report(roofline_report(df, after), a.report)
    return 0


def _gaps(text: str) -> list[float]:
    """`--gaps`: '0,1,2,4,8' -> milliseconds from 0 to 100; 'none' -> []; anything else one line naming it."""
    if str(text).strip().lower() == "none":
        return []
    ms = _num(float, 0, 100)
    try:
        vals = [float(ms(x)) for x in str(text).split(",") if x.strip()]
    except argparse.ArgumentTypeError:
        vals = []
    if not vals:
        raise SpeclabError(f"--gaps must be milliseconds from 0 to 100 separated by commas, or none (got {text!r})")
    return sorted(set(vals))


def cmd_step(a: argparse.Namespace) -> int:
    """`speclab costs step`: where one decode step's time goes, by op, per method (`speclab.bench.steps`)."""
    from speclab.bench.steps import step_profile, steps_report
    from speclab.checks import Bound, check_number, check_sampling
    from speclab.core.precision import cpu_label, dtype_name
    from speclab.generate import check_generation, check_text, generate
    from speclab.methods import check_before_loading, get_method

    specs = [m.strip() for m in a.methods.split(",") if m.strip()]
    if not specs:
        raise SpeclabError("--methods: name at least one method, e.g. ar,eagle3")
    check_text(a.prompt)
    check_sampling(a.temperature, 0, 1.0, 0)
    check_number("tokens", a.tokens, int, Bound(1, 4096))
    check_model_args(a)
    paths = ModelPaths.from_args(a)
    roles: list[str] = []
    for m in specs:
        check_before_loading(m, {}, paths.target)
        roles += [r for r in get_method(m).needs if r not in roles]
    target, models = load_models(paths, roles=tuple(roles))
    for m in specs:
        check_generation(target, a.prompt, m, models, a.tokens, a.temperature, 0, 1.0, 0, {})
    summaries, ops = [], []
    for m in specs:
        print(f"profiling {m} ...", flush=True)
        s, o = step_profile(lambda m=m: generate(target, a.prompt, m, models=models, max_new_tokens=a.tokens,
                                                 temperature=a.temperature, seed=0), m, lambda r: r.decode.rounds)
        summaries.append(s)
        ops.append(o)
    import pandas as pd
    what = f"{a.tokens} new tokens of one prompt at T = {a.temperature:g}"
    write_report(steps_report(summaries, pd.concat(ops), cpu_label(), dtype_name(target.dtype), what), a.report)
    return 0


def cmd_llamacpp(a: argparse.Namespace) -> int:
    """`speclab costs llamacpp`: ms per token of llama.cpp's plain decoding against speclab's AR per dtype, against
    the bandwidth bound; where one speclab AR step's time goes; and llama.cpp's draft lengths swept."""
    from dataclasses import replace

    import pandas as pd

    from speclab import llamacpp as lc
    from speclab.bench import llamacpp as peers_mod
    from speclab.bench.roofline import bandwidths
    from speclab.bench.run import format_prompt
    from speclab.bench.steps import step_profile, steps_report
    from speclab.bench.suites import load_suite
    from speclab.core.precision import cpu_label
    from speclab.generate import generate
    from speclab.progress import Progress

    dtypes = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in peers_mod.GGUF_TYPE]
    if not dtypes or bad:
        raise SpeclabError(f"--dtypes {a.dtypes!r}: comma-separated, of {', '.join(peers_mod.GGUF_TYPE)}")
    ks = {"llamacpp_pld": _positive_ints(a.pld_k, "--pld-k"), "llamacpp_sps": _positive_ints(a.sps_k, "--sps-k")}
    if max(max(v) for v in ks.values()) > 32:
        raise SpeclabError("--pld-k / --sps-k: draft lengths of at most 32")
    if lc.available() is None:
        raise SpeclabError("llama-cpp-python is not installed: `bash scripts/setup.sh peers` builds it")
    check_model_args(a)
    paths = ModelPaths.from_args(a)
    rows = load_suite("zoo", a.limit)
    targets = {d: load_models(replace(paths, dtype=d), roles=())[0] for d in dtypes}
    t0 = next(iter(targets.values()))
    prompts = [format_prompt(t0, r) for r in rows]
    tdir, ddir = peers_mod.model_dirs(paths.target, paths.models.get("draft"))
    sweep_dtype = "bf16" if "bf16" in dtypes else dtypes[0]
    peers = peers_mod.open_peers(tdir, ddir, sweep_dtype, 4, 4, t0.max_context)
    ks = {p: v for p, v in ks.items() if p in peers.peers()}  # no draft model (another target): no sps sweep
    n_sweep = len(prompts) * (1 + sum(len(v) for v in ks.values()))
    prog = Progress(len(prompts) * len(dtypes) + n_sweep, "llama.cpp costs")
    done = [0]

    def tick():
        done[0] += 1
        prog.update(done[0])
    per = peers_mod.per_token_costs(targets, tdir, prompts, a.tokens, t0.eos_ids, tick)
    sweep = peers_mod.k_sweep(peers, prompts, a.tokens, t0.eos_ids, ks, tick)
    bw = bandwidths()
    summary = peers_mod.cost_summary(per, targets, bw)
    profiles = [step_profile(lambda t=t: generate(t, prompts[0], "ar", max_new_tokens=a.tokens), f"ar ({d})",
                             lambda r: r.decode.rounds) for d, t in targets.items()]
    prof = steps_report([p[0] for p in profiles], pd.concat([p[1] for p in profiles]), cpu_label(), ",".join(dtypes),
                        f"speclab AR, {a.tokens} tokens of one prompt")
    report = peers_mod.costs_report(summary, peers_mod.sweep_table(sweep), prof, peers, bw,
                                    f"{len(prompts)} zoo prompts x {a.tokens} tokens")
    write_report(report, a.report)
    return 0


def cmd_route(a: argparse.Namespace) -> int:
    """`speclab costs route`: routing v2's round costs measured on this machine for the learned router's arms (each
    arm's rounds live on corpus prompts, and the router's own time), kept in the per-user cache, where the learned
    router reads them (`speclab.routing.local_costs`)."""
    from speclab import zoo
    from speclab.bench.arms import route_costs_report
    from speclab.methods import get_method
    from speclab.routing import local_costs
    from speclab.train.route import RouteTrainConfig, measure_costs, router_overhead
    from speclab.train.router import setup

    check_model_args(a)
    corpus = Path(a.corpus or zoo.REPO_ROOT / "data" / "corpus")
    if not corpus.is_dir():
        raise SpeclabError(f"--corpus {corpus}: no such folder (the zoo's domains: data/corpus)")
    target, models = load_models(ModelPaths.from_args(a), roles=tuple(dict.fromkeys(
        get_method("route").needs + ("route",))))
    mlp = models["route"]
    shipped = local_costs.for_router(mlp, target, models)
    with tempfile.TemporaryDirectory() as out:
        cfg = RouteTrainConfig(corpus_dir=str(corpus), out_dir=out, arms="+".join(mlp.config.arms),
                               cost_prompts=a.prompts, new_tokens=a.new_tokens, threads=torch.get_num_threads())
        _, prompts = setup(cfg, target)
        costs, how = measure_costs(target, models, prompts, cfg)
        costs.router_ms = router_overhead(target, models, prompts, cfg, mlp)
    path = local_costs.store(mlp, target, models, costs, how)
    write_report(route_costs_report(shipped, costs, how, path), a.report)
    return 0


def add_parsers(sub) -> None:
    """`costs` and its commands."""
    c = sub.add_parser("costs", help="cost micro-benchmarks: ms per model call (forward), EAGLE-3 catch-up, switch "
                       "and DFlash block; the kernels against their torch twins")
    cs = c.add_subparsers(dest="costs_cmd", required=True)
    f = cs.add_parser("forward", help="ms per model call: speclab's lean forward vs the transformers forward")
    add_model_args(f)
    f.add_argument("--n", default=None, help="tokens per call (comma-separated; default 1,5,9, or 1,2,4,...,64 with "
                   "--by-dtype)")
    f.add_argument("--by-dtype", action="store_true", help="ms per call by width and dtype for the target (fast and "
                   "exact) and every drafter, instead of lean vs transformers")
    f.add_argument("--dtypes", default="fp32,bf16", help="with --by-dtype: the dtypes to compare")
    f.add_argument("--context", type=_positive_int, default=200, help="tokens already in the KV cache")
    f.add_argument("--reps", type=_positive_int, default=15,
                   help="interleaved repetitions (20 calls each); the median is shown")
    f.add_argument("--report", default="reports/forward_costs.html")
    f.set_defaults(fn=cmd_forward)

    dt = cs.add_parser("dtype", help="--dtype auto on this machine: each method family's round timed in fp32 and "
                       "bf16 until resolved, the choice kept in the per-user cache (measured again here)")
    add_model_args(dt)
    dt.add_argument("--cached", action="store_true", help="show the cached decision (measure only if there is none)")
    dt.add_argument("--report", default="reports/dtype_auto.html")
    dt.set_defaults(fn=cmd_dtype)

    sc = cs.add_parser("switch", help="EAGLE-3 catch-up at a switch as a share of round latency, by context "
                        "and backlog (WhiFlash Table 4)")
    sc.add_argument("--context", default="64,128,256,512", help="tokens already in the caches (comma-separated)")
    sc.add_argument("--backlog", default="1,8,16,32,64,128", help="backlog lengths (comma-separated)")
    sc.add_argument("--reps", type=_positive_int, default=7, help="interleaved repetitions; the median is shown")
    sc.add_argument("--report", default="reports/switch_costs.html")
    add_model_args(sc)
    sc.set_defaults(fn=cmd_switch)

    for drafter, e in drafters().items():  # each drafter's own micro-benchmarks (its registry entry)
        for c in e.costs:
            q = cs.add_parser(c.command, help=c.help)
            add_model_args(q)
            q.add_argument(c.option, default=c.default, help=f"the values timed (comma-separated, from {c.low})")
            q.add_argument("--context", type=_positive_int, default=200, help="tokens already in the caches")
            q.add_argument("--reps", type=_positive_int, default=15,
                           help="interleaved repetitions; the median is shown")
            q.add_argument("--report", default=f"reports/{c.command}_costs.html")
            q.set_defaults(fn=cmd_drafter_costs, cost=c, drafter=drafter)

    me = cs.add_parser("measure", help="a hardware cost profile of this machine (target forward by rows, each "
                       "drafter's call and catch-up by backlog, the head) as JSON, for --costs")
    add_model_args(me)
    me.add_argument("--out", required=True, help="the profile file to write (JSON)")
    me.add_argument("--name", required=True, help="the profile's name in tables, plots and calibration files, "
                    "e.g. cpu-bf16 or h100-bf16")
    me.add_argument("--rows", default="1,2,4,8,16,32", help="target forward widths timed (comma-separated)")
    me.add_argument("--backlog", default="1,4,16,64", help="catch-up backlogs timed (comma-separated)")
    me.add_argument("--context", type=_positive_int, default=200, help="tokens already in the caches")
    me.add_argument("--reps", type=_positive_int, default=9, help="interleaved repetitions; the median is kept")
    me.add_argument("--report", help="also write the profile's tables (.md or .html)")
    me.set_defaults(fn=cmd_measure)

    ro = cs.add_parser("route", help="routing v2's round costs measured on this machine (each arm's rounds live, "
                       "the learned router's own time), kept in the per-user cache for route:router=learned")
    add_model_args(ro)
    ro.add_argument("--corpus", help="the corpus its prompts are cut from (default: data/corpus)")
    ro.add_argument("--prompts", type=_positive_int, default=4, help="corpus prompts decoded per arm")
    ro.add_argument("--new-tokens", type=_positive_int, default=96, help="new tokens per decode")
    ro.add_argument("--report", default="reports/route_costs.md")
    ro.set_defaults(fn=cmd_route)

    rl = cs.add_parser("roofline", help="every model call (the target and each drafter model) by rows against its "
                       "bandwidth bound: the machine's read bandwidth, bytes read per call, ms, ratio, fixed part")
    add_model_args(rl)
    rl.add_argument("--rows", default="1,2,4,8,16,64", help="rows per call (comma-separated)")
    rl.add_argument("--context", type=_positive_int, default=200, help="tokens already in the caches")
    rl.add_argument("--reps", type=_positive_int, default=9, help="interleaved repetitions; the median is kept")
    rl.add_argument("--large-mb", type=float, help="working set of the DRAM bandwidth (default: 4 x the last-level "
                    "cache, at least 512 MB)")
    rl.add_argument("--small-mb", type=float, help="working set of the in-cache bandwidth (default: half a core's "
                    "L2, at most 1 MB)")
    rl.add_argument("--gaps", default="0,1,2,4,8", help="the target's calls also timed after this many ms of idling "
                    "(comma-separated, 0-100; none: not timed): what waiting between two target calls adds to the next")
    rl.add_argument("--gap-rows", default="1,4", help="rows of the target's calls timed after a gap (comma-separated)")
    rl.add_argument("--json", action="store_true", help="print one JSON object per (model, rows) (kind roofline) "
                    "and per (rows, gap) of the target (kind gap) instead of the report")
    rl.add_argument("--report", default="reports/roofline.html")
    rl.set_defaults(fn=cmd_roofline)

    st = cs.add_parser("step", help="where a decode step's time goes: each method's round under torch's profiler, "
                       "by op, and the time outside ops")
    add_model_args(st)
    st.add_argument("--methods", default="ar,eagle3", help="method specs (comma-separated)")
    st.add_argument("--prompt", default="The history of the printing press begins in", help="the prompt decoded")
    st.add_argument("--tokens", type=int, default=64, help="new tokens per decode")
    st.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (seed 0 otherwise)")
    st.add_argument("--report", default="reports/step_profile.html")
    st.set_defaults(fn=cmd_step)

    lp = cs.add_parser("llamacpp", help="llama.cpp against speclab: ms per token of plain decoding vs speclab's AR "
                       "per dtype (and the bandwidth bound), one AR step profiled, llama.cpp's draft lengths swept")
    add_model_args(lp)
    lp.add_argument("--dtypes", default="fp32,bf16", help="the dtypes compared (each engine's weights in it)")
    lp.add_argument("--limit", type=_positive_int, default=2, help="zoo prompts per category")
    lp.add_argument("--tokens", type=_positive_int, default=128, help="new tokens per decode")
    lp.add_argument("--pld-k", default="2,4,6,8,10", help="llamacpp_pld draft lengths swept")
    lp.add_argument("--sps-k", default="2,3,4,5,6", help="llamacpp_sps draft lengths swept")
    lp.add_argument("--report", default="reports/llamacpp_costs.md")
    lp.set_defaults(fn=cmd_llamacpp)

    kb = cs.add_parser("kernels", help="the small hot ops: torch twin vs Triton kernel per op and size "
                       "(Triton timed only on CUDA)")
    kb.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when present")
    kb.add_argument("--reps", type=_positive_int, default=50)
    kb.add_argument("--report", default="reports/kernels.html")
    kb.set_defaults(fn=cmd_kernels)
