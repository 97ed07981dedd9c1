"""What the app's run pages read from a trace (`TraceStore.run`, `run_ids`, `run_list`, `decoded_with`, `rounds_of`,
`tokens_with_decisions`, `phase_ms`, `text_before`, `round_drafter`), each run against a real DuckDB trace with a
few runs of the tiny Qwen3."""
import pytest

from helpers import PROMPTS
from speclab.core.engine import PHASES
from speclab.generate import generate
from speclab.trace import TraceStore


@pytest.fixture(scope="module")
def trace(qwen3, qwen3_draft, tmp_path_factory):
    """Four runs: AR and sps decoded together on one prompt (one decode group, as the app's Decode press makes),
    pld on another (category `code`), and sps with a method spec decoded alone on the first prompt right after
    (the same prompt within the minute, but another decode); their results by name."""
    store = TraceStore(tmp_path_factory.mktemp("queries") / "x.duckdb")
    runs = {"ar": generate(qwen3, PROMPTS[0], "ar", max_new_tokens=12, trace=store, group="press-1"),
            "sps": generate(qwen3, PROMPTS[0], "sps", models={"draft": qwen3_draft}, max_new_tokens=12, trace=store,
                            k=3, group="press-1"),
            "pld": generate(qwen3, PROMPTS[1], "pld", max_new_tokens=12, trace=store, category="code"),
            "sps2": generate(qwen3, PROMPTS[0], "sps:k=2", models={"draft": qwen3_draft}, max_new_tokens=12,
                             trace=store, group="press-2")}
    yield store, runs
    store.close()


def test_run_and_run_ids(trace):
    store, runs = trace
    ids = [r.run_id for r in runs.values()]
    assert store.run_ids() == sorted(ids, reverse=True) and store.run_ids(2) == sorted(ids, reverse=True)[:2]
    r = store.run(runs["pld"].run_id)
    assert r.method == "pld" and r.category == "code" and r.status == "done" and r.prompt_text == PROMPTS[1]
    assert store.run(max(ids) + 1) is None


def test_run_list_filters_by_method_spec_and_category(trace):
    store, runs = trace
    every = store.run_list()
    assert every.run_id.tolist() == sorted((r.run_id for r in runs.values()), reverse=True)
    assert {"started", "engine", "tokens", "rounds", "target_calls", "tau", "tok_s", "decode_s"} <= set(every.columns)
    assert set(every.engine) == {"speclab"} and (every.tokens == 12).all()
    ar = every.set_index("run_id").loc[runs["ar"].run_id]
    assert ar.rounds == 12 and ar.tau == 1.0  # AR: one token per round
    sps = store.run_list(method="sps")  # a method matches its specs too
    assert sorted(sps.run_id) == sorted([runs["sps"].run_id, runs["sps2"].run_id])
    assert store.run_list(method="sps:k=2").run_id.tolist() == [runs["sps2"].run_id]
    assert store.run_list(category="code").run_id.tolist() == [runs["pld"].run_id]
    assert store.run_list(method="pld", category="nope").empty and len(store.run_list(limit=1)) == 1


def test_decoded_with_is_the_runs_decode_group_never_its_prompt_or_time(trace):
    store, runs = trace
    pair = [runs["ar"].run_id, runs["sps"].run_id]
    assert store.decoded_with(runs["ar"].run_id) == pair == store.decoded_with(runs["sps"].run_id)
    assert store.decoded_with(runs["sps2"].run_id) == [runs["sps2"].run_id]  # same prompt, same minute: not beside
    assert store.decoded_with(runs["pld"].run_id) == [runs["pld"].run_id]  # no group: decoded alone
    assert store.decoded_with(10_000) == [10_000]  # no such run: itself
    groups = store.query("SELECT coalesce(decode_group, '-') AS g FROM runs ORDER BY run_id").g.tolist()
    assert groups == ["press-1", "press-1", "-", "press-2"]


def test_rounds_of_several_runs(trace):
    store, runs = trace
    ids = [runs["pld"].run_id, runs["ar"].run_id]
    rounds = store.rounds_of(ids)
    assert sorted(set(rounds.run_id)) == sorted(ids)
    assert list(zip(rounds.run_id, rounds["round"])) == sorted(zip(rounds.run_id, rounds["round"]))
    cols = ["round", "n_drafted", "n_accepted", "committed", "t_verify_ms"]
    for rid in ids:
        assert rounds[rounds.run_id == rid][cols].reset_index(drop=True).equals(store.rounds(rid)[cols])


def test_tokens_with_their_rounds_decision(trace):
    store, runs = trace
    rid = runs["sps"].run_id
    toks = store.tokens_with_decisions(rid)
    assert toks.token_id.tolist() == runs["sps"].token_ids and toks.pos.tolist() == list(range(12))
    assert set(toks.drafter) == {"sps"} and toks.signal.isna().all()  # a fixed router: no signal
    decisions = store.router_decisions(rid).set_index("round").choice
    assert (toks["round"].map(decisions) == toks.drafter).all()


def test_phase_ms_sums_the_rounds(trace):
    store, runs = trace
    rid = runs["sps"].run_id
    ms = store.phase_ms(rid)
    rounds = store.rounds(rid)
    assert list(ms) == list(PHASES)
    assert all(ms[p] == pytest.approx(rounds[f"t_{p}_ms"].sum()) for p in PHASES) and ms["verify"] > 0
    assert store.phase_ms(10_000) == dict.fromkeys(PHASES, 0.0)


def test_tree_root_text_and_round_drafter(trace):
    store, runs = trace
    rid = runs["sps"].run_id
    toks = store.tokens(rid)
    assert store.text_before(rid, 0) is None  # the first round's root is the prompt's last token
    second = int(toks["round"].iloc[-1])
    assert store.text_before(rid, second) == toks[toks["round"] < second].text.iloc[-1]
    assert store.round_drafter(rid, 0) == "sps" and store.round_drafter(rid, 10_000) is None
    assert store.round_drafter(runs["ar"].run_id, 0) is None  # AR drafts nothing
