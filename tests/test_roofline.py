"""The roofline and the step profile (`speclab costs roofline | step`, speclab.bench.roofline / steps): the bytes a
call reads are counted from the ops it runs (exactly, for a known call), every registered drafter model with a call
is covered without being named, the bound and the fits are the arithmetic they say, and a profiled decode's time
splits into ops and the time between them."""
import json

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from helpers import run_cli
from speclab.bench.roofline import bandwidths, call_bytes, fits, gap_costs, gap_fits, roofline
from speclab.bench.steps import step_profile
from speclab.generate import generate
from speclab.methods import ROLES


def test_call_bytes_counts_the_inputs_of_matmuls_and_attention_only():
    w, x = torch.randn(64, 32), torch.randn(3, 32)
    assert call_bytes(lambda: F.linear(x, w)) == (64 * 32 + 3 * 32) * 4
    q, k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    attn = (q.numel() + k.numel() + v.numel()) * 4
    for mode in (torch.no_grad, torch.inference_mode):  # the public op, or the kernel it dispatches to
        with mode():
            got = call_bytes(lambda: (F.linear(x, w).relu(), F.scaled_dot_product_attention(q, k, v, enable_gqa=True)))
        assert got == (64 * 32 + 3 * 32) * 4 + attn  # relu reads nothing counted
    ids, table = torch.tensor([1, 5]), torch.randn(100, 16)
    assert call_bytes(lambda: F.embedding(ids, table)) == 2 * 16 * 4  # a lookup reads its rows, not the table


def test_roofline_covers_the_target_and_every_drafter_model_with_a_call(deep):
    models = {role: r.random(deep, seed=3) for role, r in ROLES.items() if r.call is not None and r.random}
    bw = {"dram_gbs": 10.0, "cache_gbs": 100.0, "large_mb": 1.0, "small_mb": 0.1, "llc_mb": 1.0}
    df = roofline(deep, models, rows=(1, 2, 4), context=16, reps=1, calls=1, bw=bw)
    assert set(df.model) == {"target", *models} and set(df.dtype) == {"float32"}
    assert set(df[df.model == "dflash"].rows) == {2, 4}  # a block is the root and at least one mask
    assert set(df[df.model == "specblock"].rows) <= {4}  # whole blocks of K only
    assert (df.ms > 0).all() and (df.mb > 0).all()
    weights = sum(p.numel() * p.element_size() for n, p in deep.model.named_parameters() if "embed" not in n)
    t1 = df[(df.model == "target") & (df.rows == 1)].iloc[0]
    assert t1.mb * 1e6 >= weights  # every weight (the head included) and the cache it attends over
    assert t1.bound_ms == pytest.approx(t1.mb * 1e6 / 10e9 * 1e3) and t1.ratio == pytest.approx(t1.ms / t1.bound_ms)
    assert (df.groupby("model").mb.apply(lambda s: s.is_monotonic_increasing)).all()  # more rows, more bytes


def test_the_dram_bandwidth_is_the_faster_of_both_page_sizes(monkeypatch):
    from speclab.core import pages
    for on in (True, False):
        monkeypatch.setattr(pages, "ENABLED", on)
        bw = bandwidths(large_mb=8, small_mb=0.25, reps=2)
        assert bw["dram_gbs_4k"] > 0 and (bw["dram_gbs_2m"] > 0 if on else bw["dram_gbs_2m"] is None)
        assert bw["dram_gbs"] == max(v for v in (bw["dram_gbs_4k"], bw["dram_gbs_2m"]) if v is not None)


def test_fits_are_least_squares_lines():
    df = pd.DataFrame([{"model": m, "rows": r, "ms": a + b * r, "mb": mb, "bound_ms": mb / 10}
                       for m, a, b, mb in (("x", 1.0, 0.5, 10.0), ("y", 2.0, 0.25, 30.0)) for r in (1, 2, 4)])
    per, across = fits(df)
    assert per.set_index("model").fixed_ms.to_dict() == pytest.approx({"x": 1.0, "y": 2.0})
    assert per.set_index("model").per_row_ms.to_dict() == pytest.approx({"x": 0.5, "y": 0.25})
    # at one row: 1.5 ms for 10 MB, 2.25 ms for 30 MB -> 0.0375 ms per MB (26.7 GB/s), 1.125 ms at no bytes
    assert across["overhead_ms"] == pytest.approx(1.125) and across["gbs"] == pytest.approx(1 / 0.0375)


def test_the_target_after_a_gap_is_timed_per_rows_and_gap_and_fitted(deep):
    gaps = gap_costs(deep, rows=(1, 3), gaps=(0.0, 2.0), context=16, reps=1, calls=1)
    assert sorted(zip(gaps.rows, gaps.gap_ms)) == [(1, 0.0), (1, 2.0), (3, 0.0), (3, 2.0)] and (gaps.ms > 0).all()
    synthetic = pd.DataFrame([{"rows": r, "gap_ms": g, "ms": 2.0 * r + s * g} for r, s in ((1, 0.5), (4, 0.25))
                              for g in (0.0, 2.0, 8.0)])
    f = gap_fits(synthetic).set_index("rows")
    assert f.ms_at_0.to_dict() == pytest.approx({1: 2.0, 4: 8.0})
    assert f.ms_per_gap_ms.to_dict() == pytest.approx({1: 0.5, 4: 0.25})


def test_a_profiled_decode_splits_into_ops_and_the_time_between(qwen3):
    summary, ops = step_profile(lambda: generate(qwen3, "The cat sat", "ar", max_new_tokens=6), "ar",
                                lambda r: r.decode.rounds)
    assert summary["rounds"] == 6 and summary["plain_ms"] > 0
    assert summary["in_ops_ms"] + summary["outside_ms"] == pytest.approx(summary["profiled_ms"])
    assert 0 < summary["in_ops_ms"] < summary["profiled_ms"] and summary["python_ops"] < summary["all_ops"]
    assert {"aten::linear", "aten::scaled_dot_product_attention"} <= set(ops.op)  # fp32: F.linear, fused attention
    assert ops.self_ms.is_monotonic_decreasing


@pytest.mark.slow
def test_roofline_json_is_one_object_per_model_and_rows():
    r = run_cli("costs", "roofline", "--rows", "1,4", "--reps", "1", "--large-mb", "64", "--json", "--dtype", "fp32",
                "--gaps", "0,2", "--gap-rows", "1")
    assert r.returncode == 0, r.stderr
    every = [json.loads(line) for line in r.stdout.splitlines()]
    recs = [x for x in every if x["kind"] == "roofline"]
    assert {(x["model"], x["rows"]) for x in recs} >= {("target", 1), ("target", 4), ("eagle3", 1), ("dflash", 4)}
    assert all({"model", "dtype", "rows", "ms", "bound_ms", "ratio", "cpu"} <= set(x) and x["ratio"] > 0 for x in recs)
    assert {x["dtype"] for x in every} == {"float32"}  # --dtype fp32: every model in it
    gaps = [x for x in every if x["kind"] == "gap"]  # the target after 0 and 2 ms of idling, one row
    assert len(every) == len(recs) + len(gaps) and sorted((x["rows"], x["gap_ms"]) for x in gaps) == [(1, 0), (1, 2)]
    assert all(x["model"] == "target" and x["ms"] > 0 and "cpu" in x for x in gaps)
