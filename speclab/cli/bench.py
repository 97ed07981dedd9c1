"""Benchmark commands: `speclab bench` (methods on a prompt suite, traced, with its report) and `speclab grid` (a
method's parameter grid)."""
from __future__ import annotations

import argparse
import json
import sys

from speclab.cli.common import _num, _positive_int, write_report
from speclab.core.precision import family
from speclab.errors import SpeclabError
from speclab.llamacpp import LLAMACPP_PLD_K, LLAMACPP_SPS_K
from speclab.methods import get_method
from speclab.models import ModelPaths, add_model_args, load_models


def cmd_bench(a: argparse.Namespace) -> int:
    from speclab.bench.results import bench_report
    from speclab.bench.run import BenchConfig, run_bench
    from speclab.trace import TraceStore, check_trace

    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    cfg = BenchConfig(suite=a.suite, methods=methods, limit=a.limit, max_new_tokens=a.max_new_tokens,
                      tree_topk=a.tree_topk, stop_prob=a.stop_prob, peers=a.peers, untraced=a.untraced,
                      temperature=a.temperature, seed=a.seed)
    if a.quick:
        cfg.limit, cfg.max_new_tokens = min(cfg.limit or 2, 2), min(cfg.max_new_tokens, 64)
    for m in methods:
        get_method(m)
    if not any(family(m) == "ar" for m in methods):  # before any file or model is opened
        raise SpeclabError("a benchmark needs 'ar' among its methods: speedups and equality are measured against it")
    from speclab.bench.suites import load_suite
    load_suite(cfg.suite, 1)  # an unknown suite, likewise
    check_trace(a.db)  # the trace file is made once the models loaded (a refused model leaves none behind)
    paths = ModelPaths.from_args(a)
    paths.check()
    from speclab.methods import check_before_loading
    for m in methods:  # a spec's parameter out of range: one line, no model loaded
        check_before_loading(m, {}, paths.target)
    target, models, sets = load_bench_sets(cfg, paths)
    peers = llamacpp_peers(a, cfg, paths, target)
    with TraceStore(a.db) as store:
        bench_id = run_bench(cfg, target, models, store, log=lambda s: print(s, file=sys.stderr), sets=sets,
                             llamacpp=peers)
        report = bench_report(store, bench_id)
    write_report(report, a.report)
    print(f"bench {bench_id}: rows in {a.db}")
    return 0


def load_bench_sets(cfg, paths: ModelPaths):
    """The models of a bench, one set per dtype its methods run in (`plan_dtypes`: --dtype, a spec's @dtype, or
    what --dtype auto chose per method family): sets cfg.methods / dtypes / dtype_why and returns (AR's target, its
    models, {dtype: (target, models)})."""
    from dataclasses import replace

    from speclab.bench.run import plan_dtypes
    from speclab.models import resolve_dtype

    _, decision = resolve_dtype(paths)
    cfg.methods, cfg.dtypes = plan_dtypes(cfg.methods, lambda f: decision.dtype(f) if decision else paths.dtype)
    ar = next(m for m in cfg.methods if family(m) == "ar")
    sets = {}
    for dt in dict.fromkeys([cfg.dtypes[ar], *cfg.dtypes.values()]):
        on = [m for m in cfg.methods if cfg.dtypes[m] == dt]
        roles = {r for m in on for r in get_method(m).needs} | ({"draft"} if cfg.peers and not sets else set())
        fams = [f for f in ("ar", "speculative") if decision and decision.dtype(f) == dt
                and any(family(m) == f and "@" not in m for m in on)]
        if fams:  # the auto choice of these methods' family: its load line says why
            cfg.dtype_why.update({f: decision.line(f) for f in fams})
            cfg.dtype_why.update({f"{r} model": line for r in sorted(roles) for line in decision.role_lines([r])})
            sets[dt] = load_models(paths, roles=roles, fam=fams[0])
            # a spec pinned to this dtype runs every model in it: its own set where auto put a drafter model in
            # another dtype (sps@bf16 beside sps with an fp32 draft)
            pinned = [m for m in on if "@" in m and any(decision.roles.get(r, dt) != dt for r in get_method(m).needs)]
            if pinned:
                sets[f"{dt}@"] = load_models(replace(paths, dtype=dt), roles={r for m in pinned
                                                                             for r in get_method(m).needs})
                cfg.model_sets.update(dict.fromkeys(pinned, f"{dt}@"))
        else:
            sets[dt] = load_models(replace(paths, dtype=dt), roles=roles)
    return (*sets[cfg.dtypes[ar]], sets)


