"""`speclab import`: production runs of vLLM, SGLang and llama.cpp (and AIPerf's records of them) into the trace
(`speclab.production`): saved responses and streams, or two Prometheus scrapes around a run. Everything is read and
checked first; then every run lands in one transaction, or none does."""
from __future__ import annotations

import argparse

from speclab.cli.common import DEFAULT_DB, write_report
from speclab.errors import SpeclabError


def cmd_import(a: argparse.Namespace) -> int:
    from speclab.production import prometheus, view
    from speclab.production.files import import_files, read_text
    from speclab.production.record import write_runs
    from speclab.trace import TraceStore

    if bool(a.before) != bool(a.after):
        raise SpeclabError("--before and --after go together: two scrapes of the server's /metrics, one taken "
                           "before the run and one after")
    if not a.files and not a.before:
        raise SpeclabError("nothing to import: give response files (JSON, JSON lines, a saved stream) and/or "
                           "--before/--after scrapes")
    if a.model is not None and not a.before:
        raise SpeclabError("--model picks the model of Prometheus scrapes (--before/--after); responses name their "
                           "own")
    for opt in ("engine_version", "category", "hardware"):
        v = getattr(a, opt)
        if v is not None and (not v.strip() or len(v) > 200 or any(ord(c) < 32 for c in v)):
            raise SpeclabError(f"--{opt.replace('_', '-')} {v!r}: a short line of text")
    skipped: list = []
    runs = import_files(a.files, a.engine, a.engine_version, skipped)
    if skipped:
        print(f"skipped {len(skipped)} AIPerf line(s) that are no run: " + "; ".join(
            f"{where}: {why}" for where, why in skipped[:3]) + (" ..." if len(skipped) > 3 else ""))
    if a.before:
        if a.engine not in ("auto", "vllm", "llama.cpp"):
            raise SpeclabError(f"--engine {a.engine}: Prometheus scrapes are vLLM's or llama.cpp's")
        run = prometheus.from_scrapes(read_text(a.before, "--before"), read_text(a.after, "--after"), a.before,
                                      a.after, a.model, a.engine_version)
        if a.engine != "auto" and run.engine != a.engine:
            raise SpeclabError(f"--engine {a.engine}: the scrapes are {run.engine}'s counters")
        runs.append(run)
    if a.compare:
        compare = [int(x) for x in a.compare.split(",") if x.strip().isdigit()]
        if not compare or len(compare) != len([x for x in a.compare.split(",") if x.strip()]):
            raise SpeclabError(f"--compare {a.compare!r}: run ids of the trace, comma-separated")
    else:
        compare = []
    with TraceStore(a.db) as store:
        if compare:
            have = set(store.query(f"SELECT run_id FROM runs WHERE run_id IN ({', '.join(map(str, compare))})")
                       .run_id.tolist())
            missing = [i for i in compare if i not in have]
            if missing:
                raise SpeclabError(f"--compare: no run {missing[0]} in {a.db}")
        ids = write_runs(store, runs, a.category, a.hardware)
        report = view.report(store, ids, compare, a.db)
    write_report(report, a.report)
    print(f"\n{len(ids)} run(s) imported into {a.db}: run ids {ids[0]}..{ids[-1]} (the app's run list shows them "
          "with their engine)")
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("import", help="import vLLM / SGLang / llama.cpp speculative-decoding metrics into the trace")
    p.add_argument("files", nargs="*", help="saved responses: a JSON response, a JSON list, JSON lines (a bench's "
                   "results, an OpenAI batch output) or a saved event stream (data: lines)")
    p.add_argument("--engine", default="auto", help="auto (from each response's fields), vllm, sglang, llama.cpp or "
                   "aiperf (NVIDIA AIPerf's per-request records, profile_export.jsonl)")
    p.add_argument("--before", help="a Prometheus scrape (/metrics) of a vLLM or llama.cpp server taken before the run")
    p.add_argument("--after", help="the scrape taken after it: the counters' differences are one run")
    p.add_argument("--model", help="scrapes: the model_name whose counters to take (when several are served)")
    p.add_argument("--engine-version", help="the engine's version (kept with the runs; read from a response's "
                   "system_fingerprint where it says)")
    p.add_argument("--category", help="a category (domain) for the runs, to compare with speclab's categories")
    p.add_argument("--hardware", help="where it ran (kept as the runs' device), e.g. 'H100 80GB'")
    p.add_argument("--compare", help="speclab run ids to show beside the imported runs in the report's figures")
    p.add_argument("--db", default=DEFAULT_DB, help=f"trace file (default {DEFAULT_DB})")
    p.add_argument("--report", help="write the report (.md: markdown and HTML beside it; else HTML with the figures)")
    p.set_defaults(fn=cmd_import)
