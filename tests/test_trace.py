"""Trace store: round trip, per-round consistency, crash safety, foreign and locked files."""
import subprocess
import sys

import numpy as np
import pytest

from helpers import PROMPTS
from speclab.errors import TraceError
from speclab.generate import generate
from speclab.trace import SCHEMA_VERSION, TraceStore


@pytest.fixture
def store(tmp_path):
    s = TraceStore(tmp_path / "t.duckdb")
    yield s
    s.close()


def test_round_trip_every_token_with_its_position(qwen3, store):
    res = generate(qwen3, PROMPTS[0], "ar", max_new_tokens=20, trace=store)
    runs = store.runs()
    assert runs.status.tolist() == ["done"] and runs.new_tokens[0] == 20 and runs.schema_version[0] == SCHEMA_VERSION
    toks = store.tokens(res.run_id)
    assert toks.token_id.tolist() == res.token_ids and toks.pos.tolist() == list(range(20))
    assert (toks.source == "target").all() and toks.target_prob.between(0, 1).all() and (toks.entropy >= 0).all()
    assert "".join(toks.text) == qwen3.tokenizer.decode(res.token_ids)


@pytest.mark.parametrize("method,params", [("sps", {"k": 3}), ("sps", {"k": 3, "tree_topk": 2}), ("pld", {"k": 4})])
def test_rounds_agree_with_draft_nodes_and_tokens(qwen3, qwen3_draft, store, method, params):
    res = generate(qwen3, PROMPTS[3], method, models={"draft": qwen3_draft}, max_new_tokens=30, trace=store, **params)
    rid = res.run_id
    per_round = store.query("""
        SELECT r.round, r.n_accepted, r.n_drafted, r.committed,
               (SELECT count(*) FROM draft_nodes d
                WHERE d.run_id = r.run_id AND d.round = r.round AND d.accepted) AS acc_nodes,
               (SELECT count(*) FROM draft_nodes d WHERE d.run_id = r.run_id AND d.round = r.round) AS nodes,
               (SELECT count(*) FROM tokens t WHERE t.run_id = r.run_id AND t.round = r.round) AS toks
        FROM rounds r WHERE r.run_id = ? ORDER BY r.round""", [rid])
    assert (per_round.n_accepted == per_round.acc_nodes).all()
    assert (per_round.n_drafted == per_round.nodes).all() and (per_round.committed == per_round.toks).all()
    assert per_round.committed.sum() == len(res.token_ids) == len(store.tokens(rid))
    toks = store.tokens(rid)
    assert toks.token_id.tolist() == res.token_ids
    drafted = toks[toks.source == method]
    assert (drafted.depth >= 1).all() and len(drafted) == per_round.n_accepted.sum()
    dec = store.router_decisions(rid)  # every round's decision, and the run names the policy
    assert dec["round"].tolist() == per_round["round"].tolist() and set(dec.policy) == {"fixed"}
    assert set(dec.choice) == {method} and store.runs().router.tolist()[-1] == "fixed"


def test_failed_run_is_marked_and_earlier_runs_survive(qwen3, store):
    ok = generate(qwen3, PROMPTS[0], "ar", max_new_tokens=10, trace=store)

    def boom(ev):
        if ev.round == 3:
            raise RuntimeError("simulated crash")
    with pytest.raises(RuntimeError):
        generate(qwen3, PROMPTS[1], "ar", max_new_tokens=10, trace=store, on_round=boom)
    runs = store.runs()
    assert runs.status.tolist() == ["done", "failed"] and "simulated crash" in runs.error[1]
    assert store.tokens(ok.run_id).token_id.tolist() == ok.token_ids