def cmd_grid(a: argparse.Namespace) -> int:
    from speclab.bench.grid import check_grid_keys, grid_report, param_grid, parse_grid
    from speclab.methods import get_method, parse_spec

    name = parse_spec(a.method)[0]
    grid = parse_grid(a.grid or get_method(name).grid)
    # the method's GPU preset rides along as a reference point unless other points are given
    extra = [p for p in [get_method(name).gpu_params] if p]
    try:
        extra = [json.loads(x) for x in a.extra] if a.extra else extra
    except json.JSONDecodeError as e:
        raise SpeclabError(f"--extra must be a JSON object of parameters ({e.msg} at column {e.colno})") from e
    if not all(isinstance(x, dict) for x in extra):
        raise SpeclabError("--extra must be a JSON object of parameters, e.g. '{\"depth\": 8}'")
    check_grid_keys(name, [*grid, *(k for p in extra for k in p)])  # before any model is loaded
    choices = {p.name: p.choices for p in get_method(name).params if p.choices}
    for key, values in grid.items():  # numbers (or named choices) now; their ranges once the models are loaded
        for v in values:
            if key in choices:
                if v not in choices[key]:
                    raise SpeclabError(f"--grid {key}={v!r}: the values of {key} are {', '.join(choices[key])}")
                continue
            try:
                float(v)
            except ValueError:
                raise SpeclabError(f"--grid {key}={v!r}: the values of {key} are numbers") from None
    from speclab.bench.suites import load_suite
    load_suite(a.suite, 1)  # an unknown suite, before any model is loaded
    from speclab.methods import check_before_loading
    paths = ModelPaths.from_args(a)
    for key, values in grid.items():  # each value in its range, as far as the target's config tells
        for v in values:
            check_before_loading(name, {key: v}, paths.target)
    target, models = load_models(paths, roles=get_method(name).needs)
    df = param_grid(target, models, name, grid, suite=a.suite, limit=a.limit, max_new_tokens=a.max_new_tokens,
                    extra=extra, log=lambda s: print(s, file=sys.stderr))
    write_report(grid_report(df, name, grid, a.x, a.suite, a.limit, a.max_new_tokens), a.report)
    return 0


def llamacpp_peers(a: argparse.Namespace, cfg, paths: ModelPaths, target):
    """The llama.cpp peers of a greedy CPU bench with peers (`speclab.bench.llamacpp`), in the dtype of the bench's
    speculative methods (AR's when it has none); None, said in one line, where they cannot run."""
    from speclab.bench.llamacpp import model_dirs, open_peers
    from speclab.errors import InvalidInput
    if not (cfg.peers and a.llamacpp and cfg.temperature == 0 and target.device.type == "cpu"):
        return None
    spec = [cfg.dtypes[m] for m in cfg.methods if family(m) != "ar"]
    dtype = max(set(spec), key=spec.count) if spec else cfg.dtypes[next(m for m in cfg.methods if family(m) == "ar")]
    try:
        return open_peers(*model_dirs(paths.target, paths.models.get("draft")), dtype,
                          a.llamacpp_pld_k, a.llamacpp_sps_k, target.max_context,
                          log=lambda s: print(s, file=sys.stderr))
    except InvalidInput as e:
        print(f"llama.cpp peers left out: {e}", file=sys.stderr)
        return None


