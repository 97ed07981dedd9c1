"""Where a decode step's time goes (`speclab costs step`): one decode per method under torch's profiler, by op.

Each method decodes the same prompt three times: once to warm up, once timed plainly (the profiler slows small
ops, so the plain ms per round is the figure to compare), once under `torch.profiler`. From the profiled decode's
events on the calling thread it takes the top-level ops (those no other op contains: what Python called), so that
per round: the time inside ops, the time outside them (Python, the interpreter between ops, the profiler's own
bookkeeping), the number of ops Python called and of every op they ran, and each op's own time (self time, the
time of the ops it ran subtracted) by name.
"""
from __future__ import annotations

import time
from collections import defaultdict

import pandas as pd
import torch
from torch.profiler import ProfilerActivity, profile

from speclab.core import native
from speclab.viz import Report, stacked_bars

TOP = 10  # ops named per method; the rest are summed as "other ops"


def _top_level(events) -> list:
    """The events no other event contains, in order (ops run on the calling thread: torch's intra-op workers
    record none of their own)."""
    top, end = [], float("-inf")
    for e in sorted(events, key=lambda e: (e.time_range.start, -e.time_range.end)):
        if e.time_range.start >= end:
            top.append(e)
            end = e.time_range.end
    return top


def step_profile(decode, label: str, rounds_of) -> tuple[dict, pd.DataFrame]:
    """Profile `decode()` (one decode, returning its result) after a warm-up and a plain timed run; `rounds_of(result)`
    is its number of rounds. Returns the per-round summary and one row per op name (self ms per round, calls)."""
    decode()
    t0 = time.perf_counter()
    plain = decode()
    plain_ms = (time.perf_counter() - t0) * 1e3 / max(rounds_of(plain), 1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        res = decode()
        wall = (time.perf_counter() - t0) * 1e3
    n = max(rounds_of(res), 1)
    events = list(prof.events())
    top, n_all = _top_level(events), len(events)
    in_ops = sum(e.time_range.elapsed_us() for e in top) / 1e3
    self_ms: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for e in events:
        self_ms[e.name] += e.self_cpu_time_total / 1e3
        calls[e.name] += 1
    ops = pd.DataFrame([{"method": label, "op": k, "self_ms": v / n, "calls": calls[k] / n}
                        for k, v in self_ms.items()]).sort_values("self_ms", ascending=False)
    summary = {"method": label, "rounds": rounds_of(res), "plain_ms": plain_ms, "profiled_ms": wall / n,
               "in_ops_ms": in_ops / n, "outside_ms": (wall - in_ops) / n, "outside_share": (wall - in_ops) / wall,
               "python_ops": len(top) / n, "all_ops": n_all / n}
    return summary, ops


def steps_report(summaries: list[dict], ops: pd.DataFrame, cpu: str, dtype: str, what: str) -> Report:
    """The per-round summary table, each method's top ops, and the stacked bars of one round's time."""
    s = pd.DataFrame(summaries)
    parts = []
    tables = []
    for m in s["method"]:
        o = ops[ops.method == m]
        top = o.head(TOP)
        row = s[s.method == m].iloc[0]
        rest = row["in_ops_ms"] - top["self_ms"].sum()
        parts += [{"method": m, "part": r.op, "ms": r.self_ms} for r in top.itertuples()]
        parts += [{"method": m, "part": "other ops", "ms": max(rest, 0.0)},
                  {"method": m, "part": "outside ops (Python)", "ms": row["outside_ms"]}]
        tables.append(f"### {m}\n\n" + top.drop(columns="method").to_markdown(index=False, floatfmt=".3f"))
    text = (f"{cpu}, {dtype}, {torch.get_num_threads()} threads, layers {native.mode()}; {what}. plain_ms: ms per "
            "round without the profiler; the rest is from the profiled decode (the profiler slows every op, the "
            "small ones most): in_ops_ms is the time inside the ops Python called, outside_ms the time between them; "
            "python_ops and all_ops count the ops called from Python and every op they ran, per round.\n\n"
            + s.to_markdown(index=False, floatfmt=".3g") + "\n\nTop ops by self time per round (ms, calls per "
            "round):\n\n" + "\n\n".join(tables) + "\n")
    fig = stacked_bars(pd.DataFrame(parts), "method", "part", "ms", f"One round's time by op, profiled ({cpu}, "
                       f"{dtype})", "ms per round")
    return Report(f"Decode step profile ({cpu}, {dtype})", text, [fig])
