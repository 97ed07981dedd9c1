"""`speclab` command line: generate | zoo | train (bench, app, sweep come with their issues)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from speclab.errors import SpeclabError

DEFAULT_DB = "traces/speclab.duckdb"


PROMPT_FIELDS = ("prompt", "turns", "question", "text", "problem")


def _positive_ints(text: str, option: str) -> list[int]:
    """'1,5,9' -> [1, 5, 9]; anything else is a SpeclabError naming the option (before any model is loaded)."""
    try:
        vals = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise SpeclabError(f"{option} must be positive integers separated by commas (got {text!r})")
    return vals


def _read_prompts(path: str) -> list[dict]:
    """Prompts from a file: JSON Lines (field prompt / turns / question / text / problem) or one prompt per line.
    Every record is checked before anything is decoded; a bad one is reported by its line number."""
    p = Path(path)
    if not p.is_file():
        raise SpeclabError(f"no prompts file at {p.resolve()}")
    try:
        lines = p.read_bytes().decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise SpeclabError(f"{p}: not UTF-8 text (byte {e.start} cannot be decoded); prompts files are .jsonl or "
                           "plain text, one prompt per line") from e
    rows = []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if p.suffix == ".jsonl":
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise SpeclabError(f"{p} line {i}: not valid JSON ({e.msg} at column {e.colno})") from e
            text = next((r[k] for k in PROMPT_FIELDS if k in r), None) if isinstance(r, dict) else None
            text = text[0] if isinstance(text, list) and text else text
            if not isinstance(text, str) or not text.strip():
                raise SpeclabError(f"{p} line {i}: no prompt (a non-empty string in one of the fields "
                                   f"{', '.join(PROMPT_FIELDS)}); nothing was decoded")
            rows.append({"prompt": text, "prompt_id": str(r.get("id", r.get("question_id", i))),
                         "category": r.get("category"), "line": i})
        else:
            rows.append({"prompt": line, "prompt_id": str(i), "category": None, "line": i})
    if not rows:
        raise SpeclabError(f"{p} holds no prompt (it is empty or blank)")
    return rows


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The target/draft options every model-loading command shares (the app too)."""
    p.add_argument("--model", help="target model directory or cached hub name (default: the zoo target)")
    p.add_argument("--draft", help="draft model for sps (default: the zoo draft)")
    p.add_argument("--eagle", help="EAGLE-3 drafter directory for eagle3 (public layout; default: the zoo's)")
    p.add_argument("--dflash", help="DFlash drafter directory for dflash (public layout; default: the zoo's)")
    p.add_argument("--router-model", help="neural router directory for whiflash-neural (default: the zoo's)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when present)")
    p.add_argument("--dtype", default=None, help="fp32 | bf16 | fp16 (default fp32 on CPU, bf16 on CUDA)")
    p.add_argument("--backend", default="auto", choices=["auto", "lean", "hf"],
                   help="forward pass: speclab's lean forward (Llama family) or the transformers one (default: lean "
                        "where it applies)")


def load_models(a: argparse.Namespace, roles=("draft", "eagle3", "dflash", "router"), log=None):
    """(target, drafter models by role) from the options of `add_model_args`: the roles asked for (those the
    methods at hand need), each from its option or the zoo."""
    from speclab import zoo
    from speclab.target import Target

    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    path = a.model or zoo.default_target()
    log(f"loading target {path} ...")
    target = Target.load(path, device=a.device, dtype=a.dtype, backend=a.backend)
    models = {}
    if "draft" in roles:
        path = a.draft or zoo.default_draft()
        log(f"loading draft {path} ...")
        models["draft"] = Target.load(path, device=a.device, dtype=a.dtype, backend=a.backend)
    if "eagle3" in roles:
        from speclab.drafters.eagle3 import load_eagle3
        path = getattr(a, "eagle", None) or zoo.default_eagle3()
        log(f"loading EAGLE-3 drafter {path} ...")
        models["eagle3"] = load_eagle3(path, target)
    if "dflash" in roles:
        from speclab.drafters.dflash import load_dflash
        path = getattr(a, "dflash", None) or zoo.default_dflash()
        log(f"loading DFlash drafter {path} ...")
        models["dflash"] = load_dflash(path, target)
    if "router" in roles:
        from speclab.routers import load_router
        path = getattr(a, "router_model", None) or zoo.default_router()
        log(f"loading neural router {path} ...")
        models["router"] = load_router(path, target)
    return target, models


