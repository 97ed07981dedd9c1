"""`speclab` command line: generate | zoo | train (bench, app, sweep come with their issues)."""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from speclab.errors import SpeclabError
from speclab.models import add_model_args, check_model_args, load_models

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


def _num(kind: type = int, lo=None, hi=None, hi_open: bool = False):
    """argparse type: a number of `kind` within [lo, hi] (finite; `speclab.checks`), else argparse's one-line error
    naming the option, the value and what is allowed."""
    from speclab.checks import Bound, check_number
    bound = Bound(lo, hi, hi_open)

    def parse(text: str):
        try:
            return check_number("value", text, kind, bound)
        except SpeclabError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {bound.describe(kind)}") from None
    parse.__name__ = kind.__name__  # argparse names the type in its own messages
    return parse


_positive_int = _num(int, 1)


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors as one line, like every other error of the command line (exit code 2)."""

    def error(self, message: str):
        print(f"speclab: error: {self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


@contextlib.contextmanager
def _sigterm_interrupts():
    """Within the block SIGTERM (a scheduler, `kill`) ends a command the way Ctrl-C does: runs are marked
    interrupted, a bench too, a training run saves its weights; the caller's own handler comes back after."""
    import signal
    import threading

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _check_writable(path: str, option: str) -> None:
    """A file `path` can be written at the end of the command (nothing is created now)."""
    from speclab.files import check_writable
    try:
        check_writable(path, option)
    except ValueError as e:
        raise SpeclabError(f"{option} {path}: {e}") from e


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
    from speclab.generate import check_text
    for r in rows:  # text a tokenizer cannot take, before any model is loaded
        try:
            check_text(r["prompt"])
        except SpeclabError as e:
            raise SpeclabError(f"{p} line {r['line']}: {e}") from e
    return rows


