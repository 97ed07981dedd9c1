"""speclab.viz on real traces: token shading HTML, draft trees and per-round charts."""
import pytest

from helpers import PROMPTS
from speclab import viz
from speclab.generate import Generation, generate
from speclab.metrics import position_acceptance
from speclab.trace import TraceStore, token_columns, vocab_text


@pytest.fixture(scope="module")
def traced(qwen3, qwen3_draft, tmp_path_factory):
    store = TraceStore(tmp_path_factory.mktemp("viz") / "v.duckdb")
    runs = {m: generate(qwen3, PROMPTS[0], m, models={"draft": qwen3_draft}, k=3, tree_topk=2, max_new_tokens=24,
                        trace=store).run_id
            for m in ("ar", "sps", "pld")}
    yield store, runs
    store.close()


def test_token_spans_shade_by_source_with_details(traced):
    store, runs = traced
    toks = store.tokens(runs["sps"])
    spans = viz.token_spans({c: toks[c].tolist() for c in viz.TOKEN_COLUMNS})
    assert len(spans) == len(toks)
    n_draft = int((toks.source == "sps").sum())
    assert sum('data-src="sps"' in s for s in spans) == n_draft > 0
    assert sum("border-left" in s for s in spans) == toks["round"].nunique()  # one bar per round start
    assert "target p" in spans[0] and "entropy" in spans[0]
    html = viz.tokens_html(spans, viz.stats_header("sps", {"tau": "2.0"}))
    assert html.count('class="tok"') == len(toks) and "<b>sps</b>" in html
    assert "sps: accepted draft" in viz.legend_html(["sps"])


def test_sampled_acceptances_are_underlined_with_their_probability(qwen3, qwen3_draft, traced):
    """A sampled run's accepted drafts carry min(1, p/q) from the trace: underlined, darker the less likely, with
    the probability in the tip; the target's own tokens and every token of a greedy run carry none."""
    store, runs = traced
    run = generate(qwen3, PROMPTS[0], "sps", models={"draft": qwen3_draft}, k=3, max_new_tokens=24, temperature=1.0,
                   seed=3, trace=store).run_id
    for rid, sampled in ((run, True), (runs["sps"], False)):
        toks = store.tokens(rid)
        spans = viz.token_spans({c: toks[c].tolist() for c in (*viz.TOKEN_COLUMNS, "accept_prob")})
        drafted = (toks.source == "sps").to_numpy()
        marked = ["accepted with probability" in s for s in spans]
        assert marked == list(drafted & sampled) and (not sampled or any(marked))
        for s, ap in zip(spans, toks.accept_prob):
            if "border-bottom" in s:
                assert f"rgba(0,0,0,{0.9 * (1 - ap):.2f})" in s and f"probability {ap:.2f}" in s
    assert "underline" in viz.legend_html(["sps"], sampled=True) and "underline" not in viz.legend_html(["sps"])


def test_live_event_columns_equal_the_trace(qwen3, qwen3_draft, traced):
    """What the app renders live is what the trace stores."""
    store, _ = traced
    g = Generation(qwen3, PROMPTS[1], "sps", models={"draft": qwen3_draft}, k=3, max_new_tokens=20, trace=store)
    live = [token_columns([ev], vocab_text(qwen3.tokenizer)) for ev in g]
    toks = store.tokens(g.run_id)
    assert [t for c in live for t in c["text"]] == toks.text.tolist()
    assert [s for c in live for s in c["source"]] == toks.source.tolist()


