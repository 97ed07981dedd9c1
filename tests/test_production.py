"""Production runs in the trace (`speclab import`, `speclab.production`): one example file per engine and shape
(data/engines, written in the engines' documented shapes) imported and read back with speclab's own SQL, the
figures checked against the engines' definitions by hand; a speclab run exported in vLLM's shape and imported
back has speclab's own figures; every inconsistent or foreign file is one line and writes nothing."""
import json

import pytest

from helpers import PROMPTS, assert_one_error_line
from speclab.generate import generate
from speclab.metrics import position_acceptance, run_metrics
from speclab.production import prometheus
from speclab.production.files import import_files
from speclab.production.record import write_runs
from speclab.trace import TraceStore
from speclab.zoo import REPO_ROOT

ENGINES = REPO_ROOT / "data" / "engines"


def imported(tmp_path, *names, **kw):
    """Import files of data/engines through the command; -> (store, run ids)."""
    from speclab.cli import main

    db = tmp_path / "t.duckdb"
    argv = ["import", *[str(ENGINES / n) for n in names], "--db", str(db)]
    for k, v in kw.items():
        argv += [f"--{k}", str(ENGINES / v) if k in ("before", "after") else v]
    assert main(argv) == 0
    store = TraceStore(db, read_only=True)
    return store, store.query("SELECT run_id FROM runs WHERE engine IS NOT NULL ORDER BY run_id").run_id.tolist()


def acceptance(store, rid) -> list[float]:
    return position_acceptance(store, [rid]).acceptance.round(6).tolist()


def test_vllm_summary_maps_onto_speclab_definitions(tmp_path):
    store, [rid] = imported(tmp_path, "vllm_summary.json", **{"engine-version": "0.32.0", "category": "qa"})
    m = run_metrics(store, [rid]).iloc[0]
    # mean_acceptance_length 1.2326 counts the bonus: speclab's tau, recomputed from the counts
    assert m.rounds == 43 and m.tau == pytest.approx(1 + 10 / 43) and m.acceptance_rate == pytest.approx(10 / 129)
    # [39, 1, 0, 3] with every step drafting 3: depth d is reached by all 43 steps, accepted by those with j >= d
    assert acceptance(store, rid) == [round(4 / 43, 6), round(3 / 43, 6), round(3 / 43, 6)]
    r = store.runs().iloc[0]
    assert (r.engine, r.engine_version, r.source, r.method, r.category) == ("vllm", "0.32.0", "vllm_summary.json",
                                                                           "vllm", "qa")
    params = json.loads(r.params_json)
    assert params["reported"]["mean_acceptance_length"] == pytest.approx(1.2325581395348837)
    assert params["max_draft"] == 3 and any("bonus" in c for c in params["conversions"])
    hist = store.query(f"SELECT accepted, steps FROM accept_histogram WHERE run_id = {rid} ORDER BY accepted")
    assert hist.values.tolist() == [[0, 39], [1, 1], [3, 3]]


def test_vllm_detailed_stream_becomes_speclab_rounds(tmp_path):
    store, [rid] = imported(tmp_path, "vllm_detailed.sse")
    rounds = store.rounds(rid)
    per_step = [0, 1, 3, 0, 1, 2, 0, 3, 1, 0, 1, 0]
    assert rounds.n_accepted.tolist() == per_step and (rounds.n_drafted == 3).all()
    assert rounds.committed.tolist() == [a + 1 for a in per_step]  # each step commits its drafts and the bonus
    nodes = store.draft_nodes(rid)
    assert len(nodes) == 36 and nodes.groupby("round").accepted.sum().tolist() == per_step
    m = run_metrics(store, [rid]).iloc[0]
    assert m.tau == pytest.approx(2.0) and m.acceptance_rate == pytest.approx(1 / 3) and m.new_tokens == 25
    assert acceptance(store, rid) == [round(7 / 12, 6), round(3 / 12, 6), round(2 / 12, 6)]
    r = store.runs().iloc[0]
    assert r.output_text.startswith("def fib(n):") and r.target == "Qwen/Qwen3-8B"


