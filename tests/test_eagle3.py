"""EAGLE-3: the public checkpoint layout loads, training's unrolled forward is the drafting forward, a short training
learns, and the dynamic tree is the best total_tokens nodes. Greedy equals AR (chains, trees, a reduced vocabulary,
FlashHead; random and trained drafters; deferred on and off), sampling, catch-up over a backlog, bad parameters and
`reset`: the conformance suite (tests/test_conformance.py, over the shapes of its registry entry)."""
import json

import pytest
import torch

from helpers import PROMPTS, assert_drafts_as_unrolled, build_tiny, start_drafter
from speclab.core.sampling import Sampling
from speclab.core.target import Target
from speclab.drafters.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Model, default_layer_ids, load_eagle3
from speclab.drafters.eagle3 import random_eagle3 as random_drafter
from speclab.errors import ModelNotFound
from speclab.train.eagle3 import target_features, ttt_forward


@pytest.fixture(scope="module")
def drafters(deep) -> dict[str, Eagle3Model]:
    """Random drafters (the full and a reduced vocabulary): nothing to train."""
    return {"random": random_drafter(deep, 0),
            "reduced-vocab": random_drafter(deep, 1, draft_vocab=deep.vocab_size // 2)}


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


@pytest.mark.cpu_only
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


def test_tree_is_the_best_total_tokens_and_closed_under_ancestors(deep, trained_eagle3):
    t = _draft_once(trained_eagle3, deep, PROMPTS[0], depth=4, top_k=3, total=9)
    assert len(t) == 9
    assert bool((t.parents.cpu() < torch.arange(len(t))).all())  # topological
    # a node's cumulative probability never exceeds its parent's: the kept set is a top set of a falling score
    logp = t.draft_probs.log().cpu()
    cum = torch.zeros(len(t))
    for i, p in enumerate(t.parents.tolist()):
        cum[i] = logp[i] + (cum[p] if p >= 0 else 0)
    assert all(cum[i] <= cum[p] + 1e-6 for i, p in enumerate(t.parents.tolist()) if p >= 0)
    chain = _draft_once(trained_eagle3, deep, PROMPTS[0], depth=4, top_k=1, total=9)
    assert chain.is_chain and len(chain) == 4


def test_the_depth_default_follows_the_temperature(deep, drafters, trained_dflash):
    """A parameter may have a CPU default of its own at T > 0 (`Param.sampled`, measured there: the model cards):
    DFlash's block is 5 rows at T = 0 and 6 above, in the decode's parameters as recorded on its run; a value given
    stays, and on CUDA the GPU preset holds at every temperature. EAGLE-3's chain is 4 deep at every temperature (3
    at T > 0 before block verification), and so are ConFu's, WhiFlash's and a route's EAGLE-3 arm's, which share the
    parameter."""
    from types import SimpleNamespace

    from speclab.generate import Generation, check_generation
    from speclab.methods import method_params
    models = {"eagle3": drafters["random"], "dflash": trained_dflash}
    block = {t: check_generation(deep, PROMPTS[0], "dflash", models, 8, temperature=t, seed=0).params["block_size"]
             for t in (0.0, 0.7, 1.0)}
    assert block == {0.0: 5, 0.7: 6, 1.0: 6}
    assert check_generation(deep, PROMPTS[0], "dflash:block_size=3", models, 8, temperature=1.0) \
        .params["block_size"] == 3
    assert check_generation(deep, PROMPTS[0], "dflash", models, 8, temperature=1.0, params={"block_size": 5}) \
        .params["block_size"] == 5
    shape = SimpleNamespace(vocab_size=deep.vocab_size, max_context=deep.max_context)
    cpu = SimpleNamespace(**vars(shape), device=SimpleNamespace(type="cpu"))
    for m in ("eagle3", "confu", "whiflash-entropy"):
        assert [method_params(m, {}, cpu, sampled=s)["depth"] for s in (False, True)] == [4, 4]
    cuda = SimpleNamespace(**vars(shape), device=SimpleNamespace(type="cuda"))
    assert {method_params("dflash", {}, cuda, sampled=s)["block_size"] for s in (False, True)} == {16}
    arm = {t: Generation(deep, PROMPTS[0], "route:arms=eagle3+pld", models=models, max_new_tokens=8, temperature=t,
                         seed=0).drafters["eagle3"].depth for t in (0.0, 1.0)}
    assert arm == {0.0: 4, 1.0: 4}
