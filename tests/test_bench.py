"""Benchmark harness on tiny models: every method and HF peer is run, equal to AR, and reported; parameter grids."""
import json
import math

import pytest
import torch
from scipy.stats import t as scipy_t

from conftest import DEVICE
from speclab.bench.costs import forward_costs
from speclab.bench.results import LLAMACPP, bench_overall, bench_report, bench_table, llamacpp_table, peer_ratios
from speclab.bench.run import BenchConfig, run_bench
from speclab.cli.common import write_report
from speclab.core.target import Target
from speclab.metrics import ci95, model_error, paired_gains, run_metrics, speedup, t975
from speclab.trace import TraceStore


@pytest.mark.slow
def test_bench_runs_methods_and_peers_and_reports(qwen3, qwen3_draft, model_dir, tmp_path):
    from speclab.bench.llamacpp import open_peers
    from speclab.llamacpp import available
    store = TraceStore(tmp_path / "b.duckdb")
    tree = "sps:k=3+tree_topk=2"  # a method spec: its own rows, its parameters over the bench's
    cfg = BenchConfig(suite="demo", methods=["ar", "sps", tree, "pld"], limit=1, max_new_tokens=12)
    lc = LLAMACPP if available() else ()  # the llama.cpp peers on the same tiny models, exported to GGUF (fp32)
    peers = open_peers(model_dir["qwen3"], model_dir["qwen3_draft"], "fp32", 4, 3, 512, log=print) if lc else None
    bench_id = run_bench(cfg, qwen3, {"draft": qwen3_draft}, store, log=lambda s: None, llamacpp=peers)
    table = bench_table(store, bench_id)
    assert set(table.method) == {"ar", "sps", tree, "pld", "ar-untraced", "sps-untraced", f"{tree}-untraced",
                                 "pld-untraced", "hf_assisted", "hf_pld", *lc}
    params = store.query("SELECT params_json FROM runs WHERE method = ?", [tree]).params_json
    assert all(json.loads(p)["tree_topk"] == 2 and json.loads(p)["k"] == 3 for p in params)
    assert set(table.category) == {"code", "stories", "math", "literature"}
    ours = table[~table.method.isin(LLAMACPP)]
    assert (ours.equal_to_ar == 1.0).all()  # greedy: speclab and HF's own speculative decoding equal AR
    assert (table.bug == 0).all()  # llama.cpp (its KV cache in f16): equal, or apart at a numerical near-tie
    assert table[table.method == "ar"].speedup.tolist() == pytest.approx([1.0] * 4)
    # speedup recomputed from the raw run rows, apart from the SQL: tokens over decode time, method over AR
    runs = store.runs()
    runs = runs[runs.bench_id == bench_id]
    tps = runs.groupby(["category", "method"]).new_tokens.sum() / runs.groupby(["category", "method"]).elapsed_s.sum()
    for x in table.itertuples():
        assert x.speedup == pytest.approx(tps[x.category, x.method] / tps[x.category, "ar"], rel=1e-9)
    overall = bench_overall(store, bench_id)
    sps = overall[overall.method == "sps"].iloc[0]
    assert sps.tau > 1.0 and 0 < sps.acceptance_rate <= 1
    assert {(r["speclab"], r["peer"]) for r in peer_ratios(overall)} == {
        ("sps-untraced", "hf_assisted"), ("sps", "hf_assisted"), ("pld-untraced", "hf_pld"), ("pld", "hf_pld")}
    untraced = overall[overall.method.str.endswith("-untraced")].set_index("method")
    if DEVICE == "cpu":  # measured on the CPU only (`speclab.generate.model_ms`): time inside model forwards
        assert untraced.model_call_share.between(0.2, 1.0).all()
    assert store.query("SELECT count(*) AS n FROM runs WHERE diverges_at IS NOT NULL AND engine IS NULL").n[0] == 0
    bench = store.query("SELECT * FROM benches").iloc[0]
    assert bench.status == "done" and bench.trace_overhead > 0
    # methods paired by prompt, recomputed from the runs' own tau and tokens/s
    pairs = paired_gains(store, bench_id).set_index(["method", "against"])
    ours = {("pld", "sps"), ("pld", tree), ("sps", tree)}  # and llama.cpp's speculative peers, which have steps
    assert ours <= set(pairs.index) and all(set(p) & set(lc) for p in set(pairs.index) - ours)
    assert (pairs.prompts == 4).all()
    per = run_metrics(store)
    per = per[per.bench_id == bench_id].set_index(["method", "prompt_id"])
    for (a, b), row in pairs.iterrows():
        for key, col in (("tau_gain", "tau"), ("speed_gain", "tokens_per_s")):
            g = (per.loc[a][col] / per.loc[b][col] - 1).to_numpy()
            assert row[key] == pytest.approx(g.mean(), rel=1e-9, abs=1e-12)
            assert row[f"{key}_ci95"] == pytest.approx(scipy_t.ppf(0.975, 3) * g.std(ddof=1) / 2, rel=1e-3, abs=1e-9)
    md, html = write_report(bench_report(store, bench_id), tmp_path / "r" / "bench.md")
    assert "Method against method, paired by prompt" in md.read_text() and "Gain per prompt, paired" in html.read_text()
    assert "speclab vs Hugging Face" in md.read_text() and "plotly" in html.read_text()
    assert "Per-position acceptance" in md.read_text()
    assert "dtype float32 (logits float32)" in md.read_text()  # the runs' dtype (a column, not the row's own)
    if lc:  # each peer a run of the engine, its version and settings; the speculative ones with their steps
        runs = store.query("SELECT * FROM runs WHERE bench_id = ? AND engine = 'llama.cpp'", [bench_id])
        assert set(runs.method) == set(LLAMACPP) and runs.engine_version.str.startswith("llama-cpp-python").all()
        assert (runs.source == runs.method + " (bench)").all()  # the app's engine card says where each came from
        assert all(json.loads(p)["threads"] >= 1 for p in runs.params_json)
        spec = overall.set_index("method").loc[["llamacpp_pld", "llamacpp_sps"]]
        assert (spec.tau >= 1).all() and overall.set_index("method").loc["llamacpp_sps"].tau > 1
        assert "speclab vs llama.cpp" in md.read_text()
        lcpp = llamacpp_table(table, overall)
        assert set(lcpp.category) == {"code", "stories", "math", "literature", "all"}
        assert lcpp.llamacpp_best.isin(LLAMACPP).all() and lcpp.speclab_best.str.endswith("-untraced").all()
    store.close()


