"""DFlash (+ DSpark's Markov head): the public checkpoint layout loads, drafting from a context cached over rounds
equals the training forward over the whole sequence (a full recomputation of the context), a short training learns,
the tree of the rows' top-k and the Markov head, a tree too large to expand refused. Greedy equals AR (chains of
several block sizes with and without the head, trees, FlashHead; random and trained drafters; deferred on and off),
sampling, catch-up in one call, bad parameters and `reset`: the conformance suite (tests/test_conformance.py, over
the shapes of its registry entry)."""
import json

import pytest
import torch

from helpers import PROMPTS, build_tiny, start_drafter
from speclab.core.sampling import Sampling
from speclab.core.target import Target
from speclab.drafters.dflash import DFlashDrafter, DFlashModel, default_layer_ids, load_dflash
from speclab.drafters.dflash import random_dflash as random_drafter
from speclab.errors import InvalidInput, ModelNotFound
from speclab.generate import generate
from speclab.train.dflash import block_forward, target_features


@pytest.fixture(scope="module")
def drafters(deep) -> dict[str, DFlashModel]:
    """Random drafters, without and with the Markov head: nothing to train."""
    return {"random": random_drafter(deep, 0), "random-markov": random_drafter(deep, 1, markov_rank=8)}


def test_default_layers():
    assert default_layer_ids(36) == (1, 9, 17, 25, 33)  # DFlash's example for a 36-layer target
    assert default_layer_ids(6) == (1, 2, 3)  # the zoo
    assert default_layer_ids(4) == (0, 1, 2)  # too shallow for 1..L-3: spread


def _write_public(model: DFlashModel, out, bin_file: bool, rank_in_config: bool = True):
    """A checkpoint written the way public DFlash / DSpark repositories are: a Qwen3 config.json with block_size and
    dflash_config, `layers.N.*` tensor names, no embedding or head."""
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    c = model.config
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": c.hidden_size,
           "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
           "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
           "num_hidden_layers": c.num_hidden_layers, "rms_norm_eps": c.rms_norm_eps,
           "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size, "rope_theta": c.rope_theta,
           "attention_bias": False, "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
           "block_size": 16, "num_target_layers": 4,
           "dflash_config": {"target_layer_ids": list(c.target_layer_ids), "mask_token_id": c.mask_token_id}}
    if c.markov_rank and rank_in_config:
        cfg["markov_rank"] = c.markov_rank
    (out / "config.json").write_text(json.dumps(cfg))
    if bin_file:
        torch.save(sd, out / "pytorch_model.bin")
    else:
        save_file(sd, str(out / "model.safetensors"))
    return out


def _block_once(model, target, prompt, block_size=6, markov=True):
    d = DFlashDrafter(model, target, block_size=block_size, markov=markov, tree_topk=1, total_tokens=16)
    start_drafter(d, target, prompt)
    return d.propose(64, Sampling(), None)


@pytest.mark.parametrize("kind,bin_file,rank_in_config", [("random", False, True), ("random-markov", True, True),
                                                          ("random-markov", False, False)],
                         ids=["plain-safetensors", "markov-bin", "markov-rank-from-shape"])
def test_public_layout_checkpoint_loads_cleanly(deep, drafters, tmp_path, kind, bin_file, rank_in_config):
    src = drafters[kind]
    path = _write_public(src, tmp_path / "ckpt", bin_file, rank_in_config)
    m = load_dflash(path, deep)  # strict: a missing or unexpected tensor is refused
    want, got = src.state_dict(), m.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert m.config.target_layer_ids == src.config.target_layer_ids and m.config.mask_token_id == 2
    assert m.config.block_size == 16 and m.config.markov_rank == src.config.markov_rank
    a, b = _block_once(m, deep, PROMPTS[0]), _block_once(src, deep, PROMPTS[0])
    assert torch.equal(a.tokens, b.tokens) and len(a) == 5  # a block of 6 rows drafts 5 tokens
    m.save(tmp_path / "again")  # and what speclab writes loads back the same
    again = load_dflash(tmp_path / "again", deep)
    assert json.loads((tmp_path / "again" / "config.json").read_text())["dflash_config"]["mask_token_id"] == 2
    assert again.config.target_layer_ids == src.config.target_layer_ids
    assert again.config.markov_rank == src.config.markov_rank
    assert len(_block_once(again.float(), deep, PROMPTS[0])) == 5


def test_bad_checkpoints_are_refused_by_name(deep, drafters, tmp_path):
    from safetensors.torch import load_file, save_file

    path = _write_public(drafters["random"], tmp_path / "ok", bin_file=False)
    sd = load_file(str(path / "model.safetensors"))
    del sd["layers.1.self_attn.k_norm.weight"]
    save_file(sd, str(path / "model.safetensors"))
    with pytest.raises(ModelNotFound, match=r"missing layers\.1\.self_attn\.k_norm\.weight"):
        load_dflash(path, deep)
    with pytest.raises(ModelNotFound, match="no DFlash drafter"):
        load_dflash(tmp_path / "nowhere", deep)
    bad = _write_public(drafters["random"], tmp_path / "nolayers", bin_file=False)
    cfg = json.loads((bad / "config.json").read_text())
    del cfg["dflash_config"]["target_layer_ids"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelNotFound, match=r"not a DFlash config.*target_layer_ids"):
        load_dflash(bad, deep)
    other = Target.load(build_tiny("qwen3", tmp_path / "t2", seed=3, layers=2, hidden=32))
    good = _write_public(drafters["random"], tmp_path / "good", bin_file=False)
    with pytest.raises(ModelNotFound, match=r"width|another target|layers"):
        load_dflash(good, other)