def cmd_generate(a: argparse.Namespace) -> int:
    from speclab.checks import Bound, check_number, check_sampling
    from speclab.generate import check_generation, generate
    from speclab.methods import get_method
    from speclab.trace import TraceStore

    method = get_method(a.method)
    if a.prompt is None and a.prompts is None:
        raise SpeclabError("give --prompt TEXT or --prompts FILE")
    check_sampling(a.temperature, a.top_k, a.top_p, a.seed)  # before any file or model is opened
    check_number("max_new_tokens", a.max_new_tokens, int, Bound(1))
    prompts = [{"prompt": a.prompt, "prompt_id": None, "category": None}] if a.prompt is not None else _read_prompts(a.prompts)
    store = None
    if a.db != "none":
        Path(a.db).parent.mkdir(parents=True, exist_ok=True)
        store = TraceStore(a.db)  # before loading models: a locked or foreign file fails fast
    try:
        target, models = load_models(a, roles=method.needs)
        params = {"k": a.k, "tree_topk": a.tree_topk, "stop_prob": a.stop_prob, "depth": a.depth,
                  "total_tokens": a.total_tokens, "block_size": a.block_size, "markov": a.markov}
        for p in prompts:  # every prompt and parameter checked against the models before anything is decoded
            try:
                check_generation(target, p["prompt"], a.method, models, a.max_new_tokens, a.temperature, a.top_k,
                                 a.top_p, a.seed, params)
            except SpeclabError as e:
                raise SpeclabError((f"{a.prompts} line {p['line']}: " if "line" in p else "") + str(e)) from e
        for p in prompts:
            stream = _Streamer(target.tokenizer) if a.stream and not a.json else None
            res = generate(target, p["prompt"], a.method, **models, max_new_tokens=a.max_new_tokens,
                           temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed, deferred=a.deferred,
                           trace=store, on_round=stream, prompt_id=p["prompt_id"], category=p["category"], **params)
            s = res.summary()
            if a.json:  # stdout holds JSON lines only
                print(json.dumps({**s, "text": res.text}), flush=True)
                continue
            if stream is None:
                print(res.text, flush=True)
            else:
                stream.finish()
            print(f"[{s['method']}] {s['tokens']} tokens in {s['elapsed_s']:.2f} s ({s['tokens_per_s']:.1f} tok/s), "
                  f"{s['rounds']} rounds, tau {s['tau']:.2f}, {s['target_calls']} target calls"
                  + (f", run {s['run_id']} in {a.db}" if store else ""), file=sys.stderr, flush=True)
    finally:
        if store is not None:
            store.close()
    return 0


class _Streamer:
    """Prints the text as rounds commit tokens (decoding the whole output keeps multi-byte characters whole)."""

    def __init__(self, tokenizer):
        self.tok, self.ids, self.printed = tokenizer, [], ""

    def __call__(self, ev) -> None:
        self.ids.extend(ev.committed.tolist())
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            sys.stdout.write(text[len(self.printed):])
            sys.stdout.flush()
            self.printed = text

    def finish(self) -> None:
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        sys.stdout.write(text[len(self.printed):] + "\n")
        sys.stdout.flush()