@pytest.mark.slow
def test_killed_process_leaves_earlier_runs_readable(tmp_path, model_dir):
    """A process killed mid-run: earlier runs are intact, the cut run is marked interrupted on the next open."""
    db = tmp_path / "k.duckdb"
    script = f"""
import os, torch
from speclab import Target, TraceStore, generate
t = Target.load({str(model_dir['qwen3'])!r}, dtype='fp32')
s = TraceStore({str(db)!r}, flush_rounds=32)
generate(t, "hello there", "ar", max_new_tokens=8, trace=s)
def kill(ev):
    if ev.round == 70:
        s.drain()  # the flushes queued so far have landed (the writer thread inserts them in the background)
        os._exit(9)  # no cleanup at all, like a SIGKILL
generate(t, "second run", "ar", max_new_tokens=100, trace=s, on_round=kill)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 9, r.stderr
    s = TraceStore(db)
    runs = s.runs()
    assert runs.status.tolist() == ["done", "interrupted"]
    assert len(s.tokens(int(runs.run_id[0]))) == 8
    cut = s.tokens(int(runs.run_id[1]))
    assert 32 <= len(cut) == len(s.rounds(int(runs.run_id[1]))) <= 70  # whole flushed rounds only, nothing torn
    assert cut.pos.tolist() == list(range(len(cut)))
    s.close()


def test_foreign_file_is_refused_and_untouched(tmp_path):
    f = tmp_path / "notes.duckdb"
    f.write_bytes(b"these are my notes, not a database\n" * 50)
    before = f.read_bytes()
    with pytest.raises(TraceError, match="not a DuckDB database"):
        TraceStore(f)
    assert f.read_bytes() == before


def test_foreign_duckdb_is_refused_and_untouched(tmp_path):
    import duckdb
    f = tmp_path / "other.duckdb"
    c = duckdb.connect(str(f))
    c.execute("CREATE TABLE sales (x INT)")
    c.close()
    before = f.read_bytes()
    with pytest.raises(TraceError, match="not a speclab trace"):
        TraceStore(f)
    assert f.read_bytes() == before


def test_locked_file_gives_clear_error(tmp_path):
    db = tmp_path / "locked.duckdb"
    TraceStore(db).close()
    holder = subprocess.Popen([sys.executable, "-c", f"import duckdb, sys, time; c = duckdb.connect({str(db)!r}); "
                               "print('ready', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(TraceError, match="locked by another process"):
            TraceStore(db)
    finally:
        holder.kill()
        holder.wait()


def test_metrics_from_sql_match_the_decode(qwen3, qwen3_draft, store):
    from speclab.metrics import position_acceptance, run_metrics, run_summary
    res = generate(qwen3, PROMPTS[2], "sps", models={"draft": qwen3_draft}, k=3, max_new_tokens=30, trace=store)
    ar = generate(qwen3, PROMPTS[2], "ar", max_new_tokens=30, trace=store)
    m = run_metrics(store).set_index("run_id")
    d = res.decode
    assert m.loc[res.run_id, "tau"] == pytest.approx(len(res.token_ids) / d.rounds)
    assert m.loc[res.run_id, "target_calls_per_token"] == pytest.approx(d.target_calls / len(res.token_ids))
    assert m.loc[ar.run_id, "tau"] == pytest.approx(1.0)
    assert m.loc[ar.run_id, "acceptance_rate"] != m.loc[ar.run_id, "acceptance_rate"]  # NaN: AR drafts nothing
    drafted = store.rounds(res.run_id)
    assert m.loc[res.run_id, "acceptance_rate"] == pytest.approx(drafted.n_accepted.sum() / drafted.n_drafted.sum())
    pa = position_acceptance(store, [res.run_id])
    assert pa.depth.tolist() == [1, 2, 3] and (pa.acceptance.diff().dropna() <= 0).all()  # a chain: monotone
    nodes = store.draft_nodes(res.run_id)  # per depth: rounds with an accepted node there / rounds reaching it
    want = [g[g.accepted]["round"].nunique() / g["round"].nunique() for _, g in nodes.groupby("depth")]
    assert pa.acceptance.tolist() == pytest.approx(want) and want[0] > 0 and len(set(want)) > 1
    assert set(run_summary(store).method) == {"ar", "sps"}
    assert len(store.query("SELECT * FROM run_metrics")) == 2  # the same SQL as a view in the file


def test_safe_query_is_read_only_capped_and_stoppable(qwen3, tmp_path):
    s = TraceStore(tmp_path / "q.duckdb")
    generate(qwen3, PROMPTS[0], "ar", max_new_tokens=12, trace=s)
    df, truncated = s.safe_query("SELECT pos, text FROM tokens ORDER BY pos", max_rows=5)
    assert len(df) == 5 and truncated and list(df.columns) == ["pos", "text"]
    for bad, msg in [("DROP TABLE tokens", "single read-only SELECT"),
                     ("SELECT 1; DELETE FROM runs", "single read-only SELECT"),
                     ("UPDATE runs SET status = 'x'", "single read-only SELECT"), ("SELEC oops", "invalid SQL"),
                     ("SELECT * FROM read_csv('/etc/passwd')", "query failed"),
                     ("SELECT * FROM 'http://example.com/x.csv'", "query failed"),
                     ("ATTACH '/tmp/other.db'", "single read-only SELECT"), ("", "empty")]:
        with pytest.raises(TraceError, match=msg):
            s.safe_query(bad)
    with pytest.raises(TraceError, match="stopped after"):
        s.safe_query("SELECT count(*) FROM range(100000000000)", timeout_s=0.5)
    assert len(s.tokens(1)) == 12 and s.runs().status.tolist() == ["done"]  # nothing changed
    generate(qwen3, PROMPTS[1], "ar", max_new_tokens=4, trace=s)  # and tracing still works after lock-down
    assert len(s.runs()) == 2
    s.close()


def test_eos_inside_accepted_drafts_cuts_the_accepted_nodes_too(qwen3, model_dir, store):
    """A draft equal to the target has every token accepted; an EOS in the middle of a round's drafts ends the
    run there, and the trace's accepted nodes, accept lengths and per-position acceptance stop there too."""
    from speclab.core.target import Target
    same = Target.load(model_dir["qwen3"], dtype="fp32")
    ref = generate(qwen3, PROMPTS[1], "ar", max_new_tokens=12).token_ids
    cut = next(i for i in range(1, 4) if ref[i] not in ref[:i])  # a token first generated inside round 0's drafts
    qwen3.eos_ids = [ref[cut]]
    try:
        res = generate(qwen3, PROMPTS[1], "sps", models={"draft": same}, k=4, max_new_tokens=12, trace=store)
    finally:
        qwen3.eos_ids = [0]
    assert res.token_ids == ref[: cut + 1] and res.decode.stopped == "eos" and res.decode.rounds == 1
    nodes = store.draft_nodes(res.run_id)
    rounds = store.rounds(res.run_id)
    toks = store.tokens(res.run_id)
    assert len(nodes) == 4 and nodes.accepted.sum() == cut + 1 == rounds.n_accepted[0] == (toks.source == "sps").sum()
    pa = store.query("SELECT depth, acceptance FROM position_acceptance WHERE run_id = ? ORDER BY depth", [res.run_id])
    assert pa.acceptance.tolist() == [1.0] * (cut + 1) + [0.0] * (3 - cut)


