"""FlashHead's core (speclab/drafters/flashhead.py): equal-size clusters cover the vocabulary exactly once, the build is
deterministic given its seed and round-trips through its files, probing every cluster gives the dense head's
logits, fewer probes give -inf exactly off the candidates, adaptive probes follow the centroid margin, and
sampled clusters are drawn without replacement from the centroid softmax. Every drafter with head=flash: greedy equals
AR (FlashHead shapes of the registry entries: the conformance suite, tests/test_conformance.py), and its drafts come
from its candidates."""
import numpy as np
import pytest
import torch
from scipy import stats

from helpers import PROMPTS
from speclab.checks import InvalidInput
from speclab.drafters.flashhead import FlashHead, FlashIndex, build_index, index_dir, pick_clusters, probe_counts
from speclab.generate import generate


def head(V=96, H=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    # rows in a few directions, so clusters have something to find
    dirs = torch.randn(6, H, generator=g)
    return dirs[torch.arange(V) % 6] + 0.3 * torch.randn(V, H, generator=g)


@pytest.mark.parametrize("c", [1, 4, 12, 96])
def test_equal_size_clusters_cover_the_vocabulary_exactly_once(c):
    w = head()
    idx = build_index(w, c, seed=1)
    assert idx.index.shape == (c, 96 // c)
    assert torch.equal(idx.index.flatten().sort().values, torch.arange(96))
    assert idx.centroids.shape == (c, 16)
    torch.testing.assert_close(idx.centroids, w[idx.index].mean(1))


def test_clusters_must_divide_the_vocabulary():
    with pytest.raises(InvalidInput, match="clusters must divide the head's 96 rows"):
        build_index(head(), 7)


def test_build_is_deterministic_and_round_trips(tmp_path):
    w = head()
    a, b = build_index(w, 8, seed=3), build_index(w, 8, seed=3)
    assert torch.equal(a.index, b.index) and torch.equal(a.centroids, b.centroids)
    assert {k: v for k, v in a.meta.items() if k != "build_s"} == {k: v for k, v in b.meta.items() if k != "build_s"}
    assert a.meta["objective_mean_cosine"] > 0.8  # rows of one direction share a cluster
    a.save(tmp_path / "c8")
    back = FlashIndex.load(tmp_path / "c8", w)
    assert torch.equal(back.index, a.index) and torch.equal(back.centroids, a.centroids)
    with pytest.raises(InvalidInput, match="built for another head"):
        FlashIndex.load(tmp_path / "c8", w + 1)
    with pytest.raises(InvalidInput, match="no FlashHead index"):
        FlashIndex.load(tmp_path / "missing")


def test_all_probes_give_the_dense_logits():
    w = head()
    idx = build_index(w, 12)
    h = torch.randn(5, 16, generator=torch.Generator().manual_seed(4))
    fh = FlashHead(w, idx, probes=12, scale=0.5)
    torch.testing.assert_close(fh(h), (h @ w.T) * 0.5, atol=1e-5, rtol=1e-5)


def test_fewer_probes_score_exactly_their_candidates():
    w = head()
    idx = build_index(w, 12)
    h = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(5))  # leading dims are kept
    fh = FlashHead(w, idx, probes=2)
    out = fh(h)
    assert out.shape == (2, 3, 96)
    dense = h @ w.T
    cands = fh.last_candidates
    assert cands.shape == (2, 3, 2 * 8)
    finite = torch.isfinite(out)
    assert torch.equal(finite.sum(-1), torch.full((2, 3), 16))
    on = torch.zeros_like(finite).scatter_(-1, cands, True)
    assert torch.equal(finite, on)
    torch.testing.assert_close(out[finite], dense[finite], atol=1e-5, rtol=1e-5)
    # greedy picks the clusters with the best centroid scores
    scores = h.reshape(-1, 16) @ idx.centroids.T
    best = scores.topk(2, -1).indices
    assert torch.equal(cands.reshape(-1, 16).sort(-1).values, idx.index[best].flatten(1).sort(-1).values)


def test_adaptive_probes_follow_the_margin():
    s = torch.tensor([[5.0, 4.9, 4.8, 1.0], [5.0, 1.0, 0.5, 0.0], [3.0, 3.0, 3.0, 3.0]])
    assert probe_counts(s, 3, 0.0).tolist() == [3, 3, 3]
    assert probe_counts(s, 3, 0.15).tolist() == [2, 1, 3]
    assert probe_counts(s, 3, 100.0).tolist() == [3, 3, 3]
    assert probe_counts(s, 3, 1e-6).tolist() == [1, 1, 3]
    w = head()
    idx = build_index(w, 12)
    h = torch.randn(6, 16, generator=torch.Generator().manual_seed(6))
    wide, narrow = FlashHead(w, idx, probes=4, margin=1e9), FlashHead(w, idx, probes=4, margin=1e-9)
    assert torch.equal(torch.isfinite(wide(h)), torch.isfinite(FlashHead(w, idx, probes=4)(h)))
    assert torch.isfinite(narrow(h)).sum(-1).tolist() == [8] * 6  # one cluster of 8 each


def test_a_bf16_head_takes_fp32_states():
    """A draft model's final-norm states can be fp32 while its head is bf16 (the lean forward refines the norm)."""
    w = head()
    idx = build_index(w, 12)
    h = torch.randn(3, 16, generator=torch.Generator().manual_seed(7))
    out = FlashHead(w.bfloat16(), idx, probes=12)(h)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, h @ w.T, atol=0.1, rtol=0.05)