def test_a_sampled_bench_samples_every_method_and_compares_none_with_ar(qwen3, qwen3_draft, tmp_path):
    """--temperature: every run samples at it (prompt i at seed + i, recorded in its parameters), no output is
    compared with AR's (equality NULL, no divergence), the peers are left out, and tau and speed are reported."""
    store = TraceStore(tmp_path / "s.duckdb")
    cfg = BenchConfig(suite="demo", methods=["ar", "sps"], limit=1, max_new_tokens=12, temperature=0.7, seed=5)
    said = []
    bench_id = run_bench(cfg, qwen3, {"draft": qwen3_draft}, store, log=said.append)
    table = bench_table(store, bench_id)
    assert set(table.method) == {"ar", "sps", "ar-untraced", "sps-untraced"} and any("peers" in s for s in said)
    assert table.equal_to_ar.isna().all() and (table.tau[table.method == "sps"] > 1).all()
    params = [json.loads(p) for p in store.query("SELECT params_json FROM runs WHERE bench_id = ?", [bench_id])
              .params_json]
    assert {p["temperature"] for p in params} == {0.7} and min(p["seed"] for p in params) == 5
    assert store.query("SELECT count(*) AS n FROM runs WHERE diverges_at IS NOT NULL AND engine IS NULL").n[0] == 0
    # one decode group per prompt: every run of it (traced and untraced) is decoded beside the others
    ran = store.query("SELECT run_id, prompt_id FROM runs WHERE bench_id = ? ORDER BY run_id", [bench_id])
    for _, of_prompt in ran.groupby("prompt_id"):
        rids = of_prompt.run_id.tolist()
        assert len(rids) == 4 and all(store.decoded_with(r) == rids for r in rids)
    greedy = run_bench(BenchConfig(suite="demo", methods=["ar", "sps"], limit=1, max_new_tokens=12, peers=False),
                       qwen3, {"draft": qwen3_draft}, store, log=lambda s: None)
    assert (bench_table(store, greedy).equal_to_ar == 1.0).all()  # greedy benches still compare
    store.close()