def test_a_generation_writes_its_run_row_only_when_it_starts(qwen3, store):
    """Building Generations side by side writes nothing: a column refused while it is built (here its drafter's
    model is missing) leaves no row of the columns built before it; the row appears with the decode's first step."""
    from speclab.errors import SpeclabError
    from speclab.generate import Generation
    before = len(store.query("SELECT run_id FROM runs"))
    first = Generation(qwen3, PROMPTS[0], "ar", max_new_tokens=4, trace=store)
    with pytest.raises(SpeclabError):
        Generation(qwen3, PROMPTS[0], "sps", max_new_tokens=4, trace=store)  # no draft model given
    assert first.run_id is None and len(store.query("SELECT run_id FROM runs")) == before
    it = iter(first)
    next(it)
    assert first.run_id is not None
    assert store.query("SELECT status FROM runs WHERE run_id = ?", [first.run_id]).status[0] == "running"
    for _ in it:
        pass
    assert store.query("SELECT status FROM runs WHERE run_id = ?", [first.run_id]).status[0] == "done"


def test_interleaved_runs_count_only_their_own_time(qwen3, qwen3_draft, store):
    """Two runs decoded round by round in turn, with the consumer holding each round for 30 ms (as the app
    does while it renders): each run's decode time is its prefill + its own phases (+ the final trace flush),
    and the metrics' tokens/s is computed from that, not from the wall time."""
    import time

    from speclab.generate import Generation
    from speclab.metrics import run_metrics, tokens_per_s
    gens = [Generation(qwen3, PROMPTS[0], "sps", models={"draft": qwen3_draft}, k=3, max_new_tokens=24, trace=store),
            Generation(qwen3, PROMPTS[1], "ar", max_new_tokens=24, trace=store)]
    iters = [iter(g) for g in gens]
    held = 0.0
    while iters:
        for it in list(iters):
            try:
                next(it)
            except StopIteration:
                iters.remove(it)
                continue
            time.sleep(0.03)
            held += 0.03
    m = run_metrics(store).set_index("run_id")
    for g in gens:
        rid, d = g.run_id, g.result.decode
        run = store.query("SELECT * FROM runs WHERE run_id = ?", [rid]).iloc[0]
        own_ms = run.prefill_ms + store.query("""SELECT sum(t_route_ms + t_catchup_ms + t_draft_ms + t_verify_ms +
                                                 t_commit_ms + t_record_ms) AS s FROM rounds WHERE run_id = ?""",
                                              [rid]).s[0]
        flush_ms = run.elapsed_s * 1e3 - own_ms
        assert 0 <= flush_ms < 50  # the trace's last batch is all that is added
        assert run.elapsed_s == pytest.approx(g.result.elapsed_s) and run.wall_s > run.elapsed_s + 0.5 * held
        assert m.loc[rid, "tokens_per_s"] == pytest.approx(tokens_per_s(run.new_tokens, run.elapsed_s))
        assert g.result.tokens_per_s == pytest.approx(m.loc[rid, "tokens_per_s"])
        assert d.elapsed_s * 1e3 == pytest.approx(own_ms, rel=1e-6)


