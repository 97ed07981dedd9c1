"""Decoding commands: `speclab generate` (decode prompts with a method, traced) and `speclab stats` (the metrics
of the trace's runs)."""
from __future__ import annotations

import argparse
import json
import sys

from speclab.cli.common import DEFAULT_DB, _positive_int, _read_prompts, write_report
from speclab.errors import SpeclabError
from speclab.models import ModelPaths, add_model_args, check_model_args, load_models
from speclab.viz import Report


def _add_method_params(p: argparse.ArgumentParser) -> None:
    """One option per parameter of any registered method (speclab.methods.all_params), named and typed by its
    declaration; None = the method's default. The values are checked, as text, against the method's bounds
    from the models (speclab.methods.method_params), before anything is decoded."""
    from speclab.methods import METHODS, all_params
    for name, decls in all_params().items():
        users = [m for m, method in METHODS.items() if any(q.name == name for q in method.params)]
        helps = "; ".join(dict.fromkeys(q.help for q in decls if q.help))
        metavar = "{" + ",".join(decls[0].choices) + "}" if decls[0].choices else decls[0].kind.__name__.upper()
        p.add_argument(f"--{name.replace('_', '-')}", default=None, metavar=metavar,
                       help=f"{', '.join(users)}: {helps} (default: the method's)")


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
    prompts = ([{"prompt": a.prompt, "prompt_id": None, "category": None}] if a.prompt is not None
               else _read_prompts(a.prompts))
    if a.db != "none":
        check_trace(a.db)  # a locked or foreign file fails fast; the file itself is made once all is checked
    from dataclasses import replace

    from speclab.core.precision import family
    from speclab.methods import split_dtype
    pinned = split_dtype(a.method)[1]  # 'eagle3@bf16' decodes in bf16 whatever --dtype says
    paths = ModelPaths.from_args(a)
    from speclab.methods import all_params, check_before_loading
    params = {name: getattr(a, name) for name in all_params()}
    check_before_loading(a.method, params, paths.target)  # no model loads for a bad value
    method = get_method(a.method, params)  # its models, as the options given make them (a route's --arms)
    target, models = load_models(replace(paths, dtype=pinned) if pinned else paths, roles=method.needs,
                                 fam=family(a.method))
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
            res = generate(target, p["prompt"], a.method, models=models, max_new_tokens=a.max_new_tokens,
                           temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed, deferred=a.deferred,
                           trace=store, on_round=stream, prompt_id=p["prompt_id"], category=p["category"], **params)
            if store is not None:
                store.drain()  # the run's last writes have landed (or failed, here) before it is reported
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

    from speclab.metrics import run_summary
    from speclab.trace import TraceStore

    with TraceStore(a.db, read_only=True) as store:
        ids = None
        if a.last:
            ids = store.query("SELECT run_id FROM runs ORDER BY run_id DESC LIMIT ?", [a.last]).run_id.tolist()
        df = run_summary(store, ids, by=a.by)
    with pd.option_context("display.width", 200, "display.max_columns", 20, "display.float_format", "{:.3f}".format):
        text = df.to_markdown(index=False, floatfmt=".3f") if a.markdown else df.to_string(index=False)
    write_report(Report("speclab stats", text), None)
    return 0


def add_parsers(sub) -> None:
    """`generate` and `stats`."""
    g = sub.add_parser("generate", help="decode prompts with a method; trace to DuckDB")
    add_model_args(g)
    g.add_argument("--prompt", help="prompt text")
    g.add_argument("--prompts", help="file of prompts (.jsonl with prompt/turns/question/text, or one per line)")
    g.add_argument("--method", default="ar", help="ar | sps | pld | eagle3 | dflash | ... (see speclab.methods); a "
                   "spec like eagle3:tree_topk=1 fixes parameters")
    _add_method_params(g)
    g.add_argument("--deferred", action=argparse.BooleanOptionalAction, default=True,
                   help="the bonus token leads the next verification batch (default on)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--db", default=DEFAULT_DB, help=f"DuckDB trace file (default {DEFAULT_DB}; 'none' to skip)")
    g.add_argument("--json", action="store_true",
                   help="print one JSON line per prompt (summary and text) and nothing else")
    g.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True, help="print text as it is decoded")
    g.set_defaults(fn=cmd_generate)

    s = sub.add_parser("stats", help="metrics (tau, acceptance, tokens/s, ...) pooled per method / category")
    s.add_argument("--db", default=DEFAULT_DB)
    s.add_argument("--by", default="method", help="comma-separated: method, category, prompt_id, bench_id")
    s.add_argument("--last", type=_positive_int, default=None, help="only the last N runs")
    s.add_argument("--markdown", action="store_true")
    s.set_defaults(fn=cmd_stats)