def cmd_generate(a: argparse.Namespace) -> int:
    from speclab.checks import Bound, check_number, check_sampling
    from speclab.generate import check_generation, generate
    from speclab.methods import get_method
    from speclab.trace import TraceStore, check_trace

    check_model_args(a)
    method = get_method(a.method)
    if a.prompt is None and a.prompts is None:
        raise SpeclabError("give --prompt TEXT or --prompts FILE")
    check_sampling(a.temperature, a.top_k, a.top_p, a.seed)  # before any file or model is opened
    check_number("max_new_tokens", a.max_new_tokens, int, Bound(1))
    if a.prompt is not None:
        from speclab.generate import check_text
        check_text(a.prompt)
    prompts = [{"prompt": a.prompt, "prompt_id": None, "category": None}] if a.prompt is not None else _read_prompts(a.prompts)
    if a.db != "none":
        check_trace(a.db)  # a locked or foreign file fails fast; the file itself is made once all is checked
    target, models = load_models(a, roles=method.needs)
    params = {"k": a.k, "tree_topk": a.tree_topk, "stop_prob": a.stop_prob, "depth": a.depth,
              "total_tokens": a.total_tokens, "block_size": a.block_size, "markov": a.markov,
              "threshold": a.threshold, "eager": a.eager}
    for p in prompts:  # every prompt and parameter checked against the models before anything is decoded
        try:
            check_generation(target, p["prompt"], a.method, models, a.max_new_tokens, a.temperature, a.top_k,
                             a.top_p, a.seed, params)
        except SpeclabError as e:
            raise SpeclabError((f"{a.prompts} line {p['line']}: " if "line" in p else "") + str(e)) from e
    store = TraceStore(a.db) if a.db != "none" else None
    try:
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
    from speclab.bench.run import (
        BenchConfig,
        bench_overall,
        peer_ratios,
        run_bench,
        write_report,
    )
    from speclab.methods import get_method
    from speclab.trace import TraceStore, check_trace

    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    cfg = BenchConfig(suite=a.suite, methods=methods, limit=a.limit, max_new_tokens=a.max_new_tokens,
                      tree_topk=a.tree_topk, stop_prob=a.stop_prob, peers=a.peers, untraced=a.untraced)
    if a.quick:
        cfg.limit, cfg.max_new_tokens = min(cfg.limit or 2, 2), min(cfg.max_new_tokens, 64)
    for m in methods:
        get_method(m)
    if "ar" not in methods:  # before any file or model is opened
        raise SpeclabError("a benchmark needs 'ar' among its methods: speedups and equality are measured against it")
    from speclab.bench.suites import load_suite
    load_suite(cfg.suite, 1)  # an unknown suite, likewise
    check_trace(a.db)  # the trace file is made once the models loaded (a refused model leaves none behind)
    roles = {r for m in methods for r in get_method(m).needs} | ({"draft"} if cfg.peers else set())
    target, models = load_models(a, roles=roles)
    with TraceStore(a.db) as store:
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
    from speclab.bench.run import dtype_costs, forward_costs
    from speclab.viz import bench_bars, lines_figure, write_html_report

    ns = _positive_ints(a.n or ("1,2,4,8,16,32,64" if a.by_dtype else "1,5,9"), "--n")
    if a.by_dtype:
        from speclab.core.precision import check_dtype
        dtypes = [check_dtype(d.strip()) for d in a.dtypes.split(",") if d.strip()]
        if not dtypes or "auto" in dtypes:
            raise SpeclabError(f"--dtypes {a.dtypes!r}: name the dtypes to compare, e.g. fp32,bf16")
        check_model_args(a)

        def load(dt):
            a.dtype = dt
            target, models = load_models(a, roles=("draft", "eagle3", "dflash"))
            a.exact = True
            exact, _ = load_models(a, roles=())
            a.exact = False
            return target, exact, models
        df = dtype_costs(load, dtypes, ns, context=a.context, reps=a.reps)
        wide = df.pivot_table(index=["model", "dtype"], columns="rows", values="ms", sort=False).reset_index()
        wide.columns = [c if isinstance(c, str) else f"{c} rows" for c in wide.columns]
        table = wide.to_markdown(index=False, floatfmt=".2f")
        print(f"ms per call after a {a.context}-token cache (median), on {df.attrs['cpu']}\n\n{table}")
        df["model / dtype"] = df["model"] + " " + df["dtype"]
        Path(a.report).parent.mkdir(parents=True, exist_ok=True)
        path = write_html_report(a.report, f"Milliseconds per call by width and dtype ({df.attrs['cpu']})",
                                 [lines_figure(df, "rows", "ms", "model / dtype", f"ms per call after a {a.context}-token "
                                               "cache, by rows per call (lower is better)", "rows per call",
                                               "ms per call")], table)
        print(f"\nplot: {path}")
        return 0
    target, models = load_models(a, roles=("draft",))
    df = forward_costs({"target": target, "draft": models["draft"]}, ns=ns, context=a.context, reps=a.reps)
    if df.empty:
        raise SpeclabError("neither model runs on the lean forward (see speclab.core.lean.supports): nothing to compare")
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
    from speclab.bench.run import check_grid_keys, param_grid, parse_grid
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
    for key, values in grid.items():  # numbers now; their ranges (which depend on the models) once loaded
        for v in values:
            try:
                float(v)
            except ValueError:
                raise SpeclabError(f"--grid {key}={v!r}: the values of {key} are numbers") from None
    from speclab.bench.suites import load_suite
    load_suite(a.suite, 1)  # an unknown suite, before any model is loaded
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
    from speclab.bench.run import catchup_costs

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
    from speclab.bench.run import block_costs

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
    from speclab.core.target import check_model_dir, quiet_loads
    from speclab.train.lm import TrainConfig, train_lm
    from speclab.train.zoo_build import DRAFT_SHAPE, TARGET_SHAPE
    quiet_loads()
    corpus = a.corpus or str(zoo.REPO_ROOT / "data" / "corpus")
    from speclab.train.corpus import DOMAINS
    missing = [f"{d}.{s}.txt" for d in DOMAINS for s in ("train", "val") if not (Path(corpus) / f"{d}.{s}.txt").is_file()]
    if a.what != "router" and missing:
        raise SpeclabError(f"--corpus {corpus} lacks {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} "
                           "(a corpus is a folder of <domain>.train.txt / <domain>.val.txt for "
                           f"{', '.join(DOMAINS)})")
    from speclab.files import check_writable
    try:  # the run directory can be made and written, before any model or data is loaded
        if Path(a.out).exists() and not Path(a.out).is_dir():
            raise ValueError("it is a file, not a folder")
        check_writable(Path(a.out) / "model", "the run")
    except ValueError as e:
        raise SpeclabError(f"--out {a.out}: {e}") from e
    if a.teacher:
        check_model_dir(a.teacher)
    if a.init_from:
        if a.what in ("eagle3", "dflash"):
            from speclab.drafters.checkpoint import check_dir
            check_dir(a.init_from, {"eagle3": "EAGLE-3 drafter", "dflash": "DFlash drafter"}[a.what])
        else:
            check_model_dir(a.init_from)
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
    if a.what == "router":
        from speclab.drafters.dflash import load_dflash
        from speclab.drafters.eagle3 import load_eagle3
        from speclab.core.target import Target
        from speclab.train.router import RouterTrainConfig, curve_table, train_router
        cfg = RouterTrainConfig(corpus_dir=corpus, out_dir=a.out, sequences=a.sequences, seed=a.seed,
                                lr=a.lr or 1e-3, new_tokens=a.new_tokens, cost_prompts=a.cost_prompts,
                                epochs=a.epochs)
        target = Target.load(a.teacher or zoo.default_target(), device="cpu", dtype="fp32")
        models = {"eagle3": load_eagle3(a.eagle or zoo.default_eagle3(), target),
                  "dflash": load_dflash(a.dflash or zoo.default_dflash(), target)}
        summary = train_router(cfg, target, models, log=lambda s: print(s, file=sys.stderr, flush=True))
        print(json.dumps({k: summary[k] for k in ("collect_minutes", "heldout", "al_profiled")}, indent=1))
        print(f"hardware-aware threshold: {summary['hardware_threshold']['threshold']:.3f} "
              f"({json.dumps(summary['hardware_threshold'])})")
        print(curve_table(summary["curve"]))
        return 0
    if a.minutes is None:
        raise SpeclabError(f"train {a.what} needs --minutes (its wall-clock budget)")
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