@pytest.mark.parametrize("params", [{"k": 3}, {"k": 3, "tree_topk": 2}, {"k": 4, "deferred": False}])
def test_token_probabilities_equal_a_full_forward(qwen3, qwen3_draft, store, params):
    """Every committed token's target prob and entropy in the trace (derived from the verification rows)
    equal the target's softmax at that position in one full forward over the final sequence."""
    import torch

    from speclab.generate import encode_prompt
    res = generate(qwen3, PROMPTS[0], "sps", models={"draft": qwen3_draft}, max_new_tokens=30, trace=store, **params)
    prompt = encode_prompt(qwen3, PROMPTS[0])
    seq = torch.cat([prompt, torch.tensor(res.token_ids)])
    logp = torch.log_softmax(qwen3.forward(seq, qwen3.new_cache()).logits, -1)[prompt.numel() - 1 : -1].cpu()
    toks = store.tokens(res.run_id)
    want_p = logp.gather(1, torch.tensor(res.token_ids)[:, None])[:, 0].exp()
    want_h = -(logp.exp() * logp).sum(-1)
    assert torch.allclose(torch.tensor(toks.target_prob.to_numpy()).float(), want_p, atol=1e-4)
    assert torch.allclose(torch.tensor(toks.entropy.to_numpy()).float(), want_h, atol=1e-3)
    assert (toks.depth == toks.groupby("round").cumcount() + 1).all()
    assert toks[toks.source == "target"].draft_prob.isna().all() and toks[toks.source == "sps"].draft_prob.notna().all()


def test_a_failed_background_write_is_reported_not_lost(qwen3, store, monkeypatch):
    """Bulk appends run on the trace's writer thread; if one fails, the next call on the store says so."""
    def boom(tables):
        raise OSError("disk full (simulated)")
    monkeypatch.setattr(store, "_append_now", boom)
    with pytest.raises(TraceError, match="disk full"):  # from the run's own end, or the next read
        generate(qwen3, PROMPTS[0], "ar", max_new_tokens=6, trace=store)
        store.runs()
    monkeypatch.undo()
    res = generate(qwen3, PROMPTS[0], "ar", max_new_tokens=6, trace=store)  # the store goes on working
    assert store.tokens(res.run_id).token_id.tolist() == res.token_ids


def _slow_failing_rows(store, monkeypatch) -> list[int]:
    """The store's bulk inserts, those of the first run appended failing in DuckDB itself (a column the table
    lacks) after 0.3 s: still being written when the run's end is queued and the next run starts, as on a slow
    disk. -> [that run's id], once known."""
    import time

    import pyarrow as pa

    from speclab.trace import to_arrow
    real, bad = store._append_now, []

    def append(tables):
        tables = {k: to_arrow(t) if isinstance(t, dict) else t for k, t in tables.items()}  # a run writer's columns
        run = next(t.column("run_id")[0].as_py() for t in tables.values() if t.num_rows)
        bad[:] = bad or [run]
        if run == bad[0]:
            time.sleep(0.3)
            tables = {k: t.append_column("bogus", pa.array([1] * t.num_rows)) for k, t in tables.items()}
        real(tables)
    monkeypatch.setattr(store, "_append_now", append)
    return bad


