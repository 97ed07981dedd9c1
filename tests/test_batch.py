"""Batched serving (`speclab.core.batch`, `speclab.serve`): every request's output equals its single-stream decode
(greedy, and under sampling the same draws), one target forward per step, independent requests (a refused prompt,
a cancellation), the draft-length policies and their admission rule, the load generators and the serving metrics."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from helpers import PROMPTS
from speclab.core.batch import Batch, Done, Request
from speclab.core.engine import decode
from speclab.core.lean import Segment
from speclab.core.sampling import Sampling
from speclab.drafters.registry import build_drafter
from speclab.errors import InvalidInput
from speclab.metrics import serving_metrics
from speclab.serve.load import closed_loop, open_loop
from speclab.serve.policies import Fixed, NoDraft, StepCost, Table, admit, build_policy, parse_policy

NEW = 24


def encode(target, texts=PROMPTS):
    return [torch.tensor(target.tokenizer(t)["input_ids"]) for t in texts]


def single(target, ids, make, sampling):
    drafters = make()
    from speclab.core.protocol import FixedRouter
    return decode(target, ids, drafters, FixedRouter(next(iter(drafters), None)), NEW, sampling).new_ids


def test_forward_many_is_each_sequence_forwarded_alone(qwen3):
    """One forward over three sequences after their own caches (a chain, a tree row set, one row): each one's logits
    and features are its own forward's, and each cache grows by its rows."""
    ids = encode(qwen3)[:3]
    rows = [torch.tensor([5, 6, 7]), torch.tensor([9]), torch.tensor([3, 4])]

    def caches():
        out = []
        for x in ids:
            c = qwen3.new_cache(64)
            qwen3.forward(x, c)
            out.append(c)
        return out
    alone = [qwen3.forward(r, c, layers=(0, 1)) for r, c in zip(rows, caches())]
    cs = caches()
    calls = qwen3.calls
    many = qwen3.forward_many([Segment(r, c) for r, c in zip(rows, cs)], layers=(0, 1))
    assert qwen3.calls == calls + 1
    for a, b, c, x, r in zip(alone, many, cs, ids, rows):
        torch.testing.assert_close(b.logits, a.logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(b.features, a.features, atol=1e-4, rtol=1e-4)
        assert c.length == x.numel() + r.numel()


@pytest.mark.parametrize("name,sampling,slots", [
    ("ar", Sampling(), 2), ("pld", Sampling(), 2), ("sps", Sampling(), 2), ("sps", Sampling(0.8, seed=11), 1),
    ("pld", Sampling(1.0, seed=3), 1)], ids=["ar", "pld", "sps", "sps-T0.8", "pld-T1"])
def test_each_request_decodes_as_it_would_alone(qwen3, qwen3_draft, name, sampling, slots):
    """Four requests through the slots (continuous batching): every output is its single-stream decode's, token for
    token, with one target forward per step (fp32 greedy: two slots. Sampled: one slot, each request's own generator
    makes the same draws; with more, a draw within float rounding of a token's edge may pick its neighbour, so
    batched sampling is tested by its distribution below)."""
    make = (dict if name == "ar" else
            lambda: {name: build_drafter(name, qwen3, {"draft": qwen3_draft}, **({"k": 3} if name != "ar" else {}))})
    ids = encode(qwen3)
    batch = Batch(qwen3, make, Fixed(3), sampling, max_batch=slots)
    for i, x in enumerate(ids):
        assert batch.submit(Request(i, x, NEW))
    steps = []
    while not batch.idle:
        steps.append(batch.step())
    assert max(len(s.rids) for s in steps) == slots and all(s.target_calls == 1 for s in steps)
    for i, x in enumerate(ids):
        assert torch.equal(batch.done[i].new_ids, single(qwen3, x, make, sampling)), i
        assert batch.done[i].stopped in ("eos", "max_new_tokens")


def test_batched_sampling_keeps_the_target_distribution(tiny_vocab):
    """N_RUNS requests of one prompt, 16 at a time, each with its own seed, drafted by a sampled chain under the
    goodput policy (draft lengths chosen per step before verification): the first two tokens follow the target's
    exact joint (chi-square), drafts were really accepted, and the test has power (T = 0.7's joint is told apart)."""
    from test_sampling import N_RUNS, PLAIN, PROMPT, V, chi2_p, exact_joint, told_apart
    target, draft = tiny_vocab
    make = lambda: {"sps": build_drafter("sps", target, {"draft": draft}, k=2)}  # noqa: E731
    cost = StepCost(100.0, 0.01, 0.0)
    cost.learn = lambda ev: None  # a fixed cost: the draft lengths follow each request's past acceptance only, not
    # this machine's timing (a busy machine would make drafting look dear and leave the power check without drafts)
    batch = Batch(target, make, build_policy("goodput:k=2", cost), PLAIN, max_batch=16)
    for i in range(N_RUNS):
        batch.submit(Request(i, PROMPT, 3, seed=i))
    while not batch.idle:
        batch.step()
    counts = np.bincount([int(d.new_ids[0]) * V + int(d.new_ids[1]) for d in batch.done.values()], minlength=V * V)
    want = exact_joint(target, PROMPT, PLAIN)
    assert chi2_p(counts, want) > 1e-3
    assert sum(d.accepted for d in batch.done.values()) > N_RUNS // 2
    assert told_apart(exact_joint(target, PROMPT, Sampling(0.7)), want)


@pytest.mark.parametrize("name", ["eagle3", "dflash"])
def test_model_drafters_draft_for_the_whole_batch_in_one_call(deep, trained_eagle3, trained_dflash, name):
    """Drafters that read target layers: features come back per request from the batched forward, and every request
    decodes as alone. Their drafting is batched (counted): DFlash one call per step for all requests (the backlogs
    and the blocks), EAGLE-3 one per chain depth (the backlogs ride in the first), never one per request."""
    model = {"eagle3": trained_eagle3, "dflash": trained_dflash}[name]
    params = dict(depth=4, tree_topk=1, total_tokens=4) if name == "eagle3" else dict(block_size=5, markov=1)

    def make():
        return {name: build_drafter(name, deep, {name: model}, **params)}
    ids = encode(deep)
    batch = Batch(deep, make, Fixed(4), Sampling(), max_batch=4)
    for i, x in enumerate(ids):
        batch.submit(Request(i, x, NEW))
    steps = []
    while not batch.idle:
        steps.append(batch.step())
    for i, x in enumerate(ids):
        assert torch.equal(batch.done[i].new_ids, single(deep, x, make, Sampling())), i
    assert sum(d.accepted for d in batch.done.values()) > 0
    full = [s for s in steps if len(s.rids) == 4 and min(s.drafted) == 4]
    assert full and all(s.drafter_calls == (1 if name == "dflash" else 4) for s in full), \
        [(len(s.rids), s.drafted, s.drafter_calls) for s in steps]


def test_requests_are_independent(qwen3, qwen3_draft):
    """A prompt too long for the context is refused alone at submit; a request cancelled mid-decode leaves with the
    tokens it committed, marked cancelled; the others decode exactly as without them."""
    make = lambda: {"pld": build_drafter("pld", qwen3, {}, k=3)}  # noqa: E731
    ids = encode(qwen3)
    batch = Batch(qwen3, make, Fixed(3), Sampling(), max_batch=4)
    too_long = torch.zeros(qwen3.max_context, dtype=torch.long)
    assert not batch.submit(Request(99, too_long, NEW))
    assert batch.done[99].stopped.startswith("refused: prompt has")
    for i, x in enumerate(ids):
        batch.submit(Request(i, x, NEW))
    batch.step()
    batch.step()
    batch.cancel(1)
    while not batch.idle:
        batch.step()
    assert batch.done[1].stopped == "cancelled" and 0 < batch.done[1].new_ids.numel() < NEW
    assert torch.equal(batch.done[1].new_ids, single(qwen3, ids[1], make, Sampling())[: batch.done[1].new_ids.numel()])
    for i in (0, 2, 3):
        assert torch.equal(batch.done[i].new_ids, single(qwen3, ids[i], make, Sampling())), i


def test_a_drafter_with_round_hooks_or_a_router_is_refused(qwen3):
    class Hooked:
        name, layers = "hooked", ()

        def extra_rows(self, view):
            return None
    with pytest.raises(InvalidInput, match="round hooks"):
        Batch(qwen3, lambda: {"hooked": Hooked()}, Fixed(2))


def test_closed_loop_keeps_n_in_flight_and_open_loop_waits_for_arrivals(qwen3):
    make = lambda: {"pld": build_drafter("pld", qwen3, {}, k=2)}  # noqa: E731
    ids = encode(qwen3) * 2
    served = closed_loop(Batch(qwen3, make, Fixed(2), max_batch=8), ids, 3, NEW)
    assert max(len(s.rids) for s in served.steps) == 3 and len(served.dones) == 8
    assert all(d.first_s >= d.arrival_s and d.done_s >= d.first_s for d in served.dones)
    m = served.metrics
    assert m["requests"] == 8 and m["throughput_tok_s"] > 0 and m["ttft_p50_ms"] > 0
    opened = open_loop(Batch(qwen3, make, NoDraft(), max_batch=8), ids[:4], 50.0, 8, seed=1)
    arrivals = [d.arrival_s for d in opened.dones]
    assert arrivals == sorted(arrivals) and arrivals[-1] > arrivals[0]
    assert all(d.admitted_s >= d.arrival_s for d in opened.dones)


def test_serving_metrics_follow_their_definitions():
    """TTFT = first token - arrival; TPOT = (done - first) / (tokens - 1); throughput = tokens / makespan; ITL per token
    of each later round; unfinished requests are left out."""
    d = Done(0, torch.arange(5), "max_new_tokens", arrival_s=1.0, first_s=1.5, done_s=2.3, round_s=[1.5, 1.9, 2.3],
             round_tokens=[1, 2, 2])
    gone = Done(1, torch.arange(2), "cancelled", arrival_s=0.0)
    m = serving_metrics([d, gone], makespan_s=2.0)
    assert m["requests"] == 1 and m["output_tokens"] == 5
    assert math.isclose(m["throughput_tok_s"], 2.5)
    assert math.isclose(m["ttft_p50_ms"], 500.0) and math.isclose(m["tpot_p50_ms"], 200.0)
    assert math.isclose(m["per_user_tok_s"], 5.0) and math.isclose(m["itl_p50_ms"], 200.0)


def test_admission_adds_draft_tokens_only_while_goodput_rises():
    """DSpark's rule: free rows admit every likely token (in prefix order), a row that costs as much as a whole step
    admits none, and the order is by survival across requests."""
    surv = [[0.9, 0.81, 0.73], [0.5, 0.25, 0.125]]
    assert admit(surv, StepCost(10.0, 0.0, 0.0)) == [3, 3]
    assert admit(surv, StepCost(1.0, 10.0, 0.0)) == [0, 0]
    ks = admit(surv, StepCost(10.0, 1.0, 0.0))  # a row costs a tenth of a step: only tokens surviving > ~0.2 pay
    assert ks[0] >= ks[1] and ks[0] == 3 and 0 < ks[1] < 3


def test_policy_specs_are_checked_in_one_line():
    assert parse_policy("fixed:k=3") == ("fixed", {"k": 3})
    assert build_policy("table:1-2=4,3-8=1").k_at(5) == 1 and build_policy("table:1-2=4").k_at(3) == 0
    assert isinstance(build_policy("table"), Table)
    for bad, says in [("nope", "unknown policy"), ("fixed:k=-1", "fixed k must be"), ("fixed:k=x", "fixed k must be"),
                      ("fixed:depth=2", "no parameter 'depth'"), ("none:k=1", "takes no parameters"),
                      ("table:1-4=2,3-8=1", "overlaps"), ("table:4-1=2", "1 <= lo <= hi"), ("table:a=2", "lo-hi=k"),
                      ("goodput:alpha0=1.5", "alpha0 must be"), ("fixed:k", "not key=value")]:
        with pytest.raises(InvalidInput, match=says):
            parse_policy(bad)


@pytest.mark.slow
def test_serve_bench_prints_json_and_traces_every_request(tmp_path, capsys):
    """`speclab serve-bench --json` on the zoo: one object per (policy, concurrency) with the documented keys; in the
    trace every request is a run of its session (status done, serving times, one round per step it took part in),
    every step a row of `steps`, and each drafted request's greedy output equals AR's in the same serve (run_metrics'
    equality against the `none` policy's runs)."""
    import json

    from speclab.cli import main
    from speclab.trace import TraceStore
    db = tmp_path / "t.duckdb"
    rc = main(["serve-bench", "--limit", "1", "--max-new-tokens", "12", "--concurrency", "1,2", "--policy", "none",
               "--policy", "fixed:k=3", "--method", "pld", "--dtype", "fp32", "--json", "--db", str(db),
               "--report", str(tmp_path / "serve.md")])
    assert rc == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert sorted((r["policy"], r["concurrency"]) for r in rows) == [("fixed:k=3", 1), ("fixed:k=3", 2),
                                                                      ("none", 1), ("none", 2)]
    for r in rows:
        assert {"throughput_tok_s", "per_user_tok_s", "ttft_p50_ms", "tpot_p50_ms"} <= set(r) and r["requests"] == 4
    assert (tmp_path / "serve.html").exists()
    with TraceStore(db, read_only=True) as store:
        runs = store.query("SELECT r.*, m.ttft_ms, m.tpot_ms, m.equal_to_ar FROM runs r JOIN run_metrics m "
                           "USING (run_id) ORDER BY run_id")
        assert len(runs) == 16 and set(runs.status) == {"done"} and runs.decode_group.nunique() == 4
        assert (runs.ttft_ms > 0).all() and (runs.tpot_ms > 0).all()
        assert set(runs[runs.method == "ar"].drafters.isna()) == {True}
        assert (runs[runs.method == "pld"].equal_to_ar == 1.0).all()
        per_run = store.query("SELECT run_id, count(*) AS n, count(DISTINCT step) AS steps FROM rounds GROUP BY ALL")
        assert (per_run.n == per_run.steps).all()
        steps = store.query("SELECT session, sum(requests) AS req, count(*) AS n FROM steps GROUP BY ALL")
        assert len(steps) == 4 and set(steps.session) == set(runs.decode_group)
        rounds = store.query("SELECT count(*) AS n FROM rounds").n[0]
        assert rounds == steps.req.sum()  # every request's round of every step it was in


def test_a_closed_batch_leaves_its_requests_cancelled_in_the_trace(qwen3, tmp_path):
    """A client gone mid-serve (the app's page closed): `close` ends every request in flight and every one still
    waiting, each a run marked cancelled with what it committed; the steps so far are in `steps`."""
    from speclab.serve.record import ServeRecorder
    from speclab.trace import TraceStore
    ids = encode(qwen3)
    with TraceStore(tmp_path / "t.duckdb") as store:
        rec = ServeRecorder(store, qwen3.tokenizer, "s1", "fixed:k=2",
                            lambda st: dict(method="pld", prompt_tokens=st.req.prompt_ids.numel()))
        batch = Batch(qwen3, lambda: {"pld": build_drafter("pld", qwen3, {}, k=2)}, Fixed(2), max_batch=2,
                      recorder=rec)
        for i, x in enumerate(ids):
            batch.submit(Request(i, x, NEW))
        batch.step()
        batch.step()
        batch.close()
        rec.flush()
        assert batch.idle and {d.stopped for d in batch.done.values()} == {"cancelled"}
        runs = store.query("SELECT status, new_tokens, decode_group FROM runs ORDER BY run_id")
        assert list(runs.status) == ["cancelled", "cancelled"]  # the two admitted; the waiting two never ran
        assert (runs.new_tokens >= 2).all() and set(runs.decode_group) == {"s1"}
        assert store.query("SELECT count(*) AS n FROM steps WHERE session = 's1'").n[0] == 2