def cmd_stats(a: argparse.Namespace) -> int:
    import pandas as pd

    from speclab.metrics import summarize
    from speclab.trace import TraceStore

    with TraceStore(a.db, read_only=True) as store:
        ids = None
        if a.last:
            ids = store.query("SELECT run_id FROM runs ORDER BY run_id DESC LIMIT ?", [a.last]).run_id.tolist()
        df = summarize(store, ids, by=a.by)
    with pd.option_context("display.width", 200, "display.max_columns", 20, "display.float_format", "{:.3f}".format):
        print(df.to_markdown(index=False, floatfmt=".3f") if a.markdown else df.to_string(index=False))
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from speclab.bench import BenchConfig, bench_overall, peer_ratios, run_bench, write_report
    from speclab.methods import get_method
    from speclab.trace import TraceStore

    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    cfg = BenchConfig(suite=a.suite, methods=methods, limit=a.limit, max_new_tokens=a.max_new_tokens,
                      tree_topk=a.tree_topk, stop_prob=a.stop_prob, peers=a.peers, untraced=a.untraced)
    if a.quick:
        cfg.limit, cfg.max_new_tokens = min(cfg.limit or 2, 2), min(cfg.max_new_tokens, 64)
    for m in methods:
        get_method(m)
    Path(a.db).parent.mkdir(parents=True, exist_ok=True)
    with TraceStore(a.db) as store:
        roles = {r for m in methods for r in get_method(m).needs} | ({"draft"} if cfg.peers else set())
        target, models = load_models(a, roles=roles)
        bench_id = run_bench(cfg, target, models, store, log=lambda s: print(s, file=sys.stderr))
        md, html = write_report(store, bench_id, a.report)
        overall = bench_overall(store, bench_id)
    import pandas as pd
    print(overall.to_markdown(index=False, floatfmt=".3f"))
    peers = peer_ratios(overall)
    if peers:
        print()
        print(pd.DataFrame(peers).to_markdown(index=False, floatfmt=".3f"))
    print(f"\nbench {bench_id}: report {md} and {html}; rows in {a.db}")
    return 0


def cmd_forward_costs(a: argparse.Namespace) -> int:
    from speclab.bench import forward_costs
    from speclab.viz import bench_bars, write_html_report

    ns = _positive_ints(a.n, "--n")
    target, models = load_models(a, roles=("draft",))
    df = forward_costs({"target": target, "draft": models["draft"]}, ns=ns, context=a.context, reps=a.reps)
    if df.empty:
        raise SpeclabError("neither model runs on the lean forward (see speclab.lean.supports): nothing to compare")
    table = df.to_markdown(index=False, floatfmt=".2f")
    print(table)
    long = df.melt(id_vars=["model", "n"], value_vars=["lean_ms", "hf_ms"], var_name="method", value_name="ms")
    long["method"] = long["method"].str.removesuffix("_ms")
    long["category"] = long["model"] + " n=" + long["n"].astype(str)
    Path(a.report).parent.mkdir(parents=True, exist_ok=True)
    path = write_html_report(a.report, "Milliseconds per forward: lean vs transformers",
                             [bench_bars(long, "ms", f"ms per call after a {a.context}-token cache (lower is better)")],
                             table)
    print(f"\nplot: {path}")
    return 0


def cmd_grid(a: argparse.Namespace) -> int:
    from speclab.bench import check_grid_keys, param_grid, parse_grid
    from speclab.methods import get_method, parse_spec
    from speclab.viz import lines_figure, write_html_report

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
    target, models = load_models(a, roles=get_method(name).needs)
    df = param_grid(target, models, name, grid, suite=a.suite, limit=a.limit, max_new_tokens=a.max_new_tokens,
                    extra=extra, log=lambda s: print(s, file=sys.stderr))
    table = df.to_markdown(index=False, floatfmt=".3f")
    print(table)
    best = df.iloc[0]
    print(f"\nfastest: " + ", ".join(f"{k}={best[k]}" for k in grid) + f" at {best.tokens_per_s:.1f} tokens/s "
          f"(speedup {best.speedup:.2f}, tau {best.tau:.2f})")
    x = a.x or list(grid)[-1]
    others = [k for k in grid if k != x]
    plot = df[~df.preset].copy()
    plot["shape"] = plot[others].astype(str).agg(lambda r: " ".join(f"{k}={v}" for k, v in zip(others, r)), axis=1) \
        if others else name
    figs = [lines_figure(plot, x, "tokens_per_s", "shape", f"{name}: tokens/s over {a.suite} "
                         f"({a.limit} prompts per category, {a.max_new_tokens} tokens)", hover="tau"),
            lines_figure(plot, x, "tau", "shape", f"{name}: acceptance length tau")]
    Path(a.report).parent.mkdir(parents=True, exist_ok=True)
    path = write_html_report(a.report, f"speclab grid: {name}", figs, table)
    print(f"plot: {path}")
    return 0