@pytest.mark.slow
def test_a_bench_whose_families_run_in_different_dtypes(qwen3, qwen3_draft, tmp_path):
    """--dtype auto chose fp32 for AR and bf16 for the speculative methods: AR runs in fp32 (the fastest AR, which
    speedups are over), the speculative methods in bf16 beside `ar@bf16` (their equality reference), the tables
    and the report say which dtype each method ran in and why; a spec can pin its own dtype."""
    from speclab.bench.run import plan_dtypes
    resolve = {"ar": "fp32", "speculative": "bf16"}.get
    assert plan_dtypes(["ar", "pld"], resolve) == (["ar", "pld", "ar@bf16"],
                                                   {"ar": "fp32", "pld": "bf16", "ar@bf16": "bf16"})
    assert plan_dtypes(["ar", "pld", "sps@fp32"], resolve)[0] == ["ar", "pld", "sps@fp32", "ar@bf16"]
    assert plan_dtypes(["ar", "pld"], lambda f: "fp32") == (["ar", "pld"], {"ar": "fp32", "pld": "fp32"})  # no mix
    bf16 = (Target.load(qwen3.name, dtype="bf16"), {"draft": Target.load(qwen3_draft.name, dtype="bf16")})
    methods, dtypes = plan_dtypes(["ar", "pld", "sps"], resolve)
    why = {"ar": "--dtype auto -> fp32 for ar: fp32 faster (test)", "speculative": "--dtype auto -> bf16 (test)"}
    cfg = BenchConfig(suite="demo", methods=methods, limit=1, max_new_tokens=12, peers=False, dtypes=dtypes,
                      dtype_why=why)
    store = TraceStore(tmp_path / "m.duckdb")
    bench_id = run_bench(cfg, qwen3, {"draft": qwen3_draft}, store, log=lambda s: None,
                         sets={"fp32": (qwen3, {"draft": qwen3_draft}), "bf16": bf16})
    ran = store.query("SELECT method, any_value(dtype) AS dtype FROM runs WHERE bench_id = ? GROUP BY method",
                      [bench_id]).set_index("method").dtype.to_dict()
    assert ran == {"ar": "float32", "ar-untraced": "float32", "pld": "bfloat16", "pld-untraced": "bfloat16",
                   "sps": "bfloat16", "sps-untraced": "bfloat16", "ar@bf16": "bfloat16",
                   "ar@bf16-untraced": "bfloat16"}
    overall = bench_overall(store, bench_id).set_index("method")
    assert overall.loc["pld", "dtype"] == "bfloat16" and overall.loc["ar", "dtype"] == "float32"
    fastest = max(overall.loc["ar", "tokens_per_s"], overall.loc["ar@bf16", "tokens_per_s"])
    for m in ("pld", "sps", "ar", "ar@bf16"):
        assert overall.loc[m, "speedup"] == pytest.approx(overall.loc[m, "tokens_per_s"] / fastest, rel=1e-9)
    # equality is against AR in the method's own dtype: the bf16 methods against ar@bf16 (equal or a near-tie)
    eq = run_metrics(store)
    eq = eq[(eq.bench_id == bench_id) & eq.method.isin(["pld", "sps"])]
    assert (eq.equal_to_ar + eq.near_tie == 1.0).all() and (eq.bug == 0).all()
    md, _ = write_report(bench_report(store, bench_id), tmp_path / "r" / "mixed.md")
    text = md.read_text()
    assert "Precision: ar float32, ar@bf16 bfloat16, pld bfloat16, sps bfloat16." in text
    assert why["speculative"] in text and "over the fastest AR of the bench" in text
    store.close()


def test_bench_reports_where_an_output_differs_from_ar(qwen3, tmp_path):
    """A fabricated mismatch: the bench records the first differing token and the top-2 gap, and reports it."""
    from speclab.bench.results import bench_divergences
    from speclab.bench.run import record_divergences
    from speclab.generate import encode_prompt, generate
    store = TraceStore(tmp_path / "d.duckdb")
    ids = encode_prompt(qwen3, "Once upon a time")
    ar = generate(qwen3, ids, "ar", max_new_tokens=8, trace=store, bench_id="b1")
    other = generate(qwen3, ids, "pld", max_new_tokens=8, trace=store, bench_id="b1")
    wrong = other.token_ids[:3] + [(other.token_ids[3] + 1) % qwen3.vocab_size] + other.token_ids[4:]
    record_divergences(store, ids, {"ar": (ar.run_id, ar.token_ids), "pld": (other.run_id, wrong)},
                       {"ar": qwen3, "pld": qwen3})
    df = bench_divergences(store, "b1")
    assert df.method.tolist() == ["pld"] and df.diverges_at.tolist() == [3]
    assert df.top2_gap[0] >= 0 and not df.near_tie[0]
    store.close()


