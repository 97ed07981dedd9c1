"""SpecBlock: the drafting forward is training's forward (both blocks, row for row), the valid-prefix mask and the
rank buckets on hand-made examples, a checkpoint round-trips, every node carries its block and bucket (in the trace
too), and serving-time adaptation. Greedy equals AR (several blocks, widths and starts, rank-guided or uniform,
another K, FlashHead; deferred on and off), sampling, catch-up in one call, bad parameters and `reset`: the
conformance suite (tests/test_conformance.py, over the shapes of its registry entry)."""
import numpy as np
import pytest
import torch

from helpers import PROMPTS, start_drafter
from speclab.core.sampling import Sampling
from speclab.drafters.specblock import (
    SpecBlockDrafter,
    _Start,
    bucket_of_rank,
    load_specblock,
    psi,
    random_specblock,
    rank_of,
)
from speclab.errors import InvalidInput
from speclab.generate import generate
from speclab.train.specblock import block_forward, pick_anchors, target_features, valid_prefix

SETTINGS = {  # blocks, starts, widths b0..b3, rank, total_tokens
    "one block, chain": dict(blocks=1, starts=1, width_b0=1, width_b1=1, width_b2=1, width_b3=1, rank=1,
                             total_tokens=16),
    "two blocks, paper widths": dict(blocks=2, starts=2, width_b0=2, width_b1=4, width_b2=10, width_b3=0, rank=1,
                                     total_tokens=60),
    "three blocks, fallback widths": dict(blocks=3, starts=1, width_b0=2, width_b1=4, width_b2=6, width_b3=4,
                                          rank=1, total_tokens=24),
    "uniform tree": dict(blocks=2, starts=2, width_b0=2, width_b1=0, width_b2=0, width_b3=0, rank=0,
                         total_tokens=20),
}


@pytest.fixture(scope="module")
def model(deep):
    return random_specblock(deep, 2)