def test_a_failed_write_is_raised_to_its_own_run_not_the_next(tmp_path, monkeypatch):
    """A run's rows that fail on the writer thread after its end was queued: its own finish_run raises it and the
    run is `failed` with DuckDB's reason; the next run is written whole and `done` (not blamed)."""
    import pandas as pd
    import pyarrow as pa

    def tokens(run, n):
        return {"tokens": pa.table({"run_id": pa.array([run] * n, pa.int64()), "pos": pa.array(range(n), pa.int32()),
                                    "token_id": pa.array(range(n), pa.int32())})}
    with TraceStore(tmp_path / "t.duckdb") as s:
        first = s.start_run(method="ar", prompt_id="a")
        assert _slow_failing_rows(s, monkeypatch) == []
        s.append(tokens(first, 5), run_id=first)
        s.append(tokens(first, 3), run_id=first)  # queued behind the failing batch: dropped
        with pytest.raises(TraceError, match="bogus"):
            s.finish_run(first, "done", new_tokens=8)
        second = s.start_run(method="ar", prompt_id="b")
        s.append(tokens(second, 4), run_id=second)
        s.finish_run(second, "done", new_tokens=4)
        runs = s.runs().set_index("run_id")
        assert runs.loc[first, "status"] == "failed" and "bogus" in runs.loc[first, "error"]
        assert runs.loc[second, "status"] == "done" and pd.isna(runs.loc[second, "error"])
        assert len(s.tokens(first)) == 0 and s.tokens(second).pos.tolist() == [0, 1, 2, 3]
    with TraceStore(tmp_path / "t.duckdb") as s:  # the file opens cleanly, nothing left running
        assert s.runs().status.tolist() == ["failed", "done"]


def test_generate_blames_the_run_whose_rows_failed(qwen3, store, monkeypatch):
    """The same through `generate`: the run whose last batch fails raises from its own call, marked `failed`;
    the next run, decoded at once, is `done` with every token."""
    bad = _slow_failing_rows(store, monkeypatch)
    with pytest.raises(TraceError, match="bogus"):
        generate(qwen3, PROMPTS[0], "ar", max_new_tokens=6, trace=store)
    res = generate(qwen3, PROMPTS[1], "ar", max_new_tokens=6, trace=store)
    got = store.runs().set_index("run_id")
    assert bad != [res.run_id] and got.status.tolist() == ["failed", "done"] and "bogus" in got.loc[bad[0], "error"]
    assert got.loc[res.run_id, "status"] == "done" and store.tokens(res.run_id).token_id.tolist() == res.token_ids