def _bench_store(a: argparse.Namespace):
    """The bench's trace (opened for writing: profiles and live runs go in) and the bench id (default: latest)."""
    from speclab.routing.evaluate import bench_info, latest_bench
    from speclab.trace import TraceStore

    if not Path(a.db).exists():
        raise SpeclabError(f"no trace database at {a.db}: run `speclab bench` first (with ar, eagle3 and dflash)")
    store = TraceStore(a.db)
    bench_id = a.bench or latest_bench(store)
    bench_info(store, bench_id)
    return store, bench_id


def _routing_setup(a: argparse.Namespace, store, bench_id: str, need_mlp: bool):
    """Profiles (made when missing), the cost model fitted to the bench and the neural router when needed."""
    from speclab.routing.replay import fit_costs
    from speclab.routing.evaluate import get_profiles

    loaded = {}

    def load():
        if not loaded:
            loaded["m"] = load_models(a, roles=("eagle3", "dflash", "router") if need_mlp else ("eagle3", "dflash"))
        return loaded["m"]

    from speclab.routing.evaluate import check_profilable

    cost = fit_costs(store, bench_id)  # before any model loads: a bench without the drafters' rounds fails fast
    check_profilable(store, bench_id)
    profiles = get_profiles(store, bench_id, load, log=lambda s: print(s, file=sys.stderr))
    mlp = load()[1]["router"] if need_mlp else None
    return profiles, cost, mlp, load


def cmd_profile(a: argparse.Namespace) -> int:
    from speclab.routing.evaluate import check_profilable, profile_bench

    store, bench_id = _bench_store(a)
    with store:
        check_profilable(store, bench_id)
        target, models = load_models(a, roles=("eagle3", "dflash"))
        profs = profile_bench(store, bench_id, target, models, log=lambda s: print(s, file=sys.stderr))
        import pandas as pd
        df = pd.DataFrame([{"prompt_id": p.prompt_id, "category": p.category, "tokens": p.n,
                            "eagle3_accepted": p.accepted[0].mean(), "dflash_accepted": p.accepted[1].mean(),
                            "eagle3_better": (p.accepted[0] > p.accepted[1]).mean(),
                            "dflash_better": (p.accepted[1] > p.accepted[0]).mean()} for p in profs])
        print(df.groupby("category").mean(numeric_only=True).to_markdown(floatfmt=".3f"))
    print(f"\nprofiles of bench {bench_id}: tables profiles / profile_positions in {a.db}")
    return 0