def test_forward_costs_times_both_backends_and_leaves_the_model_intact(qwen3, monkeypatch):
    ids = torch.arange(3, 20)
    before = qwen3.forward(ids, qwen3.new_cache()).logits
    df = forward_costs({"tiny": qwen3}, ns=(1, 3), context=16, reps=2, calls=2)
    assert list(df["n"]) == [1, 3] and (df[["lean_ms", "hf_ms"]] > 0).all().all()
    assert torch.equal(qwen3.forward(ids, qwen3.new_cache()).logits, before)
    # known timings: lean 2 ms and transformers 3 ms a call make lean 1.5x as fast
    from speclab.bench import costs
    monkeypatch.setattr(costs, "timeit_interleaved", lambda fns, *a, **k: {"lean": 2.0, "hf": 3.0})
    df = forward_costs({"tiny": qwen3}, ns=(1,), context=16, reps=1, calls=1)
    assert df.speedup.tolist() == pytest.approx([1.5])


def test_paired_intervals_use_students_t():
    """t975 is Student's 0.975 quantile (table to 30 degrees of freedom, an expansion above), ci95 its interval."""
    for df in (1, 2, 5, 30, 31, 60, 1000):
        assert t975(df) == pytest.approx(scipy_t.ppf(0.975, df), abs=5e-4)
    assert ci95(2.0, 4) == pytest.approx(scipy_t.ppf(0.975, 3) * 2.0 / 2, abs=1e-3)
    assert math.isnan(ci95(1.0, 1)) and math.isnan(t975(0))


def test_speedup_and_model_error_on_known_numbers():
    """One definition each (speclab.metrics): speedup = tokens/s over AR's; model error = modeled / measured
    tokens/s - 1, positive when the cost model promises more than was measured."""
    assert speedup(300.0, 100.0) == 3.0 and speedup(50.0, 100.0) == 0.5
    assert math.isnan(speedup(10.0, 0.0)) and math.isnan(speedup(10.0, math.nan))
    assert model_error(110.0, 100.0) == pytest.approx(0.1) and model_error(90.0, 100.0) == pytest.approx(-0.1)
    assert math.isnan(model_error(1.0, 0.0))


def test_interleaved_timing_takes_turns_and_reports_medians(monkeypatch):
    """The one timing loop of the cost benchmarks: the functions take turns, `calls` in a row, and the figure is
    the median over repetitions of ms per call (on a fake clock the functions advance by known amounts)."""
    from speclab.bench import costs
    clock, order, slow_ms = [0.0], [], iter([1.0, 9.0, 2.0])
    monkeypatch.setattr(costs.time, "perf_counter", lambda: clock[0])

    def takes(name, ms):
        def fn():
            order.append(name)
            clock[0] += (next(ms) if name == "slow" else ms) / 1e3
        return fn
    med = costs.timeit_interleaved({"slow": takes("slow", slow_ms), "fast": takes("fast", 1.0)}, reps=3)
    assert order == ["slow", "fast"] * 3
    assert med == pytest.approx({"slow": 2.0, "fast": 1.0})  # medians: one slow outlier (9 ms) does not count
    order.clear()
    assert costs.timeit_interleaved({"fast": takes("fast", 1.0)}, reps=2, calls=3) == pytest.approx({"fast": 1.0})
    assert order == ["fast"] * 6


@pytest.mark.slow
def test_param_grid_measures_every_distinct_combination(qwen3, qwen3_draft):
    from speclab.bench.grid import param_grid, parse_grid
    from speclab.errors import InvalidInput
    grid = parse_grid("k=2,3;tree_topk=1,2")
    df = param_grid(qwen3, {"draft": qwen3_draft}, "sps", grid, suite="demo", limit=1, max_new_tokens=10,
                    extra=[{"k": 5}], log=lambda s: None)
    assert len(df) == 5 and df.preset.sum() == 1  # 4 combinations + the extra point
    assert (df.equal_to_ar == 1.0).all() and (df.tokens_per_s > 0).all() and (df.tau >= 1).all()
    assert df.tokens_per_s.is_monotonic_decreasing  # fastest first
    # under sampling every decode samples (prompt i at seed + i): two runs with one seed decode alike; outputs are
    # not compared with AR's
    sampled = [param_grid(qwen3, {"draft": qwen3_draft}, "sps", {"k": ["2"]}, suite="demo", limit=1,
                          max_new_tokens=10, log=lambda s: None, temperature=1.0, seed=5) for _ in range(2)]
    assert all(d.equal_to_ar.isna().all() and (d.tau >= 1).all() for d in sampled)
    assert sampled[0].tau.tolist() == sampled[1].tau.tolist()
    with pytest.raises(InvalidInput, match="not a parameter of sps"):
        param_grid(qwen3, {"draft": qwen3_draft}, "sps", {"depth": ["2"]}, suite="demo", limit=1)
    with pytest.raises(InvalidInput, match="k must be an integer"):
        param_grid(qwen3, {"draft": qwen3_draft}, "sps", {"k": ["0"]}, suite="demo", limit=1)
