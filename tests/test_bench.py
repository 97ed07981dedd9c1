"""Benchmark harness on tiny models: every method and HF peer is run, equal to AR, and reported."""
import pytest

from speclab.bench import BenchConfig, bench_overall, bench_table, peer_ratios, run_bench, write_report
from speclab.trace import TraceStore


def test_bench_runs_methods_and_peers_and_reports(qwen3, qwen3_draft, tmp_path):
    store = TraceStore(tmp_path / "b.duckdb")
    cfg = BenchConfig(suite="demo", methods=["ar", "sps", "pld"], limit=1, max_new_tokens=12)
    bench_id = run_bench(cfg, qwen3, qwen3_draft, store, log=lambda s: None)
    table = bench_table(store, bench_id)
    assert set(table.method) == {"ar", "sps", "pld", "ar-untraced", "sps-untraced", "pld-untraced", "hf_assisted", "hf_pld"}
    assert set(table.category) == {"code", "stories", "math", "literature"}
    assert (table.equal_to_ar == 1.0).all()  # greedy: speclab and HF's own speculative decoding equal AR
    assert table[table.method == "ar"].speedup.tolist() == pytest.approx([1.0] * 4)
    overall = bench_overall(store, bench_id)
    sps = overall[overall.method == "sps"].iloc[0]
    assert sps.tau > 1.0 and 0 < sps.acceptance_rate <= 1
    assert {(r["speclab"], r["peer"]) for r in peer_ratios(overall)} == {
        ("sps-untraced", "hf_assisted"), ("sps", "hf_assisted"), ("pld-untraced", "hf_pld"), ("pld", "hf_pld")}
    bench = store.query("SELECT * FROM benches").iloc[0]
    assert bench.status == "done" and bench.trace_overhead > 0
    md, html = write_report(store, bench_id, tmp_path / "r" / "bench.md")
    assert "speclab vs Hugging Face" in md.read_text() and "plotly" in html.read_text()
    store.close()