@pytest.mark.cpu_only
def test_drafting_forward_is_trainings_forward(deep, model):
    """The first block at a committed position and a second block from a cut inside it: the drafter's logits are
    training's `block_forward` at that anchor and cut."""
    text = PROMPTS[0] + " " + PROMPTS[1]
    ids = deep.tokenizer(text, return_tensors="pt")["input_ids"][:, :24].to(deep.device)
    feats, _ = target_features(deep.model, ids, model.config.target_layers, 8)
    r, s = 10, 3
    with torch.no_grad():
        h1, lg1, h2, lg2, lgp = block_forward(model, deep.model.get_input_embeddings().weight, ids, feats,
                                         torch.tensor([[r]]), torch.tensor([[s]]))
    d = SpecBlockDrafter(model, deep, **SETTINGS["one block, chain"])
    d.reset(ids[0, : r + 2], feats[0, : r + 1])  # committed x_0..x_{r+1}: the root is x_{r+1} with f_r
    d.catch_up(ids[0, :0], None)
    with torch.inference_mode():  # as the drafter runs (its cache is an inference tensor)
        root = _Start(model.cond(d.pending_feats[-1]), int(d.pending_ids[-1]), -1, 0, [])
        h, logits, _, _ = d.block_forward([root])
        torch.testing.assert_close(logits[0], lg1[0, 0].float(), atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(logits[0, 0], lgp[0, r].float(), atol=2e-4, rtol=2e-4)  # row 1 = prefix row
        second = _Start(h[0, s - 1], int(ids[0, r + 1 + s]), -1, s, list(range(s)))
        _, logits2, _, _ = d.block_forward([second])
        torch.testing.assert_close(logits2[0], lg2[0, 0].float(), atol=2e-4, rtol=2e-4)


def test_tree_shape_follows_buckets_and_carries_block_and_bucket(deep, model):
    d = SpecBlockDrafter(model, deep, **{**SETTINGS["three blocks, fallback widths"], "total_tokens": 200})
    start_drafter(d, deep, PROMPTS[0])
    tree = d.propose(64, Sampling(), None)
    widths = d.widths
    blocks, buckets = tree.extra["block"], tree.extra["bucket"]
    assert blocks.max() >= 1  # a later block ran (from a rank-1 position of the first)
    assert (tree.depth[blocks == 1].min() > 1) and tree.depth.max() <= 3 * 4
    # siblings under one parent share a block and bucket, and there are as many as the bucket's width
    for parent in set(tree.parents.tolist()):
        kids = (tree.parents == parent).nonzero().flatten()
        by_block = {}
        for k in kids.tolist():
            by_block.setdefault(int(blocks[k]), []).append(k)
        for ks in by_block.values():
            assert len({int(buckets[k]) for k in ks}) == 1
            assert len(ks) <= int(widths[buckets[ks[0]]])
    assert tree.draft_probs.le(1).all() and tree.draft_probs.gt(0).all()
    uniform = SpecBlockDrafter(model, deep, **SETTINGS["uniform tree"])
    start_drafter(uniform, deep, PROMPTS[0])
    t = uniform.propose(64, Sampling(), None)
    assert (t.extra["bucket"] == -1).all() and len(t) <= 20


def test_valid_prefix_mask_and_rank_buckets_by_hand():
    correct = torch.tensor([[1., 1., 0., 1.], [0., 1., 1., 1.], [1., 1., 1., 1.]])
    assert valid_prefix(correct).tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    # a second block inherits the first's mask at the cut
    assert valid_prefix(correct, torch.tensor([0., 1., 1.])).tolist() == [[0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert bucket_of_rank(torch.tensor([1, 2, 4, 5, 10, 11, 500])).tolist() == [0, 1, 1, 2, 2, 3, 3]
    logits = torch.tensor([[0.5, 3.0, 1.0, 2.0, -1.0]])
    assert rank_of(logits, torch.tensor([1])).tolist() == [1] and rank_of(logits, torch.tensor([4])).tolist() == [5]
    s = psi(torch.randn(2, 3, 50))
    assert s.shape == (2, 3, 15) and torch.allclose(s[..., 13], s[..., 0].exp())  # top probability
    assert (s[..., 10:13] >= 0).all()  # gaps from the top logit


def test_anchors_leave_room_for_a_block():
    a, c = pick_anchors(3, 40, 4, 0.25, np.random.default_rng(0))
    assert a.shape == c.shape and (a + 4 <= 38).all() and c.min() >= 1 and c.max() <= 4


def test_checkpoint_round_trip_and_bad_parameters(deep, model, tmp_path):
    model.save(tmp_path / "sb", dtype=torch.float32)
    again = load_specblock(tmp_path / "sb", deep)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    with pytest.raises(InvalidInput, match="every width_b"):  # each width within its bound, all 0 together
        generate(deep, PROMPTS[0], "specblock", models={"specblock": model}, width_b0=0, width_b1=0, width_b2=0,
                 width_b3=0)


def test_trace_records_each_nodes_block_and_bucket(deep, model, tmp_path):
    from speclab.trace import TraceStore
    with TraceStore(tmp_path / "t.duckdb") as store:
        generate(deep, PROMPTS[0], "specblock", models={"specblock": model}, max_new_tokens=24, trace=store,
                 **{**SETTINGS["three blocks, fallback widths"], "total_tokens": 80})
        generate(deep, PROMPTS[0], "pld", max_new_tokens=24, trace=store)
        got = store.query("""SELECT r.method, count(*) AS n, count(block) AS blocks, count(bucket) AS buckets,
                                    max(block) AS last_block, min(bucket) AS lo, max(bucket) AS hi
                             FROM draft_nodes JOIN runs r USING (run_id) GROUP BY ALL ORDER BY r.method""")
    sb = got[got.method == "specblock"].iloc[0]
    assert sb.n == sb.blocks == sb.buckets and sb.last_block >= 1 and 0 <= sb.lo <= sb.hi <= 3
    pld = got[got.method == "pld"]
    assert pld.empty or (pld.blocks.iloc[0] == 0 and pld.buckets.iloc[0] == 0)  # NULL for other drafters


def test_adaptation_step_changes_only_its_actions_parameters_and_revert_is_exact(deep, model):
    """A query decoded with SpecBlock leaves rejections with the target's distribution there; a head-only update
    changes the LM head and the rank head only (in theta_train and in the drafter's own weights), a full update
    the trunk too; a revert restores the last good checkpoint bit for bit."""
    import copy

    from speclab.adaptation import AdaptConfig, Adapter, run_query
    m = copy.deepcopy(model)
    q, res = run_query(deep, {"specblock": m}, PROMPTS[0], SETTINGS["one block, chain"], 32)
    assert q.rejections and 0 < q.signal <= len(q.rejections)
    assert q.ids.numel() == q.feats.shape[0] + 1 and all(0 <= x.r <= 1 for x in q.rejections)
    ad = Adapter(m, deep.model.get_input_embeddings().weight, AdaptConfig(buffer=1, lr=1e-2))
    before = {k: v.clone() for k, v in ad.train.state_dict().items()}
    inf_before = {k: v.clone() for k, v in m.state_dict().items()}
    ad.tps = [10.0]
    ad.buffers["head"].append(q)
    ad._update("head", q.signal)
    changed = {k for k, v in ad.train.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and all(k.startswith(("lm_head.", "rank_head.")) for k in changed), changed
    inf_changed = {k for k, v in m.state_dict().items() if not torch.equal(v, inf_before[k])}
    assert inf_changed == changed  # theta_inf follows theta_train
    good = {k: v.clone() for k, v in ad.good.items()}
    ad.buffers["full"].append(q)
    ad._update("full", q.signal)
    assert any(not torch.equal(v, before[k]) for k, v in ad.train.state_dict().items() if k.startswith("layers."))
    ad.window_tau = [3.0, 2.5, 2.0, 1.5]  # three falling windows
    assert ad._drift()
    assert all(torch.equal(v, good[k]) for k, v in ad.train.state_dict().items())
    assert all(torch.equal(v, good[k].to(v.dtype)) for k, v in m.state_dict().items())
    assert ad.v == {"head": 0.0, "full": 0.0}


def test_adapt_stream_traces_every_decision(deep, model, tmp_path):
    """Every policy serves the stream with every query traced and its decision in the `adaptation` table; static
    never updates, OSD updates every `osd_every` queries; the report has one row and two curves per policy."""
    import copy

    from speclab.adaptation import AdaptConfig, adapt_stream
    from speclab.cli.adapt import adapt_report
    from speclab.trace import TraceStore
    prompts = [{"prompt": p, "prompt_id": str(i), "category": "test"} for i, p in enumerate(PROMPTS[:3] * 2)]
    frames = []
    with TraceStore(tmp_path / "a.duckdb") as store:
        for policy in ("static", "osd"):
            frames.append(adapt_stream(deep, copy.deepcopy(model), prompts, AdaptConfig(policy=policy, osd_every=2,
                                                                                        lr=1e-3),
                                       SETTINGS["one block, chain"], 24, store, stream=policy))
        got = store.query("SELECT policy, count(*) AS n, count(trained) AS updates, count(DISTINCT run_id) AS runs "
                          "FROM adaptation GROUP BY policy ORDER BY policy")
    assert got.n.tolist() == [6, 6] and got.runs.tolist() == [6, 6]
    assert got[got.policy == "static"].updates.iloc[0] == 0 and got[got.policy == "osd"].updates.iloc[0] >= 2
    rep = adapt_report(frames, "test")
    assert "| osd" in rep.text and "| static" in rep.text and len(rep.figs) == 2