def test_probes_are_checked():
    idx = build_index(head(), 12)
    for bad in (0, 13):
        with pytest.raises(InvalidInput, match="probes must be from 1 to the index's 12 clusters"):
            FlashHead(head(), idx, probes=bad)


def test_sampled_clusters_are_drawn_without_replacement_from_the_centroid_softmax():
    scores = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]]).repeat(4000, 1)
    g = torch.Generator().manual_seed(0)
    picks = pick_clusters(scores, 3, 1.0, g)
    assert all(len(set(r)) == 3 for r in picks.tolist())  # without replacement
    first = np.bincount(picks[:, 0].numpy(), minlength=5)
    expected = torch.softmax(scores[0].double(), 0).numpy() * len(picks)
    assert stats.chisquare(first, expected).pvalue > 1e-3
    # power: at another temperature the first picks are told apart
    hot = np.bincount(pick_clusters(scores, 3, 2.0, g)[:, 0].numpy(), minlength=5)
    assert stats.chisquare(hot, expected).pvalue < 1e-3
    assert torch.equal(pick_clusters(scores[:2], 3, 0.0, None), torch.tensor([[0, 1, 2], [0, 1, 2]]))


# ---- every drafter with head=flash: the head is really the clustered one (greedy equals AR: the conformance suite) -
def with_index(model, weight, tmp_path, c=64):
    """The drafter `model` named by a directory that holds a FlashHead index of its head `weight`."""
    build_index(weight, c).save(index_dir(tmp_path, c))
    model.name = str(tmp_path)
    return model


