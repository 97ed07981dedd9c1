"""EAGLE-3: the public checkpoint layout loads, training's unrolled forward is the drafting forward, greedy
output equals AR for chains and trees (random, trained and reduced-vocabulary drafters, deferred on and off),
catching up over a backlog drafts what a never-idle drafter drafts, and sampling keeps the target's
distribution."""
import json

import pytest
import torch

from helpers import PROMPTS, assert_drafts_as_unrolled, build_tiny, start_drafter
from helpers import random_eagle3 as random_drafter
from speclab.core.sampling import Sampling
from speclab.core.target import Target
from speclab.drafters.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Model, default_layer_ids, load_eagle3
from speclab.errors import InvalidInput, ModelNotFound
from speclab.generate import generate
from speclab.train.eagle3 import target_features, ttt_forward


@pytest.fixture(scope="module")
def drafters(deep) -> dict[str, Eagle3Model]:
    """Random drafters (the full and a reduced vocabulary): nothing to train."""
    return {"random": random_drafter(deep, 0),
            "reduced-vocab": random_drafter(deep, 1, draft_vocab=deep.vocab_size // 2)}


@pytest.fixture(scope="module")
def all_drafters(drafters, trained_eagle3) -> dict[str, Eagle3Model]:
    """The random drafters and the one trained once per session (conftest.py)."""
    return {**drafters, "trained": trained_eagle3}


def test_default_layers_and_convention():
    assert default_layer_ids(32) == (2, 16, 29)  # the public default, hidden_states indices
    assert default_layer_ids(6) == (1, 3, 5)  # the zoo: (2, 3, 3) would collapse
    c = Eagle3Config(64, 128, 4, 2, 100, 100, 64, layer_ids=(1, 3, 5))
    assert c.target_layers == (0, 2, 4)  # hidden_states[j] is the output of speclab layer j - 1
    with pytest.raises(ValueError):
        default_layer_ids(3)


def _write_public(model: Eagle3Model, out, vllm_names: bool, bin_file: bool, embed: torch.Tensor | None = None):
    """A checkpoint written the way public EAGLE-3 repositories are: their config.json keys, their tensor names."""
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    if vllm_names:
        sd = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in sd.items()}
    if embed is not None:
        sd["embed_tokens.weight"] = embed.clone()
    c = model.config
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": c.hidden_size,
           "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
           "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "num_hidden_layers": 1,
           "rms_norm_eps": c.rms_norm_eps, "max_position_embeddings": c.max_position_embeddings,
           "vocab_size": c.vocab_size, "draft_vocab_size": c.draft_vocab_size, "tie_word_embeddings": False,
           "target_hidden_size": c.target_hidden_size, "rope_theta": c.rope_theta, "hidden_act": "silu",
           "torch_dtype": "float32", "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(c.layer_ids)}}
    (out / "config.json").write_text(json.dumps(cfg))
    if bin_file:
        torch.save(sd, out / "pytorch_model.bin")
    else:
        save_file(sd, str(out / "model.safetensors"))
    return out


def _draft_once(model, target, prompt, depth=4, top_k=3, total=8):
    d = Eagle3Drafter(model, target, depth=depth, tree_topk=top_k, total_tokens=total)
    start_drafter(d, target, prompt)
    return d.propose(depth, Sampling(), None)


@pytest.mark.parametrize("vllm_names,bin_file", [(False, False), (True, True)],
                         ids=["midlayer-safetensors", "layers0-bin"])
def test_public_layout_checkpoint_loads_cleanly(deep, drafters, tmp_path, vllm_names, bin_file):
    src = drafters["reduced-vocab"]
    embed = deep.model.get_input_embeddings().weight.detach()
    path = _write_public(src, tmp_path / "ckpt", vllm_names, bin_file, embed=embed if bin_file else None)
    m = load_eagle3(path, deep)  # strict: a missing or unexpected tensor is refused
    want = src.state_dict()
    got = m.state_dict()
    assert set(got) - {"embed_tokens.weight"} == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert m.config.layer_ids == src.config.layer_ids and m.config.draft_vocab_size == deep.vocab_size // 2
    assert (m.embed_tokens is not None) == bin_file
    # deterministic given the weights: two loads draft the same tree, in the target's vocabulary
    a, b = _draft_once(m, deep, PROMPTS[0]), _draft_once(load_eagle3(path, deep), deep, PROMPTS[0])
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    assert torch.equal(a.draft_probs, b.draft_probs)
    assert bool(src.t2d[a.tokens].all())  # only ids of the draft vocabulary, mapped back into the target's


def test_bad_checkpoints_are_refused_by_name(deep, drafters, tmp_path):
    path = _write_public(drafters["random"], tmp_path / "ok", vllm_names=False, bin_file=False)
    from safetensors.torch import load_file, save_file
    sd = load_file(str(path / "model.safetensors"))
    del sd["midlayer.self_attn.q_proj.weight"]
    save_file(sd, str(path / "model.safetensors"))
    with pytest.raises(ModelNotFound, match=r"missing midlayer\.self_attn\.q_proj\.weight"):
        load_eagle3(path, deep)
    with pytest.raises(ModelNotFound, match="no EAGLE-3 drafter"):
        load_eagle3(tmp_path / "nowhere", deep)
    other = Target.load(build_tiny("qwen3", tmp_path / "t6", seed=3, layers=2, hidden=32))
    good = _write_public(drafters["random"], tmp_path / "good", vllm_names=False, bin_file=False)
    with pytest.raises(ModelNotFound, match=r"trained for another target|layers"):
        load_eagle3(good, other)


def test_training_unroll_is_the_drafting_forward(deep, trained_eagle3):
    """Step s of training-time test at row i is exactly the depth-(s+1) draft after the context up to i."""
    m = trained_eagle3
    ids = deep.tokenizer(PROMPTS[2], return_tensors="pt")["input_ids"][0][:24]
    feats, _ = target_features(deep.model, ids[None], m.config.layer_ids)
    with torch.no_grad():
        unrolled = ttt_forward(m, deep.model.get_input_embeddings(), ids[None], feats, 3)
    i = ids.numel() - 5
    for kv_only in (True, False):
        d = Eagle3Drafter(m, deep, depth=4, tree_topk=1, total_tokens=8, kv_only=kv_only)
        out = deep.forward(ids[: i + 2], deep.new_cache(), layers=d.layers)
        d.reset(ids[: i + 2], out.features[: i + 1])
        d.catch_up(ids[:0], None)
        assert_drafts_as_unrolled(d, ids, i, unrolled)


def test_tiny_training_learns(trained_eagle3):
    assert trained_eagle3.train_acc[0] > 0.5  # depth-1 agreement with the target after a few seconds


SHAPES = [(4, 1, 4), (3, 2, 6), (4, 3, 10), (5, 4, 4), (2, 8, 16)]  # (depth, tree_topk, total_tokens)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["random", "trained", "reduced-vocab"])
@pytest.mark.parametrize("deferred", [True, False], ids=["deferred", "not-deferred"])
def test_greedy_eagle3_equals_ar(deep, all_drafters, kind, deferred):
    accepted = 0
    for p in PROMPTS[:3]:
        ar = generate(deep, p, "ar", max_new_tokens=40)
        for depth, topk, total in SHAPES:
            res = generate(deep, p, "eagle3", models={"eagle3": all_drafters[kind]}, depth=depth, tree_topk=topk,
                           total_tokens=total, deferred=deferred, max_new_tokens=40)
            assert res.token_ids == ar.token_ids, (p, depth, topk, total)
            accepted += len(res.token_ids) - res.decode.rounds
    if kind == "trained":
        assert accepted > 3 * len(SHAPES) * 40 * 0.5  # drafts are really accepted (paths deeper than 1 too)


def test_catch_up_over_a_backlog_drafts_what_a_never_idle_drafter_drafts(deep, trained_eagle3):
    """One drafter digests every round's tokens as they come (and drafts in between), the other sleeps and
    catches up on the whole backlog in one KV-only call: their next trees are the same."""
    m = trained_eagle3
    ids = deep.tokenizer(PROMPTS[1], return_tensors="pt")["input_ids"][0]
    ids = torch.cat([ids, torch.tensor(generate(deep, ids, "ar", max_new_tokens=20).token_ids)])
    feats = deep.forward(ids, deep.new_cache(), layers=m.config.target_layers).features
    n0 = ids.numel() - 20
    trees = {}
    for mode in ("busy", "idle-kv-only", "idle-full"):
        d = Eagle3Drafter(m, deep, depth=4, tree_topk=3, total_tokens=10, kv_only=mode != "idle-full")
        d.reset(ids[:n0], feats[: n0 - 1])
        d.catch_up(ids[:0], None)
        if mode == "busy":
            s = n0
            for step in (3, 1, 5, 2, 9):  # rounds of various lengths, a proposal and commit after each
                t = d.propose(4, Sampling(), None)
                d.commit(t, t.tokens[:0])
                d.catch_up(ids[s : s + step], feats[s - 1 : s + step - 1])
                s += step
        else:
            d.catch_up(ids[n0:], feats[n0 - 1 : -1])
        trees[mode] = d.propose(4, Sampling(), None)
    for mode in ("idle-kv-only", "idle-full"):
        assert torch.equal(trees[mode].tokens, trees["busy"].tokens)
        assert torch.equal(trees[mode].parents, trees["busy"].parents)
        torch.testing.assert_close(trees[mode].draft_probs, trees["busy"].draft_probs, atol=1e-5, rtol=1e-4)


def test_tree_is_the_best_total_tokens_and_closed_under_ancestors(deep, trained_eagle3):
    t = _draft_once(trained_eagle3, deep, PROMPTS[0], depth=4, top_k=3, total=9)
    assert len(t) == 9
    assert bool((t.parents < torch.arange(len(t))).all())  # topological
    # a node's cumulative probability never exceeds its parent's: the kept set is a top set of a falling score
    logp = t.draft_probs.log()
    cum = torch.zeros(len(t))
    for i, p in enumerate(t.parents.tolist()):
        cum[i] = logp[i] + (cum[p] if p >= 0 else 0)
    assert all(cum[i] <= cum[p] + 1e-6 for i, p in enumerate(t.parents.tolist()) if p >= 0)
    chain = _draft_once(trained_eagle3, deep, PROMPTS[0], depth=4, top_k=1, total=9)
    assert chain.is_chain and len(chain) == 4


def test_method_parameters_are_checked(deep, drafters):
    m = drafters["random"]
    for kw, says in [(dict(tree_topk=0), "tree_topk must be"), (dict(depth=0), "depth must be"),
                     (dict(total_tokens=5000), "total_tokens must be")]:
        with pytest.raises(InvalidInput, match=says):
            generate(deep, PROMPTS[0], "eagle3", models={"eagle3": m}, **kw)
    with pytest.raises(InvalidInput, match="needs an EAGLE-3 drafter"):
        generate(deep, PROMPTS[0], "eagle3")
    with pytest.raises(InvalidInput, match="not param=value"):
        generate(deep, PROMPTS[0], "eagle3:width=3", models={"eagle3": m})
    res = generate(deep, PROMPTS[0], "eagle3:tree_topk=1+depth=3", models={"eagle3": m}, tree_topk=4, max_new_tokens=8)
    assert res.method == "eagle3:tree_topk=1+depth=3"  # the spec's parameters win over the given ones


# ---- sampling through an EAGLE-3 tree keeps the target's distribution ----

@pytest.mark.slow
@pytest.mark.parametrize("shape", [(2, 3, 5), (2, 1, 2)], ids=["tree", "chain"])
def test_sampling_through_eagle3_keeps_target_distribution(tiny_v8, shape):
    """The first two sampled tokens follow the target's exact joint distribution with an EAGLE-3 tree or chain
    drafting (deterministic nodes: point-mass verification); depth-2 drafts are accepted in some of the decodes
    (a random drafter's greedy chain must hit the sampled token twice, the tree has three tries at depth 1).
    Power: a sample of the target's joint at temperature 0.7 is told apart by the same test."""
    from test_sampling import N_RUNS, assert_keeps_target_distribution

    depth, topk, total = shape
    target = tiny_v8
    drafter = Eagle3Drafter(random_drafter(target, 4), target, depth=depth, tree_topk=topk, total_tokens=total)
    assert_keeps_target_distribution(target, drafter, 10_000, N_RUNS // (40 if topk > 1 else 100))
