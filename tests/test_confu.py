"""ConFu (issue 31): contemplate rows on the frozen target (speclab.drafters.contemplate).

Every future vector is checked against a brute-force reference: transformers' own forward of the path's tokens
followed by the contemplate embedding, with the soft prompts as a cache prefix that a 4D mask hides from the token
rows. Greedy equals AR (chains and trees, wide and after, full and reduced vocabulary, deferred on and off),
sampling, catch-up in one call, bad parameters and `reset`: the conformance suite (tests/test_conformance.py, over
the shapes of its registry entry); here, what is ConFu's own (the contemplate calls each schedule costs, a one-token
prompt, the hf backend, where f comes from, the checkpoint, training's forward)."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache

from helpers import PROMPTS, assert_drafts_as_unrolled, random_confu
from speclab.core.engine import decode
from speclab.core.lean import ConRows
from speclab.core.target import crop_cache
from speclab.core.tree import DraftTree, tree_attention_mask, tree_position_ids, tree_rows
from speclab.drafters.confu import ConFuDrafter
from speclab.drafters.contemplate import contemplate, last_token_rows


def soft_prompts(target, s: int, seed: int, scale: float = 1.0):
    """Random soft-prompt keys and values [layers, kv_heads, s, head_dim] at about the scale of real ones."""
    g = torch.Generator().manual_seed(seed)
    c = target.config
    shape = (target.num_layers, c.num_key_value_heads, s, c.head_dim)
    k, v = torch.randn(shape, generator=g) * scale, torch.randn(shape, generator=g) * scale
    return k.to(target.device), v.to(target.device)


def reference_future(target, tokens: torch.Tensor, emb: torch.Tensor, soft_k, soft_v) -> torch.Tensor:
    """f of one contemplate row after `tokens`, by transformers alone: the soft prompts in a DynamicCache, then
    [token rows ; the contemplate row] with the soft prompts hidden from the token rows, positions 0..T."""
    T, s, dev = tokens.numel(), soft_k.shape[2], target.device
    tokens = tokens.to(dev)
    ctx = DynamicCache(config=target.config)
    for i in range(target.num_layers):
        ctx.update(soft_k[i][None], soft_v[i][None], i)
    allowed = torch.ones(T + 1, s + T + 1, dtype=torch.bool, device=dev).tril(s)
    allowed[:T, :s] = False  # only the contemplate row sees the soft prompts
    mask = torch.zeros(1, 1, T + 1, s + T + 1, device=dev).masked_fill(~allowed, torch.finfo(torch.float32).min)
    embeds = torch.cat([target.model.get_input_embeddings()(tokens), emb[None]])[None]
    with torch.no_grad():
        out = target.decoder(inputs_embeds=embeds, position_ids=torch.arange(T + 1, device=dev)[None],
                             attention_mask=mask, past_key_values=ctx, use_cache=True)
    return out.last_hidden_state[0, -1]


def test_a_contemplate_row_after_a_prefix_is_transformers_own(qwen3, qwen3_hf):
    """One contemplate row after a cached prefix (the lean cache, and transformers' DynamicCache on the hf backend)
    equals the brute-force reference, and leaves the cache as it was."""
    ids = torch.tensor([5, 17, 3, 99, 42, 7, 64, 11])
    soft_k, soft_v = soft_prompts(qwen3, 4, seed=0)
    emb = torch.randn(qwen3.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(qwen3.device)
    ref = reference_future(qwen3, ids, emb, soft_k, soft_v)
    for target in (qwen3, qwen3_hf):
        cache = target.new_cache(32)
        target.prefill(ids, cache)
        before = [t.clone() for t in ((cache.k, cache.v) if target.lean else (cache.layers[0].keys,))]
        pos, visible = last_token_rows(ids.numel(), ids.numel())
        f = contemplate(target, cache, emb[None], pos, visible, soft_k, soft_v)
        torch.testing.assert_close(f[0], ref, atol=1e-4, rtol=1e-4)
        assert cache.get_seq_length() == ids.numel()
        after = (cache.k, cache.v) if target.lean else (cache.layers[0].keys,)
        assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_soft_prompts_reach_only_the_contemplate_row(qwen3):
    """Other soft prompts change f; with no soft prompt seen at all (s = 0) f is the plain target's final-norm
    state of the contemplate embedding in the prefix's context."""
    ids = torch.tensor([5, 17, 3, 99, 42])
    emb = torch.randn(1, qwen3.config.hidden_size, generator=torch.Generator().manual_seed(2)).to(qwen3.device)
    cache = qwen3.new_cache(16)
    qwen3.prefill(ids, cache)
    pos, visible = last_token_rows(ids.numel(), ids.numel())
    fa = contemplate(qwen3, cache, emb, pos, visible, *soft_prompts(qwen3, 4, seed=0))
    fb = contemplate(qwen3, cache, emb, pos, visible, *soft_prompts(qwen3, 4, seed=1))
    f0 = contemplate(qwen3, cache, emb, pos, visible, *soft_prompts(qwen3, 0, seed=0))
    assert not torch.allclose(fa, fb, atol=1e-3)
    torch.testing.assert_close(f0[0], reference_future(qwen3, ids, emb[0], *soft_prompts(qwen3, 0, seed=0)),
                               atol=1e-4, rtol=1e-4)


def test_each_node_of_a_tree_gets_the_future_of_its_own_path(qwen3):
    """A verification batch of a tree with two branches (root, then A and B at depth 1, each with a child): each
    node's contemplate row sees its own path, so its f equals the reference over that path alone, and the two
    branches' f differ. Deferred (the root leads the batch) and not (the root is already cached)."""
    prefix = torch.tensor([5, 17, 3, 99, 42])
    root = torch.tensor([7])
    tree = DraftTree(torch.tensor([64, 11, 23, 31]), torch.tensor([-1, -1, 0, 1]), torch.ones(4))
    soft_k, soft_v = soft_prompts(qwen3, 3, seed=4)
    emb = torch.randn(tree.tokens.numel() + 1, qwen3.config.hidden_size,
                      generator=torch.Generator().manual_seed(5)).to(qwen3.device)
    paths = [torch.cat([prefix, root])] + [torch.cat([prefix, root, tree.tokens[p]]) for p in
                                           ([0], [1], [0, 2], [1, 3])]
    refs = torch.stack([reference_future(qwen3, p, e, soft_k, soft_v) for p, e in zip(paths, emb)])
    for deferred in (True, False):
        cache = qwen3.new_cache(32)
        cached = prefix if deferred else torch.cat([prefix, root])
        qwen3.prefill(cached, cache)
        past = cache.get_seq_length()
        mask = tree_attention_mask(tree.ancestors, past, qwen3.dtype, with_root=deferred)
        pos = tree_position_ids(tree.depth, past, deferred)
        plain = qwen3.forward(torch.cat([root, tree.tokens]) if deferred else tree.tokens, cache, pos, mask)
        cpos, visible = tree_rows(tree.ancestors, tree.depth, past, with_root=deferred)
        f = contemplate(qwen3, cache, emb, cpos, visible, soft_k, soft_v)  # the after schedule
        torch.testing.assert_close(f, refs, atol=1e-4, rtol=1e-4)
        assert not torch.allclose(f[1], f[2], atol=1e-3) and not torch.allclose(f[3], f[4], atol=1e-3)
        crop_cache(cache, past)  # the wide schedule: the same rows inside the verification call
        wide = qwen3.forward(torch.cat([root, tree.tokens]) if deferred else tree.tokens, cache, pos, mask,
                             con=ConRows(emb, cpos, visible, soft_k, soft_v))
        torch.testing.assert_close(wide.future, refs, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(wide.logits, plain.logits, atol=1e-5, rtol=1e-5)
        assert cache.get_seq_length() == past + len(tree) + deferred  # no contemplate row in the cache


# ---- the drafter: EAGLE-3 plus the future slot, lossless ----

SHAPES = [(4, 1, 4), (3, 2, 6), (4, 3, 10)]  # (depth, tree_topk, total_tokens)


def _ids(target, prompt):
    return target.tokenizer(prompt, return_tensors="pt")["input_ids"][0]


@pytest.mark.parametrize("schedule", ["wide", "after"])
def test_contemplate_calls_per_schedule(deep, schedule, monkeypatch):
    """The contemplate rows in the verification call (wide) or after it: after costs one more target call a round;
    wide none past the first round's; the output is AR's either way."""
    import speclab.drafters.confu as confu
    calls = []
    monkeypatch.setattr(confu, "contemplate", lambda *a: (calls.append(1), contemplate(*a))[1])
    m = random_confu(deep, 0)
    ids = _ids(deep, PROMPTS[0])
    ar = decode(deep, ids, max_new_tokens=32)
    for depth, topk, total in SHAPES[::2]:
        d = ConFuDrafter(m, deep, depth=depth, tree_topk=topk, total_tokens=total, schedule=schedule)
        calls.clear()
        res = decode(deep, ids, {"confu": d}, max_new_tokens=32)
        assert torch.equal(res.new_ids, ar.new_ids), (depth, topk, total)
        assert len(calls) == (res.rounds if schedule == "after" else 1)


@pytest.mark.parametrize("schedule", ["wide", "after"])
def test_a_one_token_prompt_drafts_without_a_future_first(deep, schedule):
    """A one-token prompt has no token before the root and no features: the first round drafts without the future
    slot (EAGLE-3's catch-up), later rounds with it; the output is AR's."""
    m = random_confu(deep, 2)
    ids = _ids(deep, "The")[:1]
    ar = decode(deep, ids, max_new_tokens=12)
    d = ConFuDrafter(m, deep, depth=3, tree_topk=2, total_tokens=6, schedule=schedule)
    assert torch.equal(decode(deep, ids, {"confu": d}, max_new_tokens=12).new_ids, ar.new_ids)
    assert d.f is not None


def test_greedy_confu_equals_ar_on_the_hf_backend(tmp_path):
    """The same on transformers' forward (the contemplate row through `inputs_embeds` over a DynamicCache), for the
    4-layer target of `deep` built again."""
    from helpers import build_tiny
    from speclab.core.target import Target
    target = Target.load(build_tiny("qwen3", tmp_path / "t4", seed=7, layers=4), dtype="fp32", backend="hf")
    assert target.lean is None
    m = random_confu(target, 0)
    ids = _ids(target, PROMPTS[0])
    ar = decode(target, ids, max_new_tokens=24)
    for depth, topk, total in SHAPES[:2]:
        d = ConFuDrafter(m, target, depth=depth, tree_topk=topk, total_tokens=total)
        assert torch.equal(decode(target, ids, {"confu": d}, max_new_tokens=24).new_ids, ar.new_ids)


def test_the_future_vector_changes_the_draft_and_comes_from_the_token_before_the_root(deep):
    """The drafter's root row sees the future slot: other soft prompts give other draft logits; and the f the
    engine hands over is the contemplate row after the token before the root (what `contemplate` computes over a
    cache of the committed tokens)."""
    ids = _ids(deep, PROMPTS[0])
    got = {}
    for seed in (0, 1):
        m = random_confu(deep, 0)
        if seed:
            with torch.no_grad():
                m.confu.contemplation.soft_k.mul_(-1.0)
        d = ConFuDrafter(m, deep, depth=3, tree_topk=1, total_tokens=3)
        seen: list = []
        orig = d.see_future
        d.see_future = lambda f, n, orig=orig, seen=seen: (seen.append(f), orig(f, n))[1]
        decode(deep, ids, {"confu": d}, max_new_tokens=1)
        got[seed] = (seen[0], d)
    assert not torch.allclose(got[0][0], got[1][0], atol=1e-4)
    m, f = got[0][1].m, got[0][0]
    cache = deep.new_cache(64)
    out = deep.forward(ids[:-1], cache, layers=m.config.target_layers)
    c = m.confu.contemplation
    emb = c.con(out.features[-1:])
    ref = contemplate(deep, cache, emb, *last_token_rows(ids.numel() - 1, ids.numel() - 1), c.soft_k, c.soft_v)
    torch.testing.assert_close(f, ref, atol=1e-5, rtol=1e-5)


def test_checkpoint_round_trip_and_refusals(deep, tmp_path):
    """Saved in EAGLE-3's layout plus the `confu` section and `confu.*` tensors, loaded strictly (the same drafts);
    an EAGLE-3 directory, a checkpoint with a tensor missing, and one for another target are refused by name."""
    from safetensors.torch import load_file, save_file

    from helpers import random_eagle3
    from speclab.drafters.confu import load_confu
    from speclab.errors import ModelNotFound

    m = random_confu(deep, 3)
    m.save(tmp_path / "c", dtype=torch.float32)
    back = load_confu(tmp_path / "c", deep)
    ids = _ids(deep, PROMPTS[1])
    a, b = (decode(deep, ids, {"confu": ConFuDrafter(x, deep, depth=3, tree_topk=2, total_tokens=6)},
                   max_new_tokens=16) for x in (m, back))
    assert a.rounds == b.rounds and torch.equal(a.new_ids, b.new_ids)
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    assert cfg["confu"]["soft_prompts"] == 4 and "eagle_config" in cfg
    random_eagle3(deep, 0).save(tmp_path / "e", dtype=torch.float32)
    with pytest.raises(ModelNotFound, match=r"no `confu` section"):
        load_confu(tmp_path / "e", deep)
    sd = load_file(str(tmp_path / "c" / "model.safetensors"))
    del sd["confu.future.experts"]
    (tmp_path / "d").mkdir()
    save_file(sd, str(tmp_path / "d" / "model.safetensors"))
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelNotFound, match=r"missing confu\.future\.experts"):
        load_confu(tmp_path / "d", deep)
    cfg["confu"]["target_kv_heads"] += 1
    (tmp_path / "c" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelNotFound, match=r"do not match its config\.json|trained for another target"):
        load_confu(tmp_path / "c", deep)


@pytest.mark.cpu_only
def test_training_forward_is_the_drafting_forward(deep):
    """At an anchor a, training's forward (the frozen target's keys and values from transformers, the contemplate
    row through `contemplate_lean`, the unroll with the future slot) equals decoding's: the engine's f over a lean
    cache of tokens 0..a, the drafter's catch-up with the future slot (KV-only and full), then its nodes."""
    from speclab.drafters.contemplate import contemplate, last_token_rows
    from speclab.train.confu import ConFuTrainConfig, confu_forward, target_pass

    m = random_confu(deep, 5)
    ids = deep.tokenizer(PROMPTS[2], return_tensors="pt")["input_ids"][0][:24]
    a = ids.numel() - 6
    feats, _, keys, values = target_pass(deep.model, ids[None], m.config.layer_ids, 0)
    cfg = ConFuTrainConfig(target_dir="", corpus_dir="", out_dir="", replicate=2, ttt_steps=3)
    with torch.no_grad():
        unrolled, covered = confu_forward(m, deep.lean, deep.model.get_input_embeddings(), ids[None], feats, keys,
                                          values, torch.tensor([[a]]), cfg)
    assert covered[0].tolist() == [a <= i <= a + 2 for i in range(ids.numel() - 1)]
    c = m.confu.contemplation
    for kv_only in (True, False):
        d = ConFuDrafter(m, deep, depth=4, tree_topk=1, total_tokens=8, kv_only=kv_only)
        cache = deep.new_cache()
        out = deep.forward(ids[: a + 1], cache, layers=d.layers)
        with torch.inference_mode():
            f = contemplate(deep, cache, c.con(out.features[a:]), *last_token_rows(a + 1, a + 1), c.soft_k, c.soft_v)
        d.reset(ids[: a + 2], out.features)
        d.see_future(f, a + 1)
        d.catch_up(ids[:0], None)
        assert_drafts_as_unrolled(d, ids, a, unrolled)