def cmd_sweep(a: argparse.Namespace) -> int:
    import pandas as pd

    from speclab.routing.evaluate import live_table, parse_thresholds, run_live, sweep
    from speclab.viz import sweep_figure, write_html_report

    grid = parse_thresholds(a.grid)
    live_pts = parse_thresholds(a.live) if a.live else []
    if a.router not in ("entropy", "neural"):
        raise SpeclabError(f"--router must be entropy or neural (got {a.router!r})")
    store, bench_id = _bench_store(a)
    with store:
        profiles, cost, mlp, load = _routing_setup(a, store, bench_id, a.router == "neural")
        import time
        t0 = time.perf_counter()
        sw = sweep(profiles, cost, a.router, grid, mlp)
        replay_s = time.perf_counter() - t0
        method = f"whiflash-{a.router}"
        live = pd.DataFrame()
        if live_pts:
            specs = [f"{method}:threshold={t:g}" for t in live_pts]
            target, models = load()
            run_live(store, bench_id, target, models, specs, log=lambda s: print(s, file=sys.stderr))
            lt = live_table(store, bench_id)
            lt = lt[lt.method.isin(specs)].copy()
            lt["threshold"] = lt.method.str.split("=").str[-1].astype(float)
            pts = sweep(profiles, cost, a.router, live_pts, mlp)
            live = lt.merge(pts[["category", "threshold", "al", "tokens_per_s"]], on=["category", "threshold"],
                            suffixes=("", "_replay"))
            live["model_error"] = live.tokens_per_s_replay / live.tokens_per_s - 1
    wide_tps = sw.pivot_table(index="threshold", columns="category", values="tokens_per_s").reset_index()
    wide_al = sw.pivot_table(index="threshold", columns="category", values="al").reset_index()
    n_prompts = len(profiles)
    text = [f"# {method} threshold sweep on bench `{bench_id}`", "",
            f"Replayed from profiles: {len(grid)} thresholds x {n_prompts} prompts in {replay_s:.2f} s. Tokens/s from "
            f"the cost model fitted to the bench's live rounds ({cost.rounds_fitted} rounds, {cost.runs_fitted} runs).",
            "", "## Modeled tokens/s per category", "", wide_tps.to_markdown(index=False, floatfmt=".2f"), "",
            "## AL (tokens per round) per category", "", wide_al.to_markdown(index=False, floatfmt=".3f")]
    if len(live):
        cols = ["threshold", "category", "al", "al_replay", "tokens_per_s", "tokens_per_s_replay", "model_error"]
        text += ["", "## Live runs at chosen thresholds (same bench) vs replay", "",
                 live[cols].sort_values(["threshold", "category"]).to_markdown(index=False, floatfmt=".3f")]
    md = "\n".join(text)
    print(md)
    Path(a.report).parent.mkdir(parents=True, exist_ok=True)
    figs = [sweep_figure(sw, live if len(live) else None, "tokens_per_s",
                         f"{method}: tokens/s by threshold (lines: replay + cost model; diamonds: live)"),
            sweep_figure(sw, live if len(live) else None, "al", f"{method}: AL by threshold")]
    print(f"\nplot: {write_html_report(a.report, f'{method} threshold sweep', figs, md)}")
    return 0


def cmd_calibrate(a: argparse.Namespace) -> int:
    from speclab.routing.calibration import save_thresholds
    from speclab.routing.routers import calibration_path
    from speclab.routing.evaluate import best_thresholds, parse_thresholds, sweep
    from speclab.viz import sweep_figure, write_html_report

    routers = [r.strip() for r in a.router.split(",") if r.strip()]
    bad = [r for r in routers if r not in ("entropy", "neural")]
    if bad or not routers:
        raise SpeclabError(f"--router must be entropy, neural or both, comma-separated (got {a.router!r})")
    grids = {"entropy": parse_thresholds(a.entropy_grid), "neural": parse_thresholds(a.neural_grid)}
    out = Path(a.out) if a.out else calibration_path()
    store, bench_id = _bench_store(a)
    with store:
        profiles, cost, mlp, load = _routing_setup(a, store, bench_id, "neural" in routers)
        target = load()[0]
        from speclab.routing.evaluate import single_drafters
        ref = single_drafters(profiles, cost)
        figs, text = [], ["## For reference: each drafter alone (replayed, modeled tokens/s)", "",
                          ref[["policy", "category", "al", "tokens_per_s"]].to_markdown(index=False, floatfmt=".3f"), ""]
        best = {}
        for r in routers:
            sw = sweep(profiles, cost, r, grids[r], mlp)
            best[r] = best_thresholds(sw)
            top = sw.loc[sw.groupby("category").tokens_per_s.idxmax()]
            text += [f"## {r}: best threshold per category (modeled tokens/s)", "",
                     top[["category", "threshold", "al", "tokens_per_s", "switches", "eagle3_share"]]
                     .to_markdown(index=False, floatfmt=".3f"), ""]
            figs.append(sweep_figure(sw, None, "tokens_per_s", f"whiflash-{r}: modeled tokens/s by threshold"))
        info = {"bench": bench_id, "db": str(a.db), "prompts": len(profiles),
                "grids": {r: getattr(a, f"{r}_grid") for r in routers},
                "cost_model": cost.__dict__, "command": "speclab calibrate " + " ".join(sys.argv[2:])}
        for r in routers:
            save_thresholds(r, best[r], target.fingerprint, info, out)
    md = "\n".join(text)
    print(md)
    print(f"wrote {out}")
    Path(a.report).parent.mkdir(parents=True, exist_ok=True)
    print(f"plot: {write_html_report(a.report, 'WhiFlash calibration', figs, md)}")
    return 0