def test_sglang_every_key_generation_and_choices(tmp_path):
    store, ids = imported(tmp_path, "sglang_generate.json", "sglang_openai_n2.json", "sglang_v0510.jsonl")
    m = run_metrics(store, ids).set_index("run_id")
    gen, c0, c1, old = ids
    # spec_accept_length 2.465 = completion_tokens / verify_ct: tau is recomputed as 1 + correct / verify_ct
    assert m.tau[gen] == pytest.approx(1 + 63 / 43) and m.acceptance_rate[gen] == pytest.approx(63 / 215)
    assert m.tau[c0] == pytest.approx(1 + 30 / 20) and m.tau[c1] == pytest.approx(1 + 20 / 25)
    assert m.tau[old] == pytest.approx(1 + 11 / 188)  # the <= 0.5.10 names
    runs = store.runs().set_index("run_id")
    assert json.loads(runs.params_json[old])["reported"]["spec_accept_length"] == pytest.approx(200 / 188)
    assert runs.source[c1].endswith("sglext.spec_tokens_details[1]") and runs.new_tokens[gen] == 106
    assert runs.new_tokens.isna()[c1]  # the usage of n = 2 choices is not one choice's
    assert acceptance(store, gen)[:2] == [round(32 / 43, 6), round(18 / 43, 6)]  # [11, 14, 11, 4, 0, 3]


def test_llamacpp_response_steps_are_derived_and_said_so(tmp_path):
    store, [rid] = imported(tmp_path, "llamacpp_completion.json")
    m = run_metrics(store, [rid]).iloc[0]
    steps = 200 - 1 - 65
    assert m.rounds == steps and m.tau == pytest.approx(1 + 65 / steps) and m.acceptance_rate == pytest.approx(65 / 347)
    params = json.loads(store.runs().params_json[0])
    assert any("derived" in c for c in params["conversions"]) and params["reported"]["draft_n"] == 347
    assert position_acceptance(store, [rid]).empty  # llama.cpp's response has no per-position figure


def test_aiperf_records_import_with_their_sparse_histogram(tmp_path, capsys):
    """AIPerf's per-request export: each record a run of the engine it measured; the sparse {accepted: steps}
    histogram with string keys read as counts; a failed request's line skipped and said so."""
    store, [vllm, lcpp] = imported(tmp_path, "aiperf_records.jsonl")
    assert "skipped 1 AIPerf line(s)" in capsys.readouterr().out
    m = run_metrics(store, [vllm, lcpp]).set_index("run_id")
    assert m.tau[vllm] == pytest.approx(1 + 278 / 128) and m.acceptance_rate[vllm] == pytest.approx(278 / 640)
    assert m.tau[lcpp] == pytest.approx(1 + 38 / 36) and m.acceptance_rate[lcpp] == pytest.approx(38 / 80)
    runs = store.runs().set_index("run_id")
    assert runs.engine[vllm] == "vllm" and runs.engine[lcpp] == "llama.cpp"
    assert runs.prompt_id[vllm] == "7609a2e7-aa53-4ab1-98f4-f35ecafefd25" and runs.new_tokens[vllm] == 407
    assert runs.elapsed_s[vllm] == pytest.approx(2.5) and runs.elapsed_s[lcpp] == pytest.approx(1.2)
    # k = 5 every step (640 = 5 x 128): the share of steps reaching each depth, from the sparse histogram
    hist = {0: 34, 1: 22, 2: 19, 3: 16, 4: 15, 5: 22}
    reached = [sum(c for j, c in hist.items() if j >= d) for d in range(6)]
    assert acceptance(store, vllm) == [round(reached[d] / 128, 6) for d in range(1, 6)]
    assert any("sparse" in c for c in json.loads(runs.params_json[vllm])["conversions"])


