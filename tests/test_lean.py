"""The lean forward (speclab/core/lean.py) against the transformers forward it replaces, on the same weights."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import NoTok as _NoTok
from helpers import tiny_config
from speclab.core.lean import supports
from speclab.core.target import Target, keep_cache
from speclab.core.tree import DraftTree, tree_attention_mask, tree_position_ids


def _pair(cfg, seed):
    """A lean and an hf Target over ONE model object (the lean one fuses weights; hf must still see them right),
    plus an untouched copy of the model as the reference."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ref = AutoModelForCausalLM.from_config(cfg).eval()
    ref.load_state_dict(model.state_dict())
    lean = Target(model, _NoTok(), backend="lean")
    return lean, Target(model, _NoTok(), backend="hf"), Target(ref, _NoTok(), backend="hf")


def _qwen2_config():
    from transformers import Qwen2Config

    cfg = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3, eos_token_id=0)
    cfg._attn_implementation = "sdpa"
    return cfg


CONFIGS = {"qwen3": lambda: tiny_config("qwen3", 300), "llama": lambda: tiny_config("llama", 300),
           "qwen2 (qkv bias)": _qwen2_config}


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_lean_logits_and_features_match_transformers(arch):
    lean, hf, ref = _pair(CONFIGS[arch](), seed=3)
    assert lean.backend == "lean" and hf.backend == "hf"
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, 300, (300,), generator=g)  # longer than the preallocated 256: the cache grows
    tree = DraftTree(torch.tensor([11, 12, 13, 14, 15]), torch.tensor([-1, 0, -1, 2, 3]), torch.ones(5))
    outs = []
    for t in (lean, hf, ref):
        cache = t.new_cache()
        first = t.forward(prompt[:-1], cache, layers=(1, 0), hidden=True)
        past = cache.get_seq_length()
        out = t.forward(torch.cat([prompt[-1:], tree.tokens]), cache, tree_position_ids(tree.depth, past, True),
                        tree_attention_mask(tree.ancestors, past, t.dtype, True), layers=(1, 0), hidden=True)
        keep_cache(cache, past, torch.tensor([0, 3, 4, 5]))  # root + the path 13 -> 14 -> 15
        after = t.forward(torch.tensor([42, 43]), cache, layers=(1, 0), hidden=True)
        outs.append((first, out, after))
    d = lean.hidden_size
    for got in outs[:2]:
        for a, b in zip(got, outs[2]):
            assert a.logits.shape == b.logits.shape
            assert torch.allclose(a.logits, b.logits, atol=1e-4), (a.logits - b.logits).abs().max()
            assert a.features.shape == (a.logits.shape[0], 2 * d)  # layer 1's output, then layer 0's
            assert torch.allclose(a.features, b.features, atol=1e-4)
            assert torch.allclose(a.hidden, b.hidden, atol=1e-4)
    # layer i's output is transformers' hidden_states[i + 1] (but for the last layer, which HF returns normed)
    states = ref.model(input_ids=prompt[None, :-1], output_hidden_states=True).hidden_states
    assert torch.allclose(outs[2][0].features[:, d:], states[1][0], atol=1e-5)


def test_last_rows_only():
    lean, hf, _ = _pair(CONFIGS["qwen3"](), seed=4)
    ids = torch.arange(5, 25)
    for t in (lean, hf):
        full = t.forward(ids, t.new_cache(), hidden=True)
        last = t.forward(ids, t.new_cache(), last=2, layers=(0,), hidden=True)
        assert last.logits.shape == (2, 300) and torch.allclose(last.logits, full.logits[-2:], atol=1e-5)
        assert last.hidden.shape == (2, t.hidden_size) and torch.allclose(last.hidden, full.hidden[-2:], atol=1e-5)
        assert last.features.shape == (20, t.hidden_size)  # features of every row, whatever `last` is
        assert full.features is None


def test_embed_and_head_are_the_targets_own():
    """`head(hidden)` gives the forward's logits and `embed` the model's input embeddings, on both backends."""
    lean, hf, _ = _pair(CONFIGS["qwen3"](), seed=5)
    ids = torch.arange(5, 12)
    for t in (lean, hf):
        out = t.forward(ids, t.new_cache(), hidden=True, layers=(1,))
        assert torch.allclose(t.head(out.hidden), out.logits, atol=1e-5)
        # the final norm is part of head(): the last layer's raw output gives the same logits
        assert torch.allclose(t.head(out.features), out.logits, atol=1e-4)
        assert torch.equal(t.embed(ids), t.model.get_input_embeddings().weight[ids])


def test_unsupported_models_fall_back_to_transformers():
    from transformers import GPT2Config

    model = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    assert "gpt2" in supports(model)
    t = Target(model, _NoTok())
    assert t.backend == "hf"
    assert t.forward(torch.tensor([1, 2, 3]), t.new_cache()).logits.shape == (3, 64)
    with pytest.raises(ValueError, match="lean backend does not support"):
        Target(model, _NoTok(), backend="lean")
    with pytest.raises(ValueError, match="backend must be one of"):
        Target(model, _NoTok(), backend="fast")