def test_tree_and_round_charts_from_trace(traced):
    store, runs = traced
    rid = runs["sps"]
    nodes = store.draft_nodes(rid, 0)
    nodes["text"] = nodes.token_id.astype(str)
    fig = viz.tree_figure(nodes, "root")
    xs = [x for tr in fig.data for x in (tr.x or []) if x is not None]
    assert max(xs) == nodes.depth.max() and len(nodes) == 2 * 3  # tree top-2 over 3 levels
    # whole depths on the axis, and every node (with its label above it) inside the plotted area: nothing clipped
    lay = fig.layout
    assert lay.xaxis.dtick == 1 and lay.xaxis.range[0] < 0 and lay.xaxis.range[1] > max(xs)
    ys = [v for tr in fig.data for v in (tr.y or []) if v is not None]
    assert lay.yaxis.range[0] < min(ys) and lay.yaxis.range[1] > max(ys) + 0.5
    assert all(tr.cliponaxis is False for tr in fig.data if tr.mode == "markers+text")
    # colouring by a column the round does not have (an sps tree has no blocks): the plain figure
    assert [tr.name for tr in viz.tree_figure(nodes, "root", color_by="block").data] == [tr.name for tr in fig.data]
    blocks = nodes.assign(block=[0, 0, 1, 1, 1, 1], bucket=[0, 3, 1, 1, 2, 2])
    names = {tr.name for tr in viz.tree_figure(blocks, "root", color_by="block").data}
    assert {"block 0", "block 1"} <= names
    names = {tr.name for tr in viz.tree_figure(blocks, "root", color_by="bucket").data}
    assert {"bucket b0 (rank 1)", "bucket b3 (rank > 10)", "bucket b2 (rank 5-10)"} <= names
    rounds = store.query("SELECT * FROM rounds WHERE run_id IN (?, ?, ?)", list(runs.values()))
    rounds["label"] = rounds.run_id.astype(str)
    assert len(viz.accepted_per_round(rounds).data) == 3
    phases = ["route", "catchup", "draft", "verify", "commit", "record"]
    assert [b.name for b in viz.phase_breakdown(rounds).data] == phases
    pos = position_acceptance(store, [rid])
    pos["method"] = "sps"
    assert list(viz.position_acceptance(pos).data[0].x) == [1, 2, 3]


def test_router_details_on_hover_only_for_routed_rounds(traced):
    """A token's hover names its round's router decision when the router compared a signal (fixed routers have
    none); the live columns (`decision_columns`) are the trace's router_decisions, token by token."""
    import math

    from speclab.trace import decision_columns
    store, runs = traced
    toks = store.query("""SELECT t.*, d.choice AS drafter, d.signal, d.threshold FROM tokens t
                          JOIN router_decisions d USING (run_id, round) WHERE t.run_id = ? ORDER BY t.pos""",
                       [runs["sps"]])
    cols = {c: toks[c].tolist() for c in (*viz.TOKEN_COLUMNS, *viz.ROUTER_COLUMNS)}
    assert len(toks) and not any("router chose" in s for s in viz.token_spans(cols))  # fixed: no signal
    cols["signal"] = [0.5] * len(toks)
    cols["threshold"] = [1.25] * len(toks)
    spans = viz.token_spans(cols)
    assert all("router chose sps: signal 0.50 vs threshold 1.25" in s for s in spans)

    class Ev:  # what decision_columns reads of a RoundEvent
        def __init__(self, n, decision):
            import torch
            self.committed, self.decision = torch.zeros(n), decision
    from speclab.core.protocol import Decision
    d = decision_columns([Ev(2, Decision("eagle3", "entropy", 2.0, 1.0)), Ev(1, None)])
    assert d["drafter"].tolist() == ["eagle3", "eagle3", None] and d["signal"][:2].tolist() == [2.0, 2.0]
    assert math.isnan(d["threshold"][2])


def test_column_header_defines_its_metrics_and_splits_the_decode_time():
    from speclab.metrics import METRIC_HELP, time_split
    split = time_split({"route": 1.0, "catchup": 2.0, "draft": 3.0, "verify": 4.0, "commit": 0.5}, 12.0)
    assert split == {"draft": 3.0, "verify": 4.0, "catch-up": 2.0, "other": 3.0}  # other: the rest of the decode
    head = viz.stats_header("eagle3", {"tau": "3.10", "speedup": "0.71x"}, split)
    assert f'title="{METRIC_HELP["tau"]}"' in head and "Below 1x" in head
    assert "draft 25%" in head and "verify 33%" in head and "catch-up 17%" in head and "other 25%" in head
    assert "speclab-timebar" not in viz.stats_header("ar", {"tau": "1.00"})
    # a run without a drafter (AR) shows no draft or catch-up share: that bookkeeping is its other time (v4, 15)
    ar = time_split({"route": 1.0, "catchup": 0.2, "draft": 0.3, "verify": 8.0, "commit": 0.5}, 12.0, drafted=False)
    assert ar == {"verify": 8.0, "other": 4.0}
    assert "draft" not in viz.stats_header("ar", {"tau": "1.00"}, ar)
    assert "title=" not in viz.stats_header("ar", {"tau": "1.00"}, explain=False)  # while streaming: bare figures