def cmd_routing(a: argparse.Namespace) -> int:
    import pandas as pd

    from speclab import viz
    from speclab.routing.replay import model_error
    from speclab.routing.evaluate import (
        lazy_vs_eager,
        modeled_table,
        oracles,
        replayed_runs,
        routing_table,
        switch_backlog,
        switch_table,
        wide,
    )

    store, bench_id = _bench_store(a)
    with store:
        neural = bool(len(store.query("SELECT 1 FROM runs WHERE bench_id = ? AND router = 'neural' LIMIT 1", [bench_id])))
        profiles, cost, mlp, _ = _routing_setup(a, store, bench_id, neural)
        orc = oracles(profiles, cost, switch_backlog(store, bench_id))
        table = routing_table(store, bench_id, orc)
        replayed = replayed_runs(store, bench_id, profiles, cost, mlp)
        agree = replayed[replayed.routed]
        modeled = modeled_table(replayed, orc).pivot_table(index="method", columns="category",
                                                            values="modeled_tokens_per_s", sort=False)
        err = model_error(cost, store, bench_id)
        sw = switch_table(store, bench_id)
        le = lazy_vs_eager(store, bench_id)
        pid = a.prompt_id or profiles[0].prompt_id
        prof = store.query("SELECT pos, drafter, accepted FROM profiles WHERE bench_id = ? AND prompt_id = ? "
                           "ORDER BY drafter, pos", [bench_id, pid])
        routed = store.query("SELECT run_id, method FROM runs WHERE bench_id = ? AND prompt_id = ? AND router IN "
                             "('neural', 'entropy') AND status = 'done' ORDER BY router DESC, run_id", [bench_id, pid])
        rr = None
        if len(routed):
            from speclab.routing.evaluate import router_rounds
            rr = router_rounds(store, int(routed.run_id.iloc[0]), next(p for p in profiles if p.prompt_id == pid))
            rr_title = f"{routed.method.iloc[0]} on prompt {pid}: router signal, choices and accept lengths"
    fmt = dict(index=False, floatfmt=".2f")
    tps = table.pivot_table(index="method", columns="category", values="tokens_per_s", sort=False)
    md = [f"# WhiFlash on bench `{bench_id}`", "",
          "AL = tokens per round; speedup = tokens/s over AR's in the same bench. Live rows: the bench's traced runs. "
          "Oracle ALs: replayed from profiles; Oracle-Task/Prompt speedups: the bench's live eagle3/dflash runs picked "
          "in hindsight; oracle-token-time: modeled (cost model), not measured.", "",
          "## AL and speedup per category", "", wide(table).to_markdown(**fmt), "",
          "## Tokens/s per category", "", tps.reset_index().to_markdown(**fmt), "",
          "## Modeled tokens/s (the same runs replayed under one cost model: no run-to-run timing noise)", "",
          "Live tokens/s of one method and category vary by about 10% from run to run on this machine even for "
          "identical rounds; replayed through one cost model every method pays the same per-phase costs.", "",
          modeled.reset_index().to_markdown(**fmt), "",
          "## Live vs replay (routed runs)", "",
          (f"{int(agree.identical.sum())} of {len(agree)} routed runs replay identically (every round's drafter, "
           f"accept length and committed tokens); rounds agreeing overall: {agree.rounds_agreeing.mean():.4f}"
           if len(agree) else "no routed runs in this bench"), "",
          "## Cost model", "", cost.table().to_markdown(index=False, floatfmt=".3f"), "",
          f"prefill ms = {cost.prefill0:.2f} + {cost.prefill1:.3f} x prompt tokens; fitted to {cost.rounds_fitted} "
          f"rounds of {cost.runs_fitted} runs", "", "Modeled vs measured decode time of the live runs:", "",
          err.to_markdown(index=False, floatfmt=".3f"), ""]
    if len(sw):
        md += ["## Switch cost (live: rounds whose drafter differs from the previous round's)", "",
               sw.to_markdown(index=False, floatfmt=".3f"), ""]
    if len(le):
        md += ["## Lazy vs eager catch-up", "", le.to_markdown(index=False, floatfmt=".3f"), ""]
    text = "\n".join(md)
    print(text)
    figs = [viz.bench_bars(table.rename(columns={"method": "method"}), "al", "AL (tokens per round) per category"),
            viz.bench_bars(table[table.source != "profiles"], "speedup", "Speedup over AR per category"),
            viz.volatility_figure(prof, f"Intra-sequence volatility: prompt {pid} (from its profile)")]
    if rr is not None:
        figs.append(viz.router_figure(rr, rr_title))
    Path(a.report).parent.mkdir(parents=True, exist_ok=True)
    print(f"\nplot: {viz.write_html_report(a.report, f'WhiFlash on bench {bench_id}', figs, text)}")
    return 0