def add_parsers(sub) -> None:
    """`bench` and `grid`."""
    b = sub.add_parser("bench", help="benchmark methods on a prompt suite; markdown + HTML report, rows in DuckDB")
    b.add_argument("--methods", default="ar,sps,pld", help="comma-separated method specs (ar is required); a spec "
                   "fixes parameters with ':' and '+': eagle3:tree_topk=1+depth=4")
    b.add_argument("--suite", default="zoo", help="zoo | code | math | stories | literature | spec_bench | mt_bench | "
                   "translation | summarization | qa | math_reasoning | rag | demo")
    b.add_argument("--limit", type=_positive_int, default=8, help="prompts per category")
    b.add_argument("--max-new-tokens", type=_positive_int, default=128)
    b.add_argument("--tree-topk", type=_positive_int, default=1,
                   help="sps: children per level (eagle3 takes its own from its spec)")
    b.add_argument("--stop-prob", type=_num(float, 0.0, 1.0, hi_open=True), default=0.0,
                   help="sps: end a chain after a draft token below this probability; hf_assisted gets the same "
                        "threshold (its own default is 0.4)")
    b.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True,
                   help="also time Hugging Face assisted generation and prompt lookup, and llama.cpp (below)")
    b.add_argument("--llamacpp", action=argparse.BooleanOptionalAction, default=True,
                   help="with --peers on CPU, greedy: llama.cpp's plain, prompt-lookup and draft-model decoding "
                   "(llamacpp, llamacpp_pld, llamacpp_sps) on the bench's models exported to GGUF, in the dtype of "
                   "the speculative methods, when llama-cpp-python is installed")
    b.add_argument("--llamacpp-pld-k", type=_num(int, 1, 32), default=LLAMACPP_PLD_K,
                   help=f"llamacpp_pld: draft tokens a step (default {LLAMACPP_PLD_K}: the best here, `speclab costs "
                   "llamacpp`; the bindings recommend 2 on CPU, 10 on GPU)")
    b.add_argument("--llamacpp-sps-k", type=_num(int, 1, 32), default=LLAMACPP_SPS_K,
                   help=f"llamacpp_sps: draft tokens a step (default {LLAMACPP_SPS_K}: the best here, `speclab costs "
                   "llamacpp`)")
    b.add_argument("--untraced", action=argparse.BooleanOptionalAction, default=True,
                   help="also time every method untraced (peer comparison and tracing overhead)")
    b.add_argument("--temperature", type=_num(float, 0.0, 100.0), default=0.0,
                   help="> 0: every method samples at this temperature (prompt i at seed --seed + i): tau and speed "
                   "under sampling; outputs are not compared with AR's, and the peers (greedy only) are left out")
    b.add_argument("--seed", type=_num(int, 0, 2**31 - 1), default=0,
                   help="with --temperature: the first prompt's seed")
    b.add_argument("--quick", action="store_true", help="2 prompts per category, 64 tokens: a minute or two")
    b.add_argument("--db", default="traces/bench.duckdb")
    b.add_argument("--report", default="reports/bench.md")
    add_model_args(b)
    b.set_defaults(fn=cmd_bench)

    gr = sub.add_parser("grid", help="tokens/s, tau and speedup over a grid of a method's parameters (CPU defaults)")
    gr.add_argument("--method", default="eagle3")
    gr.add_argument("--grid", default=None, help="param=v1,v2,...;param=... (every combination is decoded; default: "
                    "the method's own grid)")
    gr.add_argument("--extra", action="append", help="one more point as JSON (repeatable), e.g. "
                    "'{\"depth\": 8, \"tree_topk\": 10, \"total_tokens\": 60}'; default: the method's GPU preset")
    gr.add_argument("--x", default=None, help="parameter on the plot's x axis (default: the grid's last)")
    gr.add_argument("--suite", default="zoo")
    gr.add_argument("--limit", type=_positive_int, default=2, help="prompts per category")
    gr.add_argument("--max-new-tokens", type=_positive_int, default=128)
    gr.add_argument("--report", default="reports/grid.html")
    add_model_args(gr)
    gr.set_defaults(fn=cmd_grid)