@pytest.mark.parametrize("engine,fixed", [("vllm", True), ("llamacpp", False)])
def test_prometheus_window_histogram_and_positions(tmp_path, engine, fixed):
    store, [rid] = imported(tmp_path, before=f"{engine}_metrics_before.prom", after=f"{engine}_metrics_after.prom")
    m = run_metrics(store, [rid]).iloc[0]
    steps, acc, surv = (60, 90, [48, 27, 15]) if fixed else (87, 167, [70, 55, 42])
    assert m.rounds == steps and m.tau == pytest.approx(1 + acc / steps)
    # the per-position counters are the survival over all steps: with fixed drafts that is speclab's figure
    assert acceptance(store, rid) == [round(s / steps, 6) for s in surv]
    hist = store.query(f"SELECT accepted, steps, drafted FROM accept_histogram WHERE run_id = {rid} ORDER BY accepted")
    assert hist.steps.tolist() == [steps - surv[0], surv[0] - surv[1], surv[1] - surv[2], surv[2]]
    assert hist.drafted.isna().all() != fixed  # varied draft lengths: no drafted count per step
    assert json.loads(store.runs().params_json[0])["scope"] == "server window"


def test_a_speclab_run_exported_in_vllm_shape_imports_to_its_own_figures(qwen3, qwen3_draft, tmp_path):
    """The mapping both ways: a traced sps chain run written as vLLM's detailed object (its rounds' accepted and
    drafted counts, the histogram by draft length) and imported back has the run's own tau, acceptance rate,
    histogram and per-position acceptance."""
    store = TraceStore(tmp_path / "t.duckdb")
    res = generate(qwen3, PROMPTS[3], "sps", models={"draft": qwen3_draft}, max_new_tokens=40, trace=store, k=3)
    store.drain()
    rounds = store.rounds(res.run_id)
    acc, dr = rounds.n_accepted.tolist(), rounds.n_drafted.tolist()
    by_len = {str(k): [sum(1 for a, d in zip(acc, dr) if d == k and a == j) for j in range(k + 1)] for k in set(dr)}
    hist = [sum(1 for a in acc if a == j) for j in range(4)]
    steps, accepted, drafted = len(acc), sum(acc), sum(dr)
    sd = {"mean_acceptance_length": 1 + accepted / steps, "draft_acceptance_rate": accepted / drafted,
          "acceptance_histogram": hist, "acceptance_histogram_by_draft_length": by_len, "num_spec_steps": steps,
          "num_accepted_draft_tokens": accepted, "num_draft_tokens": drafted, "num_spec_tokens": 3}
    for detailed in (False, True):
        obj = {"id": "x", "choices": [{"text": "t"}], "metrics": {"speculative_decoding": dict(sd)}}
        if detailed:
            obj["metrics"]["speculative_decoding"] |= {"per_step_accepted": acc, "per_step_drafted": dr}
        path = tmp_path / f"resp{int(detailed)}.json"
        path.write_text(json.dumps(obj))
        [rid] = write_runs(store, import_files([str(path)]))
        ours, theirs = run_metrics(store, [res.run_id]).iloc[0], run_metrics(store, [rid]).iloc[0]
        for col in ("rounds", "tau", "acceptance_rate"):
            assert theirs[col] == pytest.approx(ours[col]), col
        a, b = position_acceptance(store, [res.run_id]), position_acceptance(store, [rid])
        assert b.acceptance.tolist() == pytest.approx(a.acceptance.tolist())
        assert b.rounds_reaching.tolist() == a.rounds_reaching.tolist()
        h = store.query(f"SELECT run_id, accepted, sum(steps) AS n FROM accept_histogram WHERE run_id IN "
                        f"({res.run_id}, {rid}) GROUP BY ALL ORDER BY accepted")
        assert h[h.run_id == rid].n.tolist() == h[h.run_id == res.run_id].n.tolist()
    store.close()