def cmd_catchup_costs(a: argparse.Namespace) -> int:
    from speclab.bench import catchup_costs

    backlogs = _positive_ints(a.backlog, "--backlog")
    target, models = load_models(a, roles=("eagle3",))
    df = catchup_costs(target, models["eagle3"], backlogs=backlogs, context=a.context, reps=a.reps)
    _cost_report(df, "backlog", ["kv_only_ms", "full_ms"], "catch-up", a.report,
                 "EAGLE-3 catch-up: KV-only prefill vs a full forward of the backlog",
                 f"ms per catch-up after a {a.context}-token drafter cache (lower is better)", "backlog tokens")
    return 0


def _cost_report(df, x: str, cols: list[str], legend: str, report: str, title: str, subtitle: str, x_title: str) -> None:
    """Print a cost table and write it with its curves (ms over `x`, one line per column) as an HTML report."""
    from speclab.viz import lines_figure, write_html_report

    table = df.to_markdown(index=False, floatfmt=".3f")
    print(table)
    long = df.melt(id_vars=[x], value_vars=cols, var_name=legend, value_name="ms")
    Path(report).parent.mkdir(parents=True, exist_ok=True)
    path = write_html_report(report, title, [lines_figure(long, x, "ms", legend, subtitle, x_title=x_title)], table)
    print(f"\nplot: {path}")


def cmd_block_costs(a: argparse.Namespace) -> int:
    from speclab.bench import block_costs

    sizes = _positive_ints(a.block_size, "--block-size")
    if min(sizes) < 2:
        raise SpeclabError(f"--block-size: a block is the root and at least one mask, so sizes start at 2 (got {min(sizes)})")
    target, models = load_models(a, roles=("dflash",))
    df = block_costs(target, models["dflash"], block_sizes=sizes, context=a.context, reps=a.reps)
    _cost_report(df, "block_size", [c for c in ("draft_ms", "draft_markov_ms", "verify_ms") if c in df], "part",
                 a.report, "DFlash: what a block costs (drafter call, Markov head, verification)",
                 f"ms per block after a {a.context}-token context (lower is better)", "block size (rows)")
    return 0


def cmd_zoo(a: argparse.Namespace) -> int:
    from speclab.train.zoo_build import ZooBuildConfig, build_zoo, evaluate_zoo

    if a.zoo_cmd == "build":
        build_zoo(ZooBuildConfig(shared_data=a.shared_data, target_minutes=a.target_minutes,
                                 draft_pretrain_minutes=a.draft_pretrain_minutes, draft_minutes=a.draft_minutes,
                                 draft_more_minutes=a.draft_more_minutes, eagle3_minutes=a.eagle3_minutes,
                                 dflash_minutes=a.dflash_minutes,
                                 seed=a.seed))
    elif a.zoo_cmd == "eval":
        print(evaluate_zoo(eval_tokens=a.eval_tokens))
    return 0