def drafters_under_test(deep, tmp_path_factory):
    from helpers import random_dflash, random_eagle3, random_specblock
    e3 = random_eagle3(deep, 3, draft_vocab=deep.vocab_size // 2)
    df = random_dflash(deep, 4, markov_rank=8)
    sb = random_specblock(deep, 5)
    return {"eagle3": with_index(e3, e3.lm_head.weight, tmp_path_factory.mktemp("e3")),
            "dflash": with_index(df, deep.head_weight, tmp_path_factory.mktemp("df")),
            "specblock": with_index(sb, sb.lm_head.weight, tmp_path_factory.mktemp("sb"))}


@pytest.fixture(scope="module")
def flash_models(deep, tmp_path_factory):
    return drafters_under_test(deep, tmp_path_factory)


def test_a_flash_sps_draft_is_accepted(qwen3, qwen3_draft, model_dir):
    """A draft model that agrees with the target still agrees through its FlashHead: chains and trees get accepted
    tokens (and the output is AR's)."""
    build_index(qwen3_draft.head_weight, 64).save(index_dir(model_dir["qwen3_draft"], 64))
    ar = generate(qwen3, PROMPTS[0], "ar", max_new_tokens=32)
    for extra in ({}, {"tree_topk": 2, "k": 3}):
        fl = generate(qwen3, PROMPTS[0], "sps", models={"draft": qwen3_draft}, max_new_tokens=32, head="flash",
                      clusters=64, probes=8, **extra)
        assert fl.token_ids == ar.token_ids and fl.summary()["rounds"] < len(ar.token_ids), extra


def test_flash_drafters_draft_from_their_candidates_only(deep, flash_models):
    """With one probe a drafter's logits are finite on one cluster of tokens per row (b = V / 64), and its draft
    tokens come from those clusters."""
    from speclab.drafters.registry import build_drafter
    d = build_drafter("specblock", deep, flash_models, head="flash", probes=1)
    ids = deep.tokenizer(PROMPTS[0], return_tensors="pt")["input_ids"][0]
    out = generate(deep, PROMPTS[0], "specblock", models=flash_models, max_new_tokens=8, head="flash", probes=1)
    assert d.flash is not None and d.flash.probes == 1 and out.token_ids and ids.numel()
    x = torch.randn(3, 4, d.m.config.hidden_size).to(deep.device)
    logits = d.flash(d.m.norm(x))
    assert torch.equal(torch.isfinite(logits).sum(-1).cpu(), torch.full((3, 4), deep.vocab_size // 64))


# ---- sampling through a FlashHead keeps the target distribution ----------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("markov", [False, True], ids=["dflash", "dflash-markov"])
def test_sampling_through_a_flash_dflash_keeps_target_distribution(tiny_v8, markov, tmp_path):
    """DFlash drafting through a FlashHead of 4 clusters of 2 tokens, 2 probes drawn from the centroid softmax per
    row: the draft distribution is the softmax over the 4 candidates (zero elsewhere), recorded for verification.
    The first two sampled tokens follow the target's exact joint; two-token drafts are accepted in some decodes;
    the target's joint at temperature 0.7 is told apart (power)."""
    from helpers import random_dflash
    from speclab.drafters.dflash import DFlashDrafter
    from test_sampling import N_RUNS, V, assert_keeps_target_distribution
    target = tiny_v8
    m = random_dflash(target, 4, markov_rank=4 if markov else 0, mask_id=V - 1)
    drafter = DFlashDrafter(m, target, block_size=3, markov=markov, tree_topk=1, total_tokens=16)
    drafter.flash = FlashHead(target.head_weight, build_index(target.head_weight, 4), probes=2)
    assert_keeps_target_distribution(target, drafter, 30_000, N_RUNS // 100)



def test_a_grid_over_probes_with_the_dense_head_decodes_once():
    from speclab.methods import METHODS
    for name in ("sps", "eagle3", "dflash", "specblock"):
        same = METHODS[name].same_decode
        dense = [same({**METHODS[name].defaults, "head": "dense", "probes": p}) for p in (1, 4, 16)]
        flash = [same({**METHODS[name].defaults, "head": "flash", "probes": p}) for p in (1, 4, 16)]
        assert dense[0] == dense[1] == dense[2] and len({tuple(sorted(f.items())) for f in flash}) == 3, name


@pytest.mark.parametrize("method,extra", [("eagle3", {}), ("eagle3", {"tree_topk": 3, "depth": 4}),
                                          ("dflash", {"markov": 1}), ("dflash", {"tree_topk": 2}),
                                          ("specblock", {"blocks": 2})],
                         ids=["eagle3-chain", "eagle3-tree", "dflash-markov", "dflash-tree", "specblock"])
def test_trace_tells_retrieval_misses_from_drafter_misses(deep, flash_models, method, extra, tmp_path):
    """Every draft node of a FlashHead run records whether the target's token was among the candidates of the row
    that drafted it (`in_cands`; NULL with the dense head): an accepted node's was, a node whose wasn't is
    rejected, and with one probe some rejections are retrieval misses. The tree's hover says which."""
    from speclab import viz
    from speclab.trace import TraceStore
    with TraceStore(tmp_path / "t.duckdb") as s:
        fl = generate(deep, PROMPTS[0], method, models=flash_models, max_new_tokens=24, trace=s, head="flash",
                      probes=1, **extra)
        dn = generate(deep, PROMPTS[0], method, models=flash_models, max_new_tokens=24, trace=s, **extra)
        nodes, dense = s.draft_nodes(fl.run_id), s.draft_nodes(dn.run_id)
    assert len(nodes) and nodes.in_cands.notna().all() and set(nodes.in_cands) <= {0, 1}
    assert dense.in_cands.isna().all()
    assert (nodes.in_cands[nodes.accepted.astype(bool)] == 1).all()
    assert not nodes.accepted[nodes.in_cands == 0].astype(bool).any() and (nodes.in_cands == 0).any()
    first = nodes[nodes["round"] == nodes["round"].min()]
    hover = "".join(str(t.hovertemplate) for t in viz.tree_figure(first).data)
    assert "target's token among the candidates" in hover
    assert "candidates" not in "".join(str(t.hovertemplate) for t in
                                       viz.tree_figure(dense[dense["round"] == dense["round"].min()]).data)


def test_trace_tells_retrieval_misses_from_drafter_misses_sps(qwen3, qwen3_draft, model_dir, tmp_path):
    from speclab.trace import TraceStore
    build_index(qwen3_draft.head_weight, 64).save(index_dir(model_dir["qwen3_draft"], 64))
    for extra in ({}, {"tree_topk": 2, "k": 3}):
        with TraceStore(tmp_path / f"t{len(extra)}.duckdb") as s:
            fl = generate(qwen3, PROMPTS[0], "sps", models={"draft": qwen3_draft}, max_new_tokens=24, trace=s,
                          head="flash", clusters=64, probes=2, **extra)
            nodes = s.draft_nodes(fl.run_id)
        assert nodes.in_cands.notna().all() and (nodes.in_cands[nodes.accepted.astype(bool)] == 1).all()
        assert not nodes.accepted[nodes.in_cands == 0].astype(bool).any(), extra


def test_agreement_command_on_the_zoo(tmp_path):
    """`speclab flashhead agreement` audits the zoo EAGLE-3's FlashHead while decoding, over two indexes (the zoo's
    256 clusters and a 128-cluster one built beside a copy): probing all of an index's clusters agrees with the
    dense head on every row, one probe does not, and every point has its drafter ms per round."""
    import shutil

    from speclab.cli import main
    from speclab.zoo import zoo_dir
    eagle = tmp_path / "eagle3"
    shutil.copytree(zoo_dir() / "eagle3", eagle)
    assert main(["flashhead", "build", "--drafter", "eagle3", "--eagle", str(eagle), "--clusters", "128"]) == 0
    report = tmp_path / "agree.md"
    rc = main(["flashhead", "agreement", "--drafter", "eagle3", "--eagle", str(eagle), "--clusters", "128,256",
               "--probes", "1,128", "--limit", "1", "--max-new-tokens", "16", "--report", str(report)])
    lines = [ln.split("|")[1:-1] for ln in report.read_text().splitlines() if ln.startswith("|")]
    cols = [c.strip() for c in lines[0]]
    rows = {r[0].strip(): dict(zip(cols, (c.strip() for c in r))) for r in lines[2:]}
    agree = {k: (float(r["top1_agreement"]), float(r["recall"])) for k, r in rows.items()}
    assert rc == 0 and agree["flash c=128 p=128 margin=0"] == (1.0, 1.0)
    assert agree["flash c=128 p=1 margin=0"][0] < 1.0 and agree["flash c=256 p=1 margin=0"][0] < 1.0
    assert agree["flash c=256 p=128 margin=0"][1] > agree["flash c=256 p=1 margin=0"][1]
    assert all(float(r["drafter_ms_per_round"]) > 0 for r in rows.values()) and "dense" in rows


def test_tables_command_on_the_zoo(tmp_path):
    """`speclab flashhead tables` writes the thesis-shaped tables for a drafter at one (c, p): the head alone on one
    row and on the drafter's rows, its step per round and end to end, dense against flash, each from real calls."""
    from speclab.cli import main
    report = tmp_path / "tables.md"
    assert main(["flashhead", "tables", "--drafters", "dflash", "--probes", "4", "--limit", "1",
                 "--max-new-tokens", "12", "--reps", "5", "--report", str(report)]) == 0
    text = report.read_text()
    sections = text.split("## ")[1:]
    assert [x.split(":")[0] for x in sections] == ["Like Table 4.1", "Like Table 4.2", "Like Table 4.3",
                                                   "Like Table 4.4", "Like Tables 4.5-4.6"]
    head = [ln.split("|")[1:-1] for ln in sections[0].splitlines() if ln.startswith("| dflash")]
    assert {r[2].strip() for r in head} == {"dense", "flash"} and all(float(r[3]) > 0 for r in head)
    assert len({r[1].strip() for r in head}) == 2  # one row, and DFlash's block rows
    steps = [ln.split("|")[1:-1] for ln in sections[2].splitlines() if ln.startswith("| dflash")]
    assert len(steps) == 2 and all(int(r[-1]) > 0 for r in steps)
    end = [ln.split("|")[1:-1] for ln in sections[4].splitlines() if ln.startswith("| dflash")][0]
    assert all(float(x) > 0 for x in end[1:])
    assert (tmp_path / "tables.html").is_file()


# ---- the experiments of `speclab flashhead` as library calls (speclab/bench/flashhead.py), on tiny models ----------
def test_latency_quantiles():
    from speclab.metrics import latency_quantiles
    q = latency_quantiles([1.0, 2.0, 3.0, 4.0, 100.0])
    assert q == {"mean": 22.0, "p50": 3.0, "p95": pytest.approx(80.8)}


def test_build_head_index_saves_it_beside_the_drafter(tmp_path):
    from speclab.bench.flashhead import build_head_index, build_line
    w = torch.randn(256, 16, generator=torch.Generator().manual_seed(0))
    idx, out = build_head_index(w, str(tmp_path), "eagle3", 8, iters=3)
    assert out == index_dir(tmp_path, 8) and FlashIndex.load(out, w).clusters == 8
    assert idx.meta["role"] == "eagle3" and build_line(idx, out, w).startswith(f"{out}: 8 clusters of 32 tokens")


def test_head_costs_time_dense_against_flash(deep):
    from speclab.bench.flashhead import head_costs, head_costs_report
    w = deep.head_weight
    idx = build_index(w, 64)
    df = head_costs(w, idx, probes=[1, 64], rows=[1, 3], reps=5)
    assert df["rows"].tolist() == [1, 1, 1, 3, 3, 3] and df["head"].tolist()[:3] == ["dense", "flash p=1", "flash p=64"]
    assert (df.mean_ms > 0).all() and (df.p50_ms <= df.p95_ms).all() and (df[df["head"] == "dense"].speedup == 1).all()
    report = head_costs_report(df, "dflash", w, idx)
    assert report.title == "speclab flashhead costs: dflash" and len(report.figs) == 1
    assert f"c = 64, b = {deep.vocab_size // 64}" in report.text and "| flash p=64 |" in report.text


def test_agreement_of_all_probes_is_the_dense_head(deep, flash_models):
    from speclab.bench.flashhead import agreement, agreement_report
    prompts = [{"prompt": p} for p in PROMPTS[:1]]
    df = agreement(deep, "dflash", flash_models["dflash"], deep.head_weight, [64], [1, 64], [0.0, 2.0], prompts,
                   max_new_tokens=8, reps=5)
    rows = df.set_index("head")
    assert df["head"].tolist()[0] == "dense" and len(df) == 5
    assert tuple(rows.loc["flash c=64 p=64 margin=0", ["top1_agreement", "recall"]]) == (1.0, 1.0)
    assert rows.loc["flash c=64 p=1 margin=0", "recall"] <= 1.0 and (df.tau >= 1).all()
    assert (df.drafter_ms_per_round > 0).all()
    assert np.isnan(rows.loc["flash c=64 p=1 margin=2", "head_ms"])  # adaptive probes: not timed on a random row
    report = agreement_report(df, "dflash", "zoo", 1)
    assert len(report.figs) == 4 and report.text.startswith("# FlashHead of the dflash drafter on zoo (1 prompts")


def test_flash_tables_per_drafter(deep, flash_models):
    from speclab.bench.flashhead import flash_tables, flash_tables_report
    prompts = [{"prompt": p} for p in PROMPTS[:1]]
    head, steps, ends, indexes = flash_tables(deep, flash_models, ["eagle3", "dflash"], 0, 4, 0.0, prompts,
                                              max_new_tokens=8, reps=5)
    assert {r: x.clusters for r, x in indexes.items()} == {"eagle3": 64, "dflash": 64}
    assert set(zip(steps.drafter, steps["head"])) == {(r, k) for r in indexes for k in ("dense", "flash")}
    assert (steps.rounds > 0).all() and (head.mean_ms > 0).all() and (head[head.rows == 1].groupby("drafter").size()
                                                                      == 2).all()
    assert ends.drafter.tolist() == ["eagle3", "dflash"] and (ends.drop(columns="drafter") > 0).all().all()
    report = flash_tables_report(head, steps, ends, indexes, deep, 4, 0.0, "zoo", 1, 8)
    assert [x.split(":")[0] for x in report.text.split("## ")[1:]] == [
        "Like Table 4.1", "Like Table 4.2", "Like Table 4.3", "Like Table 4.4", "Like Tables 4.5-4.6"]
    assert "Clusters: eagle3 64 of" in report.text and len(report.figs) == 1