@pytest.mark.cpu_only
@pytest.mark.parametrize("markov", [False, True], ids=["plain", "markov"])
def test_cached_context_drafts_what_a_full_recomputation_drafts(deep, trained_dflash, markov):
    """A drafter whose context K/V were cached over rounds of various lengths (catch-up after catch-up) and
    training's forward over the whole sequence (the context recomputed from scratch, the block at the same anchor)
    give the same block logits. (A backlog caught up in one call: the conformance suite.)"""
    m = trained_dflash
    ids = deep.tokenizer(PROMPTS[1], return_tensors="pt")["input_ids"][0]
    ids = torch.cat([ids, torch.tensor(generate(deep, ids, "ar", max_new_tokens=20).token_ids)])
    feats = deep.forward(ids, deep.new_cache(), layers=m.config.target_layer_ids).features
    n0, size = ids.numel() - 20, 6
    d = DFlashDrafter(m, deep, block_size=size, markov=markov, tree_topk=1, total_tokens=16)
    d.reset(ids[:n0], feats[: n0 - 1])
    d.catch_up(ids[:0], None)
    s = n0
    for step in (3, 1, 5, 2, 9):  # rounds of various lengths, a proposal and commit after each
        t = d.propose(size, Sampling(), None)
        d.commit(t, t.tokens[:0])
        d.catch_up(ids[s : s + step], feats[s - 1 : s + step - 1])
        s += step
    busy = d.block_logits(size)
    full_feats, _ = target_features(deep.model, ids[None], m.config.target_layer_ids)
    with torch.no_grad():
        full = block_forward(m, deep.model.get_input_embeddings().weight, deep.model.get_output_embeddings().weight,
                             ids[None], full_feats, torch.tensor([ids.numel() - 1]), size)[0, 0]
    torch.testing.assert_close(busy, full, atol=1e-4, rtol=1e-4)


def test_tiny_training_learns(trained_dflash):
    met = trained_dflash.train_metrics
    assert met["base"]["acc"][0] > 0.5 and met["markov"]["acc"][0] > 0.5  # row 1 agrees with the target


def test_tree_from_the_rows_top_k(deep, trained_dflash):
    """A tree of the rows' top-k: the best total_tokens nodes, closed under ancestors, no deeper than the block, and
    its argmax path is the chain's draft."""
    m = trained_dflash
    chain = _block_once(m, deep, PROMPTS[0], block_size=5)
    d = DFlashDrafter(m, deep, block_size=5, markov=True, tree_topk=3, total_tokens=9)
    start_drafter(d, deep, PROMPTS[0])
    t = d.propose(64, Sampling(), None)
    assert len(t) == 9 and int(t.depth.max()) <= 4 and bool((t.parents.cpu() < torch.arange(len(t))).all())
    first = [i for i in range(len(t)) if int(t.parents[i]) == -1]
    assert int(t.tokens[first[0]]) == int(chain.tokens[0])  # the best child of the root is the chain's first token


def test_markov_head_changes_the_draft_and_block_size_bounds_it(deep, drafters):
    import copy

    m = copy.deepcopy(drafters["random-markov"])
    m.markov_w2.weight.mul_(40)  # a strong head: its bias decides
    plain, markov = _block_once(m, deep, PROMPTS[0], markov=False), _block_once(m, deep, PROMPTS[0], markov=True)
    assert len(plain) == len(markov) == 5
    assert not torch.equal(plain.tokens, markov.tokens)  # the bias of the previous token matters
    with torch.no_grad():  # and it is the bias of the token drafted just before, row by row
        prev = torch.cat([deep.tokenizer(PROMPTS[0], return_tensors="pt")["input_ids"][0][-1:].to(deep.device),
                          markov.tokens[:-1]])
        d = DFlashDrafter(m, deep, block_size=6, markov=True, tree_topk=1, total_tokens=16)
        start_drafter(d, deep, PROMPTS[0])
        want = (d.block_logits(6) + m.markov_bias(prev)).argmax(-1)
    assert torch.equal(markov.tokens, want)
    d = DFlashDrafter(m, deep, block_size=8, markov=True, tree_topk=1, total_tokens=16)
    start_drafter(d, deep, PROMPTS[0])
    assert len(d.propose(3, Sampling(), None)) == 3  # never deeper than the engine allows


def test_a_tree_too_large_to_expand_is_refused(deep, drafters):
    """Each parameter within its bound, the tree they make together is not (every parameter alone: the conformance
    suite)."""
    with pytest.raises(InvalidInput, match="dflash tree: block_size 500 x tree_topk 50 expands"):
        generate(deep, PROMPTS[0], "dflash", models={"dflash": drafters["random"]}, block_size=500, tree_topk=50)


def test_traced_like_every_drafter(deep, trained_dflash, tmp_path):
    from speclab.trace import TraceStore

    with TraceStore(tmp_path / "t.duckdb") as store:
        res = generate(deep, PROMPTS[0], "dflash", models={"dflash": trained_dflash}, max_new_tokens=24, trace=store)
        toks = store.tokens(res.run_id)
        run = store.runs().set_index("run_id").loc[res.run_id]
    assert set(toks.source) <= {"dflash", "target"} and (toks.source == "dflash").sum() > 0
    assert len(toks) == len(res.token_ids) and run.method == "dflash" and run.status == "done"