def cmd_train(a: argparse.Namespace) -> int:
    from speclab import zoo
    from speclab.train.lm import TrainConfig, train_lm
    from speclab.train.zoo_build import DRAFT_SHAPE, TARGET_SHAPE

    corpus = str(zoo.REPO_ROOT / "data" / "corpus")
    if a.what == "eagle3":
        from speclab.train.eagle3 import Eagle3TrainConfig, train_eagle3, val_table
        cfg = Eagle3TrainConfig(target_dir=a.teacher or str(zoo.default_target()), corpus_dir=corpus, out_dir=a.out,
                                max_minutes=a.minutes, seed=a.seed, init_from=a.init_from, lr=a.lr or 2e-3,
                                ttt_steps=a.ttt_steps)
        summary = train_eagle3(cfg, log=lambda s: print(s, file=sys.stderr, flush=True))
        print(json.dumps({k: summary[k] for k in ("params", "steps", "tokens", "minutes")}, indent=1))
        print(val_table(summary["val"]))
        return 0
    if a.what == "dflash":
        from speclab.train.dflash import DFlashTrainConfig, train_dflash, val_table
        cfg = DFlashTrainConfig(target_dir=a.teacher or str(zoo.default_target()), corpus_dir=corpus, out_dir=a.out,
                                max_minutes=a.minutes, seed=a.seed, init_from=a.init_from, lr=a.lr or 1.5e-3,
                                block_size=a.block_size, markov_rank=a.markov_rank, num_layers=a.layers)
        summary = train_dflash(cfg, log=lambda s: print(s, file=sys.stderr, flush=True))
        print(json.dumps({k: summary[k] for k in ("params", "steps", "tokens", "minutes")}, indent=1))
        print(val_table(summary["val"]))
        return 0
    if a.what == "target":
        cfg = TrainConfig(corpus_dir=corpus, tokenizer_dir=str(zoo.tokenizer_dir()), out_dir=a.out, shape=TARGET_SHAPE,
                          lr=a.lr or 1.5e-3, max_minutes=a.minutes, seed=a.seed, init_from=a.init_from)
    else:
        cfg = TrainConfig(corpus_dir=corpus, tokenizer_dir=str(zoo.tokenizer_dir()), out_dir=a.out, shape=DRAFT_SHAPE,
                          teacher=a.teacher or str(zoo.default_target()), lr=a.lr or 3e-3, seq_len=256, batch_size=16,
                          max_minutes=a.minutes, seed=a.seed, init_from=a.init_from)
    summary = train_lm(cfg)
    print(json.dumps({k: summary[k] for k in ("params", "steps", "tokens", "minutes", "val")}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["app"]:  # the Gradio app lives in app/ (thin over the package): hand it the rest
        from speclab.zoo import REPO_ROOT
        sys.path.insert(0, str(REPO_ROOT))
        from app.app import main as app_main
        try:
            app_main(argv[1:])
        except SpeclabError as e:
            print(f"speclab: error: {e}", file=sys.stderr)
            return 2
        return 0
    ap = argparse.ArgumentParser(prog="speclab", description="speculative decoding laboratory")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("app", help="the Gradio app (side-by-side decoding, trees, trace explorer); --help for options")

    g = sub.add_parser("generate", help="decode prompts with a method; trace to DuckDB")
    add_model_args(g)
    g.add_argument("--prompt", help="prompt text")
    g.add_argument("--prompts", help="file of prompts (.jsonl with prompt/turns/question/text, or one per line)")
    g.add_argument("--method", default="ar", help="ar | sps | pld | eagle3 | dflash | ... (see speclab.methods); a spec like "
                   "eagle3:tree_topk=1 fixes parameters")
    g.add_argument("--k", type=int, default=None, help="draft length / depth (method default if omitted)")
    g.add_argument("--tree-topk", type=int, default=None, help="sps, eagle3, dflash: children per expanded node (1 = "
                   "chain)")
    g.add_argument("--depth", type=int, default=None, help="eagle3: draft tree depth")
    g.add_argument("--total-tokens", type=int, default=None, help="eagle3, dflash: draft nodes kept from the expanded "
                   "tree")
    g.add_argument("--block-size", type=int, default=None, help="dflash: block rows (the root + block_size - 1 masks)")
    g.add_argument("--markov", type=int, default=None, help="dflash: 1 = use DSpark's Markov head when the drafter has "
                   "one, 0 = the plain parallel readout")
    g.add_argument("--stop-prob", type=float, default=None,
                   help="sps: end a chain after a draft token below this probability (0 = always k tokens)")
    g.add_argument("--deferred", action=argparse.BooleanOptionalAction, default=True,
                   help="the bonus token leads the next verification batch (default on)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--db", default=DEFAULT_DB, help=f"DuckDB trace file (default {DEFAULT_DB}; 'none' to skip)")
    g.add_argument("--json", action="store_true", help="print one JSON line per prompt (summary and text) and nothing else")
    g.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True, help="print text as it is decoded")
    g.set_defaults(fn=cmd_generate)

    f = sub.add_parser("forward-costs", help="ms per model call: speclab's lean forward vs the transformers forward")
    add_model_args(f)
    f.add_argument("--n", default="1,5,9", help="tokens per call (comma-separated)")
    f.add_argument("--context", type=int, default=200, help="tokens already in the KV cache")
    f.add_argument("--reps", type=int, default=15, help="interleaved repetitions (20 calls each); the median is shown")
    f.add_argument("--report", default="reports/forward_costs.html")
    f.set_defaults(fn=cmd_forward_costs)

    gr = sub.add_parser("grid", help="tokens/s, tau and speedup over a grid of a method's parameters (CPU defaults)")
    gr.add_argument("--method", default="eagle3")
    gr.add_argument("--grid", default=None, help="param=v1,v2,...;param=... (every combination is decoded; default: "
                    "the method's own grid)")
    gr.add_argument("--extra", action="append", help="one more point as JSON (repeatable), e.g. "
                    "'{\"depth\": 8, \"tree_topk\": 10, \"total_tokens\": 60}'; default: the method's GPU preset")
    gr.add_argument("--x", default=None, help="parameter on the plot's x axis (default: the grid's last)")
    gr.add_argument("--suite", default="zoo")
    gr.add_argument("--limit", type=int, default=2, help="prompts per category")
    gr.add_argument("--max-new-tokens", type=int, default=128)
    gr.add_argument("--report", default="reports/grid.html")
    add_model_args(gr)
    gr.set_defaults(fn=cmd_grid)

    cc = sub.add_parser("catchup-costs", help="ms per EAGLE-3 catch-up: KV-only prefill vs a full backlog forward")
    cc.add_argument("--backlog", default="1,2,4,8,16,32,64", help="backlog lengths (comma-separated)")
    cc.add_argument("--context", type=int, default=200, help="tokens already in the drafter's cache")
    cc.add_argument("--reps", type=int, default=15, help="interleaved repetitions (20 calls each); the median is shown")
    cc.add_argument("--report", default="reports/catchup_costs.html")
    add_model_args(cc)
    cc.set_defaults(fn=cmd_catchup_costs)

    bc = sub.add_parser("block-costs", help="ms per DFlash block: drafter call, Markov head, verification, by block "
                        "size")
    add_model_args(bc)
    bc.add_argument("--block-size", default="2,3,4,6,8,12,16", help="block sizes (comma-separated)")
    bc.add_argument("--context", type=int, default=200, help="tokens already in the caches")
    bc.add_argument("--reps", type=int, default=15, help="interleaved repetitions; the median is shown")
    bc.add_argument("--report", default="reports/block_costs.html")
    bc.set_defaults(fn=cmd_block_costs)

    s = sub.add_parser("stats", help="metrics (tau, acceptance, tokens/s, ...) pooled per method / category")
    s.add_argument("--db", default=DEFAULT_DB)
    s.add_argument("--by", default="method", help="comma-separated: method, category, prompt_id, bench_id")
    s.add_argument("--last", type=int, default=None, help="only the last N runs")
    s.add_argument("--markdown", action="store_true")
    s.set_defaults(fn=cmd_stats)

    b = sub.add_parser("bench", help="benchmark methods on a prompt suite; markdown + HTML report, rows in DuckDB")
    b.add_argument("--methods", default="ar,sps,pld", help="comma-separated method specs (ar is required); a spec "
                   "fixes parameters with ':' and '+': eagle3:tree_topk=1+depth=4")
    b.add_argument("--suite", default="zoo", help="zoo | code | math | stories | literature | spec_bench | mt_bench | "
                   "translation | summarization | qa | math_reasoning | rag | demo")
    b.add_argument("--limit", type=int, default=8, help="prompts per category")
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--tree-topk", type=int, default=1, help="sps: children per level (eagle3 takes its own from its spec)")
    b.add_argument("--stop-prob", type=float, default=0.0,
                   help="sps: end a chain after a draft token below this probability; hf_assisted gets the same "
                        "threshold (its own default is 0.4)")
    b.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True,
                   help="also time Hugging Face assisted generation and prompt lookup")
    b.add_argument("--untraced", action=argparse.BooleanOptionalAction, default=True,
                   help="also time every method untraced (peer comparison and tracing overhead)")
    b.add_argument("--quick", action="store_true", help="2 prompts per category, 64 tokens: a minute or two")
    b.add_argument("--db", default="traces/bench.duckdb")
    b.add_argument("--report", default="reports/bench.md")
    add_model_args(b)
    b.set_defaults(fn=cmd_bench)

    t = sub.add_parser("train", help="train the zoo target, distil the zoo draft, or train an EAGLE-3 or DFlash "
                       "drafter online from the frozen target (long)")
    t.add_argument("what", choices=["target", "draft", "eagle3", "dflash"])
    t.add_argument("--out", required=True, help="run directory (checkpoints in OUT/model, log in OUT/train_log.jsonl)")
    t.add_argument("--minutes", type=float, required=True, help="wall-clock budget; the LR schedule follows it")
    t.add_argument("--teacher", help="draft, eagle3, dflash: the target to learn from (default: the zoo target)")
    t.add_argument("--ttt-steps", type=int, default=3, help="eagle3: training-time-test steps (unrolled on its own "
                   "outputs)")
    t.add_argument("--block-size", type=int, default=16, help="dflash: the largest block trained (each step draws "
                   "its block size from 2..this)")
    t.add_argument("--markov-rank", type=int, default=64, help="dflash: rank of DSpark's Markov head (0: none)")
    t.add_argument("--layers", type=int, default=2, help="dflash: drafter depth")
    t.add_argument("--init-from", help="resume from this model directory (HF; EAGLE-3 or DFlash for those)")
    t.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the zoo recipe's)")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(fn=cmd_train)

    z = sub.add_parser("zoo", help="build or evaluate the zoo models in data/zoo")
    zs = z.add_subparsers(dest="zoo_cmd", required=True)
    zb = zs.add_parser("build", help="re-create corpus, tokenizer, target and draft (long: hours on CPU)")
    zb.add_argument("--shared-data", default="../shared/data")
    zb.add_argument("--target-minutes", type=float, default=100.0)
    zb.add_argument("--draft-pretrain-minutes", type=float, default=20.0)
    zb.add_argument("--draft-minutes", type=float, default=20.0, help="distillation from the target")
    zb.add_argument("--draft-more-minutes", type=float, default=45.0, help="a second distillation pass, LR 1e-3")
    zb.add_argument("--eagle3-minutes", type=float, default=87.0, help="EAGLE-3 drafter, online from the target")
    zb.add_argument("--dflash-minutes", type=float, default=95.0, help="DFlash drafter (+ Markov head), online from "
                    "the target")
    zb.add_argument("--seed", type=int, default=0)
    ze = zs.add_parser("eval", help="per-domain validation loss and bits per byte of the zoo models")
    ze.add_argument("--eval-tokens", type=int, default=65536)
    z.set_defaults(fn=cmd_zoo)

    a = ap.parse_args(argv)
    try:
        return a.fn(a)
    except SpeclabError as e:
        print(f"speclab: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("speclab: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