def test_eager_is_a_column_written_by_the_run_and_migrated(qwen3, tmp_path):
    """`runs.eager` says whether the run's router caught every drafter up every round (what replay, the switch
    table and lazy-vs-eager read); a schema-4 trace opened for writing gets the column, filled from its runs'
    parameters, and is refused read-only until then."""
    import duckdb

    with TraceStore(tmp_path / "new.duckdb") as s:
        generate(qwen3, PROMPTS[0], "ar", max_new_tokens=4, trace=s)
        assert s.runs().eager.tolist() == [False]
    old = tmp_path / "old.duckdb"
    with TraceStore(old) as s:
        for method, params in (("whiflash-entropy:eager=1", '{"eager": 1, "threshold": 1.0}'),
                               ("whiflash-entropy", '{"eager": 0, "threshold": 1.0}'), ("ar", "{}")):
            s.execute("INSERT INTO runs (run_id, method, params_json, status) VALUES (nextval('run_id_seq'), ?, ?, "
                      "'done')", [method, params])
    con = duckdb.connect(str(old))  # back to schema 4: no eager column
    con.execute("ALTER TABLE runs DROP COLUMN eager")
    con.execute("ALTER TABLE draft_nodes DROP COLUMN block")  # and schema 6's node columns
    con.execute("ALTER TABLE draft_nodes DROP COLUMN bucket")
    con.execute("ALTER TABLE draft_nodes DROP COLUMN in_cands")  # and schema 7's
    for col in ("engine", "engine_version", "source"):  # and schema 8's (imported runs)
        con.execute(f"ALTER TABLE runs DROP COLUMN {col}")
    for table, col in (("draft_nodes", "sampled_p"), ("draft_nodes", "sampled_q"), ("tokens", "accept_prob")):
        con.execute(f"ALTER TABLE {table} DROP COLUMN {col}")  # and schema 9's (sampled decoding)
    con.execute("ALTER TABLE runs DROP COLUMN decode_group")  # and schema 10's
    for table, col in (("runs", "arrival_s"), ("runs", "first_token_s"), ("runs", "done_s"), ("rounds", "step"),
                       ("rounds", "t_s")):
        con.execute(f"ALTER TABLE {table} DROP COLUMN {col}")  # and schema 11's (batched serving)
    con.execute("DROP TABLE steps")
    for table, col in (("runs", "node"), ("runs", "worker"), ("benches", "cluster"), ("benches", "retries")):
        con.execute(f"ALTER TABLE {table} DROP COLUMN {col}")  # and schema 12's (benches on Ray)
    con.execute("UPDATE meta SET value = '4' WHERE key = 'schema_version'")
    con.close()
    with pytest.raises(TraceError, match="older than this speclab's"):
        TraceStore(old, read_only=True)
    with TraceStore(old) as s:
        runs = s.query("SELECT method, eager FROM runs ORDER BY run_id")
        nodes = s.query("SELECT block, bucket, in_cands, sampled_p, sampled_q FROM draft_nodes")  # back (empty)
        engines = s.query("SELECT engine, engine_version, source FROM runs")
        s.query("SELECT accept_prob FROM tokens")
        groups = s.query("SELECT decode_group FROM runs")  # older runs: each decoded alone
        assert s.decoded_with(1) == [1]
        served = s.query("SELECT ttft_ms, tpot_ms, itl_p50_ms FROM run_metrics")  # not served: NULL
        assert s.query("SELECT count(*) AS n FROM steps").n[0] == 0
        where = s.query("SELECT node, worker FROM runs")  # decoded in one process: NULL
        s.query("SELECT cluster, retries FROM benches")
    assert served.isna().all().all()
    assert runs.eager.tolist() == [True, False, False] and SCHEMA_VERSION == 12 and list(nodes.columns) == [
        "block", "bucket", "in_cands", "sampled_p", "sampled_q"] and engines.engine.isna().all()
    assert groups.decode_group.isna().all() and where.isna().all().all()


@pytest.mark.parametrize("tree_topk", [1, 2])
def test_sampled_runs_keep_p_and_q_of_every_node(qwen3, qwen3_draft, tmp_path, tree_topk):
    """Under sampling every draft node keeps p(x) and q(x) as verification tested it (q: the drafter's at its
    draft_temp; a sampled chain's and a sampled tree's), every accepted draft token its acceptance probability
    min(1, p / q) and the run its chain verification rule; a greedy run keeps none of them; the app's token spans
    show it (`viz.token_spans`)."""
    from speclab import viz

    with TraceStore(tmp_path / "t.duckdb") as store:
        res = generate(qwen3, PROMPTS[2], "sps", models={"draft": qwen3_draft}, k=3, tree_topk=tree_topk,
                       draft_temp=0.8, max_new_tokens=30, temperature=1.0, seed=4, trace=store)
        greedy = generate(qwen3, PROMPTS[2], "sps", models={"draft": qwen3_draft}, k=3, tree_topk=tree_topk,
                          max_new_tokens=10, trace=store)
        nodes = store.query("SELECT * FROM draft_nodes WHERE run_id = ?", [res.run_id])
        toks = store.query("SELECT * FROM tokens WHERE run_id = ? ORDER BY pos", [res.run_id])
        assert store.query("SELECT count(sampled_p) + count(sampled_q) AS n FROM draft_nodes WHERE run_id = ?",
                           [greedy.run_id]).n[0] == 0
        assert store.query("SELECT count(accept_prob) AS n FROM tokens WHERE run_id = ?", [greedy.run_id]).n[0] == 0
        rule = store.query("SELECT json_extract_string(params_json, '$.chain_verify') AS r FROM runs ORDER BY run_id").r
        assert rule[0] == "block" and rule.isna()[1]  # how the sampled run's chains were verified (greedy: none)
    assert nodes.sampled_p.between(0, 1).all() and nodes.sampled_q.between(0, 1, inclusive="right").all()
    assert (nodes.sampled_q == nodes.draft_prob).all()  # q(x) as drawn: the drafter's tempered, not its T = 1 softmax
    acc = nodes[nodes.accepted].sort_values(["round", "depth"])
    drafted = toks[toks.source == "sps"]
    assert len(drafted) == len(acc) > 0 and toks[toks.source == "target"].accept_prob.isna().all()
    want = np.minimum(1.0, acc.sampled_p.to_numpy() / acc.sampled_q.to_numpy())
    np.testing.assert_allclose(drafted.accept_prob.to_numpy(), want, rtol=1e-6)
    spans = viz.token_spans({c: toks[c].tolist() for c in (*viz.TOKEN_COLUMNS, "accept_prob")})
    assert sum("accepted with probability" in s for s in spans) == len(drafted)