def test_an_import_lands_whole_or_not_at_all(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    obj = json.loads((ENGINES / "vllm_summary.json").read_text())
    obj["metrics"]["speculative_decoding"]["acceptance_histogram"] = [38, 1, 0, 3]  # 42 steps of 43
    bad.write_text(json.dumps(obj))
    db = tmp_path / "t.duckdb"
    assert_one_error_line(["import", str(ENGINES / "sglang_generate.json"), str(bad), "--db", str(db)],
                          "acceptance_histogram holds 42 steps", capsys)
    assert not db.exists()  # read and checked before the trace was opened
    runs = import_files([str(ENGINES / "vllm_summary.json"), str(ENGINES / "llamacpp_completion.json")])
    with TraceStore(db) as s:
        broken = runs[1].tables
        runs[1].tables = lambda: {**broken(), "engine_totals": broken()["engine_totals"].append_column("nope", [[1]])}
        with pytest.raises(Exception, match="nope"):  # the second run's rows fail: the first is rolled back too
            write_runs(s, runs)
        assert s.runs().empty and s.query("SELECT * FROM engine_totals").empty


def _edited(tmp_path, name, edit):
    obj = json.loads((ENGINES / name).read_text())
    edit(obj)
    p = tmp_path / f"edited-{len(list(tmp_path.iterdir()))}-{name}"  # the cases are all made at once
    p.write_text(json.dumps(obj))
    return str(p)


def _vllm(key, value):
    def edit(o):
        o["metrics"]["speculative_decoding"][key] = value
    return edit


def _aiperf(tmp_path, edit):
    """The first line of data/engines/aiperf_records.jsonl with its record edited (None: the failed line alone)."""
    lines = (ENGINES / "aiperf_records.jsonl").read_text().splitlines()
    obj = json.loads(lines[0] if edit else lines[2])
    if edit:
        edit(obj["spec_decode_acceptance"])
    p = tmp_path / f"edited-{len(list(tmp_path.iterdir()))}-aiperf.jsonl"
    p.write_text(json.dumps(obj) + "\n")
    return str(p)


def _prom(tmp_path, name, old, new):
    p = tmp_path / f"edited-{len(list(tmp_path.iterdir()))}-{name}"
    p.write_text((ENGINES / name).read_text().replace(old, new))
    return str(p)


@pytest.mark.parametrize("case", ["not-json", "no-metrics", "vllm-null", "al-without-bonus", "rate-percent",
                                  "hist-bins", "per-step-length", "sglang-hist", "llamacpp-no-draft",
                                  "engine-mismatch", "wrong-order", "restart", "two-models", "model-absent",
                                  "no-steps", "before-alone", "nothing", "mixed-scrapes", "missing-file",
                                  "bad-compare", "model-without-scrapes", "empty-version", "aiperf-hist",
                                  "aiperf-key", "aiperf-rate-percent", "aiperf-engine", "aiperf-failed-only"])
def test_bad_import_is_one_line_and_writes_nothing(tmp_path, capsys, case):
    e = ENGINES
    vb, va = str(e / "vllm_metrics_before.prom"), str(e / "vllm_metrics_after.prom")
    lb = str(e / "llamacpp_metrics_before.prom")
    text = tmp_path / "notes.txt"
    text.write_text("hello\nworld\n")
    cases = {
        "not-json": ([str(text)], "line 1: not JSON"),
        "no-metrics": ([_edited(tmp_path, "vllm_summary.json", lambda o: o.pop("metrics"))],
                       "no speculative-decoding figures"),
        "vllm-null": ([_edited(tmp_path, "vllm_summary.json",
                               lambda o: o["metrics"].update(speculative_decoding=None))],
                      "metrics.speculative_decoding is null"),
        "al-without-bonus": ([_edited(tmp_path, "vllm_summary.json", _vllm("mean_acceptance_length", 10 / 43))],
                             "mean_acceptance_length = 0.232558"),
        "rate-percent": ([_edited(tmp_path, "vllm_summary.json", _vllm("draft_acceptance_rate", 7.75))],
                         "draft_acceptance_rate = 7.75"),
        "hist-bins": ([_edited(tmp_path, "vllm_summary.json", _vllm("num_spec_tokens", 4))],
                      "has 4 bins for num_spec_tokens = 4"),
        "per-step-length": ([_edited(tmp_path, "vllm_summary.json", _vllm("per_step_accepted", [1, 2]))],
                            "per_step_drafted is not a list of counts"),
        "sglang-hist": ([_edited(tmp_path, "sglang_generate.json",
                                 lambda o: o["meta_info"].update(spec_correct_drafts_histogram=[1, 2]))],
                        "the histogram holds 3 steps"),
        "llamacpp-no-draft": ([_edited(tmp_path, "llamacpp_completion.json", lambda o: o["timings"].pop("draft_n"))],
                              "timings has no draft_n"),
        "engine-mismatch": ([str(e / "vllm_summary.json"), "--engine", "sglang"], "no sglang speculative-decoding"),
        "wrong-order": (["--before", va, "--after", vb], "went down"),
        "restart": (["--before", vb, "--after", _prom(tmp_path, "vllm_metrics_after.prom", "1.7886160770693e+09",
                                                      "1.7886190000000e+09")], "the server restarted"),
        "two-models": (["--before", vb, "--after", _prom(tmp_path, "vllm_metrics_after.prom", 'position="2"} 40.0',
                                                         'position="2"} 40.0\nvllm:spec_decode_num_drafts_total{'
                                                         'engine="0",model_name="other"} 3.0')],
                       "counters of several models"),
        "model-absent": (["--before", vb, "--after", va, "--model", "nope"], "no counters of model 'nope'"),
        "no-steps": (["--before", vb, "--after", vb], "no speculative steps between"),
        "before-alone": (["--before", vb], "--before and --after go together"),
        "nothing": ([], "nothing to import"),
        "mixed-scrapes": (["--before", lb, "--after", va], "scrapes of different engines"),
        "missing-file": ([str(tmp_path / "absent.json")], "no such file"),
        "bad-compare": ([str(e / "vllm_summary.json"), "--compare", "7,x"], "--compare '7,x'"),
        "model-without-scrapes": ([str(e / "vllm_summary.json"), "--model", "m"], "--model picks the model"),
        "empty-version": ([str(e / "vllm_summary.json"), "--engine-version", " "], "--engine-version ' '"),
        "aiperf-hist": ([_aiperf(tmp_path, lambda r: r["acceptance_histogram"].update({"5": 21}))],
                        "the histogram holds 127 steps"),
        "aiperf-key": ([_aiperf(tmp_path, lambda r: r["acceptance_histogram"].update({"x": 1}))],
                       "has a key 'x', not an accepted count"),
        "aiperf-rate-percent": ([_aiperf(tmp_path, lambda r: r.update(draft_acceptance_rate=43.4375))],
                                "draft_acceptance_rate = 43.4375"),
        "aiperf-engine": ([_aiperf(tmp_path, lambda r: r.update(engine="mystery"))], "engine = 'mystery'"),
        "aiperf-failed-only": ([_aiperf(tmp_path, None)], "no run in it (1 AIPerf line(s) of failed requests"),
    }
    args, says = cases[case]
    db = tmp_path / "t.duckdb"
    assert_one_error_line(["import", *args, "--db", str(db)], says, capsys)
    assert not db.exists() or case == "bad-compare"
    if db.exists():  # --compare is checked against the trace: nothing was written to it
        with TraceStore(db, read_only=True) as s:
            assert s.runs().empty


def test_scrape_parser_refuses_what_is_not_exposition_text():
    from speclab.errors import InvalidInput
    with pytest.raises(InvalidInput, match="line 2: not a Prometheus sample"):
        prometheus.parse("# HELP x\nthis is not a sample line at all\n", "m.prom")
    s = prometheus.parse('a_total{x="1",y="q\\"z"} 3\nb 4.5e+01 1700000000\n', "m.prom")
    assert s == {("a_total", (("x", "1"), ("y", 'q\\"z'))): 3.0, ("b", ()): 45.0}


def test_imports_sit_beside_speclab_runs_in_one_trace(tmp_path):
    """Imported runs are runs of the trace like any other: listed with their engine (NULL for speclab's), read by
    the views the app's SQL box offers, and a second import adds to the first."""
    db = tmp_path / "t.duckdb"
    with TraceStore(db) as s:
        write_runs(s, import_files([str(ENGINES / "vllm_summary.json")]))
        write_runs(s, import_files([str(ENGINES / "llamacpp_completion.json")]))
        assert s.runs().engine.tolist() == ["vllm", "llama.cpp"]
        assert set(s.query("SELECT table_name FROM information_schema.tables").table_name) >= {
            "engine_totals", "engine_steps", "accept_histogram", "run_metrics", "position_acceptance"}
        df, _ = s.safe_query("SELECT engine, sum(steps) AS steps FROM engine_totals JOIN runs USING (run_id) "
                             "GROUP BY engine ORDER BY engine")
        assert df.values.tolist() == [["llama.cpp", 134], ["vllm", 43]]
