"""The roofline of every model call (`speclab costs roofline`): what a call reads, what reading it costs at the
machine's bandwidth, and how far each call is from that bound.

On a CPU a decode step reads every weight once per call (1 row or 64), plus the KV cache it attends over, so a
call's floor is bytes / read bandwidth. This module measures the two bandwidths (a working set larger than the
last-level cache, and one inside a core's L2), counts the bytes each call reads (`call_bytes`: the inputs of its
matrix products and attention, counted from the ops the call dispatches, so every drafter is covered without
being named), times the target and every drafter model at hand by rows (`speclab.bench.costs.drafter_calls`,
interleaved), and fits each model's fixed part: the intercept of ms against rows (what a call costs before its
rows), and across models, at one row, the intercept of ms against bytes (the per-call cost no byte explains).

It also times the target's call after an idle gap (`gap_costs`): the process busy in Python for g ms before each
call, touching no memory of its own. On a machine whose caches other tenants share, the target's weights leave
them while it waits, and the next call reads them again from further away: the slope of ms against g is what each
millisecond between two target calls (a drafter's, a router's, any bookkeeping's) adds to the next one.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from speclab.bench.costs import _Bar, drafter_calls, timeit_interleaved
from speclab.core import native, pages
from speclab.core.target import Target, row_call
from speclab.viz import Report, lines_figure

ROWS = (1, 2, 4, 8, 16, 64)
GAPS = (0.0, 1.0, 2.0, 4.0, 8.0)  # ms of idling before a timed target call (`gap_costs`)
GAP_ROWS = (1, 4)  # the target's calls timed after a gap: a decode step and a verification of three draft tokens

# the ops whose inputs a call reads from memory: matrix products (weights; `tile_linear` and `dp_linear`: the AMX and
# AVX512-BF16 products of `native.cpp`) and attention (the KV cache)
_READS = ("linear", "mm", "addmm", "bmm", "mv", "matmul", "_linear_pointwise", "tile_linear", "dp_linear",
          "i8_linear")  # the last: a drafter's int8 weight (`--drafter-weights`), its int8 bytes
_ATTENTION = ("scaled_dot_product", "_scaled_dot_product")  # the public op and the kernels it dispatches to


def cache_bytes(level: int) -> int | None:
    """The size of cpu0's cache at `level` (2: L2, 3: the last level) from sysfs, or None where it is not told."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for d in sorted(base.glob("index*")):
        try:
            if int((d / "level").read_text()) == level and (d / "type").read_text().strip() != "Instruction":
                size = (d / "size").read_text().strip()
                mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1], 1)
                return int(size.rstrip("KMG")) * mult
        except (OSError, ValueError):
            continue
    return None