def test_merged_runs_get_new_ids_and_a_failed_merge_leaves_the_trace_as_it_was(qwen3, tmp_path):
    """`merge_runs` (a cluster's workers' runs): every part's runs land with new ids, their rows following them; a
    part that cannot land (a row of a run it does not hold) rolls the whole merge back, the bench row too."""
    with TraceStore(":memory:") as w:
        generate(qwen3, PROMPTS[0], "sps", models={"draft": qwen3}, max_new_tokens=8, trace=w, k=3)
        part = w.export_runs()
    assert {"runs", "rounds", "tokens", "draft_nodes"} <= set(part) and part["runs"].num_rows == 1
    with TraceStore(tmp_path / "t.duckdb") as s:
        generate(qwen3, PROMPTS[0], "ar", max_new_tokens=4, trace=s)
        ids = s.merge_runs([part, part], {"bench_id": "b", "status": "done"})
        assert ids == [2, 3] and s.query("SELECT status FROM benches").status.tolist() == ["done"]
        for rid in ids:
            assert len(s.tokens(rid)) == 8 and s.rounds(rid).committed.sum() == 8
        before = {t: s.query(f"SELECT count(*) AS n FROM {t}").n[0] for t in ("runs", "rounds", "tokens", "benches")}
        import pyarrow as pa
        bad = dict(part, tokens=part["tokens"].set_column(0, "run_id", pa.array([99] * part["tokens"].num_rows)))
        with pytest.raises(TraceError, match="a run the part does not have"):
            s.merge_runs([part, bad], {"bench_id": "c", "status": "done"})
        assert before == {t: s.query(f"SELECT count(*) AS n FROM {t}").n[0] for t in before}


def test_a_run_writers_columns_become_arrow_with_their_nulls(qwen3, qwen3_draft, store):
    """A flush hands numpy columns to the writer thread (`Column`, `to_arrow`): NaN floats and masked integers land
    as NULL, object arrays as strings, None as NULL; through a decode, a single-stream run's rounds have no batch
    step and its nodes none of SpecBlock's or FlashHead's extras, while its drafted tokens keep their values."""
    import pyarrow as pa

    from speclab.trace import Column, to_arrow
    t = to_arrow({"x": np.arange(3), "f": Column(np.array([0.5, np.nan, 1.0]), np.array([False, True, False])),
                  "i": Column(np.array([4, -1, 2], np.int32), np.array([False, True, False]), pa.int32()),
                  "s": Column(np.array(["a", None, "c"], object), type=pa.string()),
                  "n": Column([None, 2, None], type=pa.int32())})
    assert t.to_pydict() == {"x": [0, 1, 2], "f": [0.5, None, 1.0], "i": [4, None, 2], "s": ["a", None, "c"],
                             "n": [None, 2, None]}
    assert t.schema.field("i").type == pa.int32() and t.schema.field("s").type == pa.string()
    res = generate(qwen3, PROMPTS[0], "sps", models={"draft": qwen3_draft}, max_new_tokens=12, trace=store)
    nodes = store.query("SELECT block, bucket, in_cands, token_id, depth FROM draft_nodes WHERE run_id = ?",
                        [res.run_id])
    rounds = store.rounds(res.run_id)
    assert len(nodes) > 0 and nodes[["block", "bucket", "in_cands"]].isna().all().all()
    assert nodes[["token_id", "depth"]].notna().all().all() and (nodes.depth >= 1).all()
    assert rounds.step.isna().all() and rounds.t_s.isna().all() and (rounds.drafter == "sps").all()