def cmd_switch_costs(a: argparse.Namespace) -> int:
    from speclab.bench.run import switch_costs
    from speclab.viz import lines_figure, write_html_report

    backlogs = _positive_ints(a.backlog, "--backlog")
    contexts = _positive_ints(a.context, "--context")
    target, models = load_models(a, roles=("eagle3", "dflash"))
    df = switch_costs(target, models, contexts=contexts, backlogs=backlogs, reps=a.reps)
    wide_t = df.pivot_table(index="context", columns="backlog", values="share_of_round").reset_index()
    table = df.to_markdown(index=False, floatfmt=".3f")
    text = ("EAGLE-3 catch-up (KV-only prefill) of a backlog as a share of a WhiFlash round's latency (EAGLE-3 "
            "drafting + verification) at that context\n\n" + wide_t.to_markdown(index=False, floatfmt=".3f")
            + "\n\n" + table)
    print(text)
    Path(a.report).parent.mkdir(parents=True, exist_ok=True)
    fig = lines_figure(df.assign(context=df.context.astype(str) + " tokens"), "backlog", "share_of_round", "context",
                       "Switch cost as a share of round latency", x_title="backlog tokens", y_title="share of round")
    print(f"\nplot: {write_html_report(a.report, 'WhiFlash switch cost', [fig], text)}")
    return 0


