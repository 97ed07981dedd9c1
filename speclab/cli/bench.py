"""Benchmark commands: `speclab bench` (methods on a prompt suite, traced, with its report) and `speclab grid` (a
method's parameter grid)."""
from __future__ import annotations

import argparse
import json
import sys

from speclab.cli.common import _num, _positive_int, add_ray_args, cluster_args, repeated, write_report
from speclab.core.precision import family
from speclab.errors import SpeclabError
from speclab.llamacpp import LLAMACPP_PLD_K, LLAMACPP_SPS_K
from speclab.methods import get_method
from speclab.models import ModelPaths, add_model_args, load_bench_sets, load_models


def cmd_bench(a: argparse.Namespace) -> int:
    from speclab.bench.llamacpp import bench_peers
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
    if twice := repeated(methods):
        raise SpeclabError(f"--methods lists {', '.join(twice)} more than once")
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
    log = lambda s: print(s, file=sys.stderr)  # noqa: E731
    cl = cluster_args(a)
    if cl is not None:  # the workers load the models, each on its node; the trace is written once, at the end
        from speclab import cluster
        try:
            bench_id = cluster.run_bench(cl, cfg, paths.absolute(), a.db,
                                         (a.llamacpp_pld_k, a.llamacpp_sps_k) if a.llamacpp else None, log)
        finally:
            cluster.stop(cl)
        with TraceStore(a.db, read_only=True) as store:
            report = bench_report(store, bench_id)
    else:
        target, models, sets = load_bench_sets(cfg, paths)
        peers = bench_peers(cfg, paths, target, a.llamacpp_pld_k, a.llamacpp_sps_k, log) if a.llamacpp else None
        with TraceStore(a.db) as store:
            bench_id = run_bench(cfg, target, models, store, log=log, sets=sets, llamacpp=peers)
            report = bench_report(store, bench_id)
    write_report(report, a.report)
    print(f"bench {bench_id}: rows in {a.db}")
    return 0


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
    log = lambda s: print(s, file=sys.stderr)  # noqa: E731
    cl = cluster_args(a)
    if cl is not None:
        from speclab import cluster
        try:
            df, _ = cluster.param_grid(cl, paths.absolute(), name, grid, a.suite, a.limit, a.max_new_tokens, extra,
                                       log, a.temperature, a.seed)
        finally:
            cluster.stop(cl)
    else:
        target, models = load_models(paths, roles=get_method(name).needs)
        df = param_grid(target, models, name, grid, suite=a.suite, limit=a.limit, max_new_tokens=a.max_new_tokens,
                        extra=extra, log=log, temperature=a.temperature, seed=a.seed)
    write_report(grid_report(df, name, grid, a.x, a.suite, a.limit, a.max_new_tokens, a.temperature), a.report)
    return 0


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
    add_ray_args(b, "each worker decodes whole prompts (every method and AR on one worker)")
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
    gr.add_argument("--temperature", type=_num(float, 0.0, 100.0), default=0.0,
                    help="> 0: every decode samples at this temperature (prompt i at seed --seed + i, AR too), to pick "
                    "defaults per temperature; outputs are not compared with AR's")
    gr.add_argument("--seed", type=_num(int, 0, 2**31 - 1), default=0,
                    help="with --temperature: the first prompt's seed")
    gr.add_argument("--report", default="reports/grid.html")
    add_model_args(gr)
    add_ray_args(gr, "each worker decodes whole prompts (AR and every combination on one worker)")
    gr.set_defaults(fn=cmd_grid)