def read_bandwidth(nbytes: int, reps: int = 7, huge: bool = False) -> float:
    """GB/s of reading an fp32 tensor of `nbytes` once (a sum over it, on torch's threads), the median of `reps`
    after one untimed pass; `huge`: the tensor on 2 MB pages (`pages.mapping`), where the models' weights are."""
    n = max(nbytes // 4, 1024)
    x = pages.mapping(n * 4).view(torch.float32).fill_(1.0) if huge else torch.ones(n)
    x.sum()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / float(np.median(times)) / 1e9


def bandwidths(large_mb: float | None = None, small_mb: float | None = None, reps: int = 7) -> dict:
    """The machine's read bandwidth (GB/s) for a working set larger than the caches (default: 4 x the last-level
    cache, at least 512 MB) and for one that fits in a core's L2 (default: half of it, at most 1 MB). The large set
    is read on 4 KB pages and, where the kernel gives them (`pages.ENABLED`), on 2 MB pages (`dram_gbs_4k`,
    `dram_gbs_2m`, None where not measured); `dram_gbs`, every bound's, is the faster."""
    llc, l2 = cache_bytes(3) or cache_bytes(2) or (32 << 20), cache_bytes(2) or (1 << 20)
    large = int(large_mb * 2**20) if large_mb else max(4 * llc, 512 << 20)
    small = int(small_mb * 2**20) if small_mb else min(l2 // 2, 1 << 20)
    by_pages = {"4k": read_bandwidth(large, reps)}
    if pages.ENABLED:
        by_pages["2m"] = read_bandwidth(large, reps, huge=True)
    return {"dram_gbs": max(by_pages.values()), "cache_gbs": read_bandwidth(small, max(reps, 50)),
            "dram_gbs_4k": by_pages["4k"], "dram_gbs_2m": by_pages.get("2m"),
            "large_mb": large / 2**20, "small_mb": small / 2**20, "llc_mb": llc / 2**20}


class _Reads(TorchDispatchMode):
    """Counts the bytes each matmul (`_READS`) and attention op reads: its tensor inputs, each once; an embedding
    lookup, the rows it gathers."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name == "embedding":  # a lookup reads its rows, not the table
            table, ids = args[0], args[1]
            self.bytes += ids.numel() * table.shape[-1] * table.element_size()
        elif name in _READS or name.startswith(_ATTENTION):  # every input once (a prepacked weight included)
            inputs = {id(a): a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)}
            self.bytes += sum(a.numel() * a.element_size() for a in inputs.values())
        return func(*args, **(kwargs or {}))


def call_bytes(fn: Callable[[], object]) -> int:
    """Bytes one call of `fn` reads: the inputs of its matrix products (weights and activations) and of its
    attention (queries, the cached keys and values, masks), counted from the ops it dispatches."""
    with native.dispatched(), _Reads() as r:  # the fast layers' products and attention through their operators
        fn()
    return r.bytes


@torch.inference_mode()
def roofline(target: Target, models: dict, rows=ROWS, context: int = 200, reps: int = 9, calls: int = 5,
             bw: dict | None = None) -> pd.DataFrame:
    """One row per (model, rows): median ms per call after a `context`-token cache (every (model, rows) interleaved
    over `reps`, each the median of `calls`), the bytes the call reads, the bandwidth bound (bytes / the DRAM read
    bandwidth), the same bound at the in-cache bandwidth, and their ratio to ms. `bw`: `bandwidths()` (measured
    here when None). Models: the target and every drafter model at hand (`drafter_calls`)."""
    from speclab.core.precision import cpu_label, dtype_name
    bw = bw or bandwidths()
    ids = _call_ids(target, context, max(rows))
    callers = {"target": row_call(target, ids, context), **drafter_calls(target, models, ids, context)}
    from speclab.core.layers import reads_int8
    dtypes = {name: dtype_name(_dtype_of(target if name == "target" else models[name]))
              + (", int8 weights" if name != "target" and reads_int8(models[name]) else "") for name in callers}
    fns, nbytes = {}, {}
    for name, call in callers.items():
        for n in rows:
            if call(n) is False:  # no call of n rows (a DFlash block of 1); called once untimed on the way
                continue
            fns[name, n] = lambda call=call, n=n: call(n)
            nbytes[name, n] = call_bytes(fns[name, n])
    bar = _Bar(reps, "roofline")
    med = timeit_interleaved(fns, reps, calls, each=True, on_rep=bar)
    out = []
    for (name, n), ms in med.items():
        b = nbytes[name, n]
        bound = b / (bw["dram_gbs"] * 1e9) * 1e3
        out.append({"model": name, "dtype": dtypes[name], "rows": n, "ms": ms, "mb": b / 1e6, "bound_ms": bound,
                    "cache_bound_ms": b / (bw["cache_gbs"] * 1e9) * 1e3, "ratio": ms / bound if bound else math.nan})
    df = pd.DataFrame(out)
    df.attrs.update(cpu=cpu_label(), dtype=dtype_name(target.dtype), context=context, device=str(target.device),
                    threads=torch.get_num_threads(), layers=native.mode(), **bw)
    return df


def _call_ids(target: Target, context: int, rows: int) -> torch.Tensor:
    """The seeded token ids the timed calls read: a `context`-token cache, then up to `rows` rows (and one more)."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, target.vocab_size, (context + rows + 1,), generator=g).to(target.device)


def idle(ms: float) -> None:
    """Busy in Python for `ms` milliseconds (the interpreter's loop: no tensor, no memory worth counting)."""
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


@torch.inference_mode()
def gap_costs(target: Target, rows=GAP_ROWS, gaps=GAPS, context: int = 200, reps: int = 9,
              calls: int = 5) -> pd.DataFrame:
    """One row per (rows, gap_ms): the median ms of the target's call of `rows` after a `context`-token cache when
    `idle(gap_ms)` ran just before it (every pair interleaved over `reps`, each the median of `calls`)."""
    call = row_call(target, _call_ids(target, context, max(rows)), context)
    fns = {(n, gap): (lambda n=n: call(n)) for n in rows for gap in gaps}
    before = {(n, gap): (lambda gap=gap: idle(gap)) for n, gap in fns}
    for fn in fns.values():  # once untimed
        fn()
    med = timeit_interleaved(fns, reps, calls, each=True, on_rep=_Bar(reps, "target after a gap"), before=before)
    return pd.DataFrame([{"model": "target", "rows": n, "gap_ms": gap, "ms": ms} for (n, gap), ms in med.items()])


def gap_fits(gaps: pd.DataFrame) -> pd.DataFrame:
    """Per rows, the least-squares line of ms against gap_ms: `ms_at_0` (its intercept) and `ms_per_gap_ms` (its
    slope: what a millisecond of waiting adds to the next call)."""
    out = []
    for n, f in gaps.groupby("rows"):
        slope, icpt = np.polyfit(f["gap_ms"], f["ms"], 1) if f["gap_ms"].nunique() >= 2 else (float("nan"),
                                                                                             float(f["ms"].mean()))
        out.append({"rows": int(n), "ms_at_0": float(icpt), "ms_per_gap_ms": float(slope)})
    return pd.DataFrame(out)


def _dtype_of(model) -> torch.dtype:
    """The dtype a model computes in (a Target says; an nn.Module by its first parameter)."""
    dt = getattr(model, "dtype", None)
    return dt if isinstance(dt, torch.dtype) else next(model.parameters()).dtype


def fits(df: pd.DataFrame) -> tuple[pd.DataFrame, dict | None]:
    """Per model, the least-squares line of ms against rows: `fixed_ms` (its intercept: a call before its rows)
    and `per_row_ms` (its slope); and across models at one row, the line of ms against MB read: `overhead_ms` (the
    intercept: what a call costs that no byte explains) and the effective GB/s of its slope (None with fewer than
    two models)."""
    per = []
    for name, f in df.groupby("model", sort=False):
        if len(f) >= 2:
            slope, icpt = np.polyfit(f["rows"], f["ms"], 1)
        else:
            slope, icpt = float("nan"), float(f["ms"].iloc[0])
        one = f[f.rows == f.rows.min()].iloc[0]
        per.append({"model": name, "mb": one["mb"], "ms_1row": one["ms"], "bound_ms": one["bound_ms"],
                    "fixed_ms": icpt, "per_row_ms": slope, "above_bound_ms": one["ms"] - one["bound_ms"]})
    one = df[df.rows == 1]
    across = None
    if one["model"].nunique() >= 2:
        slope, icpt = np.polyfit(one["mb"], one["ms"], 1)
        across = {"overhead_ms": float(icpt), "gbs": float(1 / slope) if slope > 0 else float("inf"),
                  "models": int(one["model"].nunique())}
    return pd.DataFrame(per), across


def _by_pages(a: dict) -> str:
    """The DRAM bandwidth's two measurements, where both were taken: the bound reads the faster (the weights sit on
    2 MB pages where the kernel gives them, `speclab.core.pages`)."""
    two = a.get("dram_gbs_2m")
    if two is None:  # 4 KB pages only
        return "on 4 KB pages"
    return f"{a['dram_gbs_4k']:.1f} on 4 KB pages, {two:.1f} on 2 MB pages"


def roofline_report(df: pd.DataFrame, gaps: pd.DataFrame | None = None) -> Report:
    """The table (one row per model and rows), the per-model fits and the plot: ms per call by rows, each model's
    bound dashed; with `gaps` (`gap_costs`), the target's calls after an idle gap, their fits and their plot."""
    a = df.attrs
    per, across = fits(df)
    head = (f"{a['cpu']}, {a['threads']} threads, layers {a['layers']}; {a['device']}, the target in {a['dtype']} "
            f"(each model's dtype in the table); read bandwidth {a['dram_gbs']:.1f} GB/s for "
            f"{a['large_mb']:.0f} MB (beyond the {a['llc_mb']:.0f} MB last-level cache; {_by_pages(a)}), "
            f"{a['cache_gbs']:.1f} GB/s "
            f"for {a['small_mb']:.2f} MB (in a core's cache); calls after a {a['context']}-token cache. bound_ms = "
            "MB read / the first bandwidth; ratio = ms / bound_ms.")
    table = df.to_markdown(index=False, floatfmt=".3g")
    fit = per.to_markdown(index=False, floatfmt=".3g")
    text = (f"{head}\n\n{table}\n\nPer model: fixed_ms and per_row_ms are the intercept and slope of ms against "
            f"rows; above_bound_ms is the 1-row call's time beyond its bound.\n\n{fit}\n")
    if across:
        text += (f"\nAcross the {across['models']} models at one row, ms against MB read: {across['overhead_ms']:.3f} "
                 f"ms per call that no byte explains, and {across['gbs']:.1f} GB/s for the bytes.\n")
    curves = pd.concat([df.assign(series=df["model"]),
                        df.assign(series=df["model"] + " (bound)", ms=df["bound_ms"])])
    fig = lines_figure(curves, "rows", "ms", "series", f"ms per call against its bandwidth bound ({a['cpu']}, "
                       f"{a['dtype']})", "rows per call", "ms per call")
    for tr in fig.data:
        if tr.name.endswith("(bound)"):
            tr.line.dash = "dash"
    fig.update_xaxes(type="log")
    figs = [fig]
    if gaps is not None and not gaps.empty:
        wide = gaps.pivot(index="gap_ms", columns="rows", values="ms").add_prefix("ms, rows=").reset_index()
        text += ("\nThe target's call after an idle gap (the process busy in Python for gap_ms before each call, "
                 "touching no memory of its own): where other work on the machine shares its caches, the weights "
                 "leave them while it waits. ms_per_gap_ms, the slope, is what each millisecond between two target "
                 "calls adds to the next.\n\n" + wide.to_markdown(index=False, floatfmt=".3g") + "\n\n"
                 + gap_fits(gaps).to_markdown(index=False, floatfmt=".3g") + "\n")
        figs.append(lines_figure(gaps.assign(series="rows=" + gaps["rows"].astype(str)), "gap_ms", "ms", "series",
                                 f"The target's call after an idle gap ({a['cpu']}, {a['dtype']})",
                                 "ms idle before the call", "ms per call"))
    return Report(f"Roofline of every model call ({a['cpu']}, {a['dtype']})", text, figs, summary=text)


def records(df: pd.DataFrame, gaps: pd.DataFrame | None = None) -> list[dict]:
    """`--json`: one object per (model, rows) (`kind` "roofline"), then, with `gaps`, one per (rows, gap_ms) of the
    target (`kind` "gap"), with the machine's figures on each."""
    # each row: its dtype
    machine = {k: df.attrs[k] for k in ("cpu", "threads", "layers", "dram_gbs", "cache_gbs", "context")}
    machine.update({k: df.attrs[k] for k in ("dram_gbs_4k", "dram_gbs_2m") if k in df.attrs})  # None: not measured
    out = [{"kind": "roofline", **r, **machine} for r in df.to_dict("records")]
    if gaps is not None:
        out += [{"kind": "gap", **r, "dtype": df.attrs["dtype"], **machine} for r in gaps.to_dict("records")]
    return out