def cmd_kernels_bench(a: argparse.Namespace) -> int:
    import pandas as pd
    import torch

    from kernels import bench
    from speclab.progress import Progress
    from speclab.viz import bench_bars, write_html_report

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SpeclabError("--device cuda: no CUDA device here")
    if device != "cuda":
        print(f"speclab kernels-bench: no GPU ({device}): Triton runs here only in interpreter mode (correctness "
              "tests, not speed), so only the torch twins are timed")
    prog = Progress(sum(len(s) for s in bench.SIZES.values()), "kernels-bench")
    df = pd.DataFrame(bench.run(device, a.reps, on_step=lambda i, n, op: prog.update(i, op=op)))
    print(df.to_markdown(index=False))
    long = df.melt(id_vars=["op", "size"], value_vars=["torch_us", "triton_us"], var_name="method", value_name="us")
    long = long[long.us.notna()].assign(category=lambda d: d.op + " " + d["size"])
    Path(a.report).parent.mkdir(parents=True, exist_ok=True)
    fig = bench_bars(long, "us", f"Median microseconds per call on {device} (lower is better)")
    print(f"\nplot: {write_html_report(a.report, 'speclab kernels-bench', [fig], df.to_markdown(index=False))}")
    return 0


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["app"]:  # the Gradio app is its own program (app/ imports speclab, never the reverse)
        import os

        from speclab.zoo import REPO_ROOT
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, "-m", "app", *argv[1:]], env)
    ap = _Parser(prog="speclab", description="speculative decoding laboratory")
    sub = ap.add_subparsers(dest="cmd", required=True)
    kb = sub.add_parser("kernels-bench", help="the small hot ops: torch twin vs Triton kernel per op and size "
                                               "(Triton timed only on CUDA)")
    kb.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when present")
    kb.add_argument("--reps", type=_positive_int, default=50)
    kb.add_argument("--report", default="reports/kernels.html")
    kb.set_defaults(fn=cmd_kernels_bench)
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
    g.add_argument("--threshold", type=float, default=None, help="whiflash-*: the routing threshold (entropy: nats; "
                   "neural: predicted AL_eagle3 - AL_dflash); default: calibrated (data/zoo/calibration.json)")
    g.add_argument("--eager", type=int, default=None, help="whiflash-*: 1 = catch both drafters up every round (the "
                   "naive scheme); 0 = lazily, at a switch (default)")
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
    f.add_argument("--n", default=None, help="tokens per call (comma-separated; default 1,5,9, or 1,2,4,...,64 with "
                   "--by-dtype)")
    f.add_argument("--by-dtype", action="store_true", help="ms per call by width and dtype for the target (fast and "
                   "exact) and every drafter, instead of lean vs transformers")
    f.add_argument("--dtypes", default="fp32,bf16", help="with --by-dtype: the dtypes to compare")
    f.add_argument("--context", type=_positive_int, default=200, help="tokens already in the KV cache")
    f.add_argument("--reps", type=_positive_int, default=15, help="interleaved repetitions (20 calls each); the median is shown")
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
    gr.add_argument("--limit", type=_positive_int, default=2, help="prompts per category")
    gr.add_argument("--max-new-tokens", type=_positive_int, default=128)
    gr.add_argument("--report", default="reports/grid.html")
    add_model_args(gr)
    gr.set_defaults(fn=cmd_grid)

    cc = sub.add_parser("catchup-costs", help="ms per EAGLE-3 catch-up: KV-only prefill vs a full backlog forward")
    cc.add_argument("--backlog", default="1,2,4,8,16,32,64", help="backlog lengths (comma-separated)")
    cc.add_argument("--context", type=_positive_int, default=200, help="tokens already in the drafter's cache")
    cc.add_argument("--reps", type=_positive_int, default=15, help="interleaved repetitions (20 calls each); the median is shown")
    cc.add_argument("--report", default="reports/catchup_costs.html")
    add_model_args(cc)
    cc.set_defaults(fn=cmd_catchup_costs)

    def bench_args(p, report: str | None = None) -> None:
        """The options of the commands that read a bench (profile, sweep, calibrate, routing)."""
        p.add_argument("--bench", help="bench id (default: the latest finished bench in --db)")
        p.add_argument("--db", default="traces/bench.duckdb")
        if report:
            p.add_argument("--report", default=report)
        add_model_args(p)

    pr = sub.add_parser("profile", help="counterfactual acceptance profiles of EAGLE-3 and DFlash at every position of "
                        "a bench's AR outputs (greedy), for replay, oracles, sweeps and calibration")
    bench_args(pr)
    pr.set_defaults(fn=cmd_profile)

    sw = sub.add_parser("sweep", help="a WhiFlash router's threshold sweep on a bench: by replay of its profiles "
                        "(instant) and live at chosen thresholds")
    sw.add_argument("--router", required=True, help="entropy | neural")
    sw.add_argument("--grid", default="0:4:0.1", help="thresholds: start:stop:step or a comma-separated list")
    sw.add_argument("--live", default="", help="thresholds to also run live on the bench's prompts (into the bench)")
    bench_args(sw, "reports/sweep.html")
    sw.set_defaults(fn=cmd_sweep)

    ca = sub.add_parser("calibrate", help="the best threshold per category (and a global one) of the WhiFlash "
                        "routers by replay on a bench, written to data/zoo/calibration.json")
    ca.add_argument("--router", default="entropy,neural", help="entropy, neural or both (comma-separated)")
    ca.add_argument("--entropy-grid", default="0:4:0.05")
    ca.add_argument("--neural-grid", default="-2:3:0.05")
    ca.add_argument("--out", help="calibration file (default: data/zoo/calibration.json)")
    bench_args(ca, "reports/calibration.html")
    ca.set_defaults(fn=cmd_calibrate)

    ro = sub.add_parser("routing", help="WhiFlash's Table 1 on a bench (EAGLE-3, DFlash, oracles, routers: AL and "
                        "speedup per category), live vs replay, cost-model error, switch cost, lazy vs eager")
    ro.add_argument("--prompt-id", help="the sequence of the volatility figure (default: the first profiled)")
    bench_args(ro, "reports/routing.html")
    ro.set_defaults(fn=cmd_routing)

    sc = sub.add_parser("switch-costs", help="EAGLE-3 catch-up at a switch as a share of round latency, by context "
                        "and backlog (WhiFlash Table 4)")
    sc.add_argument("--context", default="64,128,256,512", help="tokens already in the caches (comma-separated)")
    sc.add_argument("--backlog", default="1,8,16,32,64,128", help="backlog lengths (comma-separated)")
    sc.add_argument("--reps", type=_positive_int, default=7, help="interleaved repetitions; the median is shown")
    sc.add_argument("--report", default="reports/switch_costs.html")
    add_model_args(sc)
    sc.set_defaults(fn=cmd_switch_costs)

    bc = sub.add_parser("block-costs", help="ms per DFlash block: drafter call, Markov head, verification, by block "
                        "size")
    add_model_args(bc)
    bc.add_argument("--block-size", default="2,3,4,6,8,12,16", help="block sizes (comma-separated)")
    bc.add_argument("--context", type=_positive_int, default=200, help="tokens already in the caches")
    bc.add_argument("--reps", type=_positive_int, default=15, help="interleaved repetitions; the median is shown")
    bc.add_argument("--report", default="reports/block_costs.html")
    bc.set_defaults(fn=cmd_block_costs)

    s = sub.add_parser("stats", help="metrics (tau, acceptance, tokens/s, ...) pooled per method / category")
    s.add_argument("--db", default=DEFAULT_DB)
    s.add_argument("--by", default="method", help="comma-separated: method, category, prompt_id, bench_id")
    s.add_argument("--last", type=_positive_int, default=None, help="only the last N runs")
    s.add_argument("--markdown", action="store_true")
    s.set_defaults(fn=cmd_stats)

    b = sub.add_parser("bench", help="benchmark methods on a prompt suite; markdown + HTML report, rows in DuckDB")
    b.add_argument("--methods", default="ar,sps,pld", help="comma-separated method specs (ar is required); a spec "
                   "fixes parameters with ':' and '+': eagle3:tree_topk=1+depth=4")
    b.add_argument("--suite", default="zoo", help="zoo | code | math | stories | literature | spec_bench | mt_bench | "
                   "translation | summarization | qa | math_reasoning | rag | demo")
    b.add_argument("--limit", type=_positive_int, default=8, help="prompts per category")
    b.add_argument("--max-new-tokens", type=_positive_int, default=128)
    b.add_argument("--tree-topk", type=_positive_int, default=1, help="sps: children per level (eagle3 takes its own from its spec)")
    b.add_argument("--stop-prob", type=_num(float, 0.0, 1.0, hi_open=True), default=0.0,
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

    t = sub.add_parser("train", help="train the zoo target, distil the zoo draft, train an EAGLE-3 or DFlash "
                       "drafter online from the frozen target, or WhiFlash's neural router from profiles (long)")
    t.add_argument("what", choices=["target", "draft", "eagle3", "dflash", "router"])
    t.add_argument("--out", required=True, help="run directory (checkpoints in OUT/model, log in OUT/train_log.jsonl)")
    t.add_argument("--minutes", type=_num(float, 0.01), help="wall-clock budget; the LR schedule follows it (not for router)")
    t.add_argument("--sequences", type=_positive_int, default=240, help="router: corpus prompts profiled (their "
                   "greedy continuations give the (h_t, Delta AL) pairs; a fifth held out)")
    t.add_argument("--new-tokens", type=_positive_int, default=96, help="router: tokens generated per prompt")
    t.add_argument("--epochs", type=_positive_int, default=12, help="router: passes over the pairs (the profiles "
                   "are collected once and reused from OUT/pairs.pt when the run is repeated)")
    t.add_argument("--cost-prompts", type=_positive_int, default=6, help="router: prompts decoded live to fit the "
                   "cost model of the hardware-aware threshold")
    t.add_argument("--eagle", help="router: the EAGLE-3 drafter (default: the zoo's)")
    t.add_argument("--dflash", help="router: the DFlash drafter (default: the zoo's)")
    t.add_argument("--corpus", help="folder of <domain>.train.txt / .val.txt (default: data/corpus)")
    t.add_argument("--teacher", help="draft, eagle3, dflash: the target to learn from (default: the zoo target)")
    t.add_argument("--ttt-steps", type=_positive_int, default=3, help="eagle3: training-time-test steps (unrolled on its own "
                   "outputs)")
    t.add_argument("--block-size", type=_num(int, 2), default=16, help="dflash: the largest block trained (each step draws "
                   "its block size from 2..this)")
    t.add_argument("--markov-rank", type=_num(int, 0), default=64, help="dflash: rank of DSpark's Markov head (0: none)")
    t.add_argument("--layers", type=_positive_int, default=2, help="dflash: drafter depth")
    t.add_argument("--init-from", help="resume from this model directory (HF; EAGLE-3 or DFlash for those)")
    t.add_argument("--lr", type=_num(float, 1e-8, 1.0), default=None, help="peak learning rate (default: the zoo recipe's)")
    t.add_argument("--seed", type=_num(int, 0, 2**63 - 1), default=0)
    t.set_defaults(fn=cmd_train)

    z = sub.add_parser("zoo", help="build or evaluate the zoo models in data/zoo")
    zs = z.add_subparsers(dest="zoo_cmd", required=True)
    zb = zs.add_parser("build", help="re-create corpus, tokenizer, target and draft (long: hours on CPU)")
    zb.add_argument("--shared-data", default="../shared/data")
    zb.add_argument("--target-minutes", type=_num(float, 0.01), default=100.0)
    zb.add_argument("--draft-pretrain-minutes", type=_num(float, 0.01), default=20.0)
    zb.add_argument("--draft-minutes", type=_num(float, 0.01), default=20.0, help="distillation from the target")
    zb.add_argument("--draft-more-minutes", type=_num(float, 0.01), default=45.0, help="a second distillation pass, LR 1e-3")
    zb.add_argument("--eagle3-minutes", type=_num(float, 0.01), default=87.0, help="EAGLE-3 drafter, online from the target")
    zb.add_argument("--dflash-minutes", type=_num(float, 0.01), default=95.0, help="DFlash drafter (+ Markov head), online from "
                    "the target")
    zb.add_argument("--seed", type=_num(int, 0, 2**63 - 1), default=0)
    ze = zs.add_parser("eval", help="per-domain validation loss and bits per byte of the zoo models")
    ze.add_argument("--eval-tokens", type=_positive_int, default=65536)
    z.set_defaults(fn=cmd_zoo)

    a = ap.parse_args(argv)
    try:
        with _sigterm_interrupts():
            return _run(a)
    except SpeclabError as e:
        print(f"speclab: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("speclab: interrupted", file=sys.stderr)
        return 130


def _run(a: argparse.Namespace) -> int:
    """The command's checks that need no model, then the command."""
    if hasattr(a, "logits"):  # a model-loading command: its model options first, before any file is touched
        check_model_args(a)
    if getattr(a, "report", None):  # written at the end: refused now if it could not be, not after the work
        _check_writable(a.report, "--report")
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
