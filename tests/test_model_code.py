"""The one model-code path (speclab/core/layers.py): the decoder layer and the cached-attention step every forward
runs (the lean target, ConFu's contemplate rows, EAGLE-3, ConFu, DFlash, SpecBlock) against references written here:
transformers' own Llama / Qwen2 / Qwen3 layers, softmax attention spelled out, EAGLE-3's layer from its formula, and
the drafters' projections in the order their checkpoints' logits were made (bit for bit)."""
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from helpers import tiny_config
from speclab.core.layers import DecoderLayer, FusedLayer, attend, causal_mask, rope_tables
from speclab.core.lean import KVCache


def _qwen2_config():
    from transformers import Qwen2Config

    cfg = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3, eos_token_id=0)
    cfg._attn_implementation = "sdpa"
    return cfg


CONFIGS = {"qwen3": lambda: tiny_config("qwen3", 300, layers=3), "llama": lambda: tiny_config("llama", 300, layers=3),
           "qwen2 (qkv bias)": _qwen2_config}


def _hf_layers(cfg, n: int = 13):
    """A random HF model with random norm weights, and each decoder layer's input and output on n tokens."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    seen = []
    hooks = [layer.register_forward_hook(
        lambda _m, args, kwargs, out: seen.append((args[0] if args else kwargs["hidden_states"], out)),
        with_kwargs=True) for layer in model.model.layers]
    with torch.no_grad():
        model(torch.randint(2, 300, (1, n)))
    for h in hooks:
        h.remove()
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = model.model.rotary_emb
    cos, sin = rope_tables(rope.inv_freq, float(getattr(rope, "attention_scaling", 1.0)), n, torch.float32)
    return model, [(x[0], y[0]) for x, y in seen], cos[:, None], sin[:, None], D


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_fused_layer_is_the_transformers_layer(arch):
    """The lean target's layer (fused q/k/v and gate/up over the HF weights), attending through a KV cache in two
    calls (the cached-attention step, a causal mask in the second), gives transformers' layer outputs."""
    cfg = CONFIGS[arch]()
    model, io, cos, sin, D = _hf_layers(cfg)
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    layers = [FusedLayer(layer, H, KV, D, cfg.rms_norm_eps) for layer in model.model.layers]
    n, a = io[0][0].shape[0], 5
    cache = KVCache(len(layers), KV, D, torch.float32, "cpu", 32)
    with torch.inference_mode():  # a KVCache's tensors are inference tensors
        for i, (L, (x, want)) in enumerate(zip(layers, io)):
            outs = []
            for rows in (slice(0, a), slice(a, n)):
                q, k, v = L.qkv(x[rows], cos[rows], sin[rows])
                cache.write(i, rows.start, k, v)
                m = rows.stop - rows.start
                outs.append(L.finish(x[rows], cache.attend(i, q, rows.stop, causal_mask(m, rows.stop), D ** -0.5)))
            torch.testing.assert_close(torch.cat(outs), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_drafter_layer_loads_and_is_the_transformers_layer(arch):
    """The drafters' layer takes a transformers layer's weights under their own names (strict: the public
    checkpoints' layout) and computes its output; without q/k norms it is Llama's (EAGLE-3's kind of layer)."""
    cfg = CONFIGS[arch]()
    model, io, cos, sin, D = _hf_layers(cfg)
    for hf, (x, want) in zip(model.model.layers, io):
        layer = DecoderLayer(cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                             D, cfg.rms_norm_eps, qk_norm=arch == "qwen3")
        layer.load_state_dict(hf.state_dict(), strict=True)
        with torch.no_grad():
            q, k, v = layer.qkv(x, cos, sin)
            got = layer.finish(x, attend(q, k, v, causal_mask(x.shape[0], x.shape[0]), D ** -0.5))
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_cached_attention_step_is_softmax_attention():
    """KVCache.attend: queries over a layer's first `end` slots under a mask, grouped-query, is softmax attention
    spelled out; slots past `end` (NaN here) and other layers play no part."""
    g = torch.Generator().manual_seed(1)
    H, KV, D, start, n = 6, 2, 8, 9, 4
    cache = KVCache(2, KV, D, torch.float32, "cpu", 20)
    with torch.inference_mode():
        cache.k.fill_(float("nan"))
        cache.v.fill_(float("nan"))
    keys, vals = torch.randn(KV, start + n, D, generator=g), torch.randn(KV, start + n, D, generator=g)
    q = torch.randn(H, n, D, generator=g)
    mask = torch.rand(n, start + n, generator=g) > 0.4
    mask[:, 0] = True
    with torch.inference_mode():
        cache.write(1, 0, keys[:, :start], vals[:, :start])
        cache.write(1, start, keys[:, start:], vals[:, start:])
        got = cache.attend(1, q, start + n, mask, 0.3)
    rep = H // KV
    s = (q @ keys.repeat_interleave(rep, 0).transpose(1, 2)) * 0.3
    want = torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ vals.repeat_interleave(rep, 0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_eagle3_layer_is_its_formula():
    """EAGLE-3's layer (and ConFu's, the same model): x = [input_layernorm(embedding), hidden_norm(hidden)] (2 x d),
    attention without q/k norms, h' = h + o_proj(attention), h' + mlp(post_attention_layernorm(h')); with q_rows,
    only those rows' queries."""
    from speclab.drafters.eagle3 import Eagle3Config, Eagle3Model

    torch.manual_seed(2)
    c = Eagle3Config(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, vocab_size=50,
                     draft_vocab_size=50, target_hidden_size=32, layer_ids=(1, 2, 3))
    m = Eagle3Model(c).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1 if p.dim() == 1 else 0))
    n, D = 7, c.head_dim
    emb, h = torch.randn(n, 32), torch.randn(n, 32)
    cos, sin = m.rope(n, torch.float32)
    cos, sin = cos[:, None], sin[:, None]
    L = m.midlayer

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * w

    def rot(x):  # rotate_half with the sign in the sin table
        return x * cos + torch.cat([x[..., D // 2:], x[..., : D // 2]], -1) * sin

    x = torch.cat([norm(emb, L.input_layernorm.weight), norm(h, L.hidden_norm.weight)], -1)
    a = L.self_attn
    q = rot((x @ a.q_proj.weight.T).view(n, 4, D)).transpose(0, 1)
    k = rot((x @ a.k_proj.weight.T).view(n, 2, D)).transpose(0, 1).repeat_interleave(2, 0)
    v = (x @ a.v_proj.weight.T).view(n, 2, D).transpose(0, 1).repeat_interleave(2, 0)
    s = (q @ k.transpose(1, 2)) * D ** -0.5
    o = torch.softmax(s.masked_fill(~causal_mask(n, n), float("-inf")), -1) @ v
    h1 = h + o.transpose(0, 1).reshape(n, -1) @ a.o_proj.weight.T
    y = norm(h1, L.post_attention_layernorm.weight)
    want = h1 + (F.silu(y @ L.mlp.gate_proj.weight.T) * (y @ L.mlp.up_proj.weight.T)) @ L.mlp.down_proj.weight.T
    with torch.no_grad():
        q2, k2, v2 = m.qkv(emb, h, cos, sin)
        got = m.finish(h, attend(q2, k2, v2, causal_mask(n, n), D ** -0.5))
        q_last, _, _ = m.qkv(emb, h, cos, sin, q_rows=slice(n - 1, n))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(q_last, q2[:, -1:])


def test_drafters_and_target_run_the_shared_layer(deep):
    """Every model-code path is the shared one: the lean target's layers are FusedLayers, EAGLE-3's, ConFu's, DFlash's
    and SpecBlock's are DecoderLayers."""
    from helpers import random_confu, random_eagle3
    from speclab.drafters.dflash import DFlashConfig, DFlashModel
    from speclab.drafters.specblock import new_specblock

    assert all(isinstance(L, FusedLayer) for L in deep.lean.layers)
    c = deep.config
    dflash = DFlashModel(DFlashConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                                      num_hidden_layers=2, num_attention_heads=c.num_attention_heads,
                                      num_key_value_heads=c.num_key_value_heads, vocab_size=deep.vocab_size,
                                      target_layer_ids=(0, 1, 2), mask_token_id=2, head_dim=c.head_dim))
    specblock = new_specblock(c, deep.head_weight)
    layers = [random_eagle3(deep, 0).midlayer, random_confu(deep, 0).midlayer, *dflash.layers, *specblock.layers]
    assert all(isinstance(L, DecoderLayer) for L in layers)


def test_projections_keep_the_checkpoints_order():
    """The drafters' layer computes one Linear per projection and its norms as modules, in the order their
    checkpoints' logits were always made: bit for bit what that order gives (a fused matmul, or a norm written
    another way, would move the last bits of every zoo drafter's logits)."""
    torch.manual_seed(3)
    layer = DecoderLayer(32, 48, 4, 2, 8, 1e-6).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    x, attn = torch.randn(5, 32), torch.randn(4, 5, 8)
    cos, sin = rope_tables(1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8), 1.0, 5, torch.float32)
    cos, sin = cos[:, None], sin[:, None]
    a, m = layer.self_attn, layer.mlp
    hn = layer.input_layernorm(x)

    def rot(t):
        return t * cos + t.unflatten(-1, (2, -1)).flip(-2).flatten(-2) * sin

    want_q = rot(a.q_norm(a.q_proj(hn).unflatten(-1, (4, 8)))).transpose(-2, -3)
    want_k = rot(a.k_norm(a.k_proj(hn).unflatten(-1, (2, 8)))).transpose(-2, -3)
    want_v = a.v_proj(hn).unflatten(-1, (2, 8)).transpose(-2, -3)
    h = x + a.o_proj(attn.transpose(-2, -3).flatten(-2))
    y = layer.post_attention_layernorm(h)
    want = h + m.down_proj(F.silu(m.gate_proj(y)) * m.up_proj(y))
    with torch.no_grad():
        got = layer.qkv(x, cos, sin)
        for g, w in zip(got, (want_q, want_k, want_v)):
            assert torch.equal(g, w)
        assert torch.equal(layer.finish(x, attn), want)


@pytest.mark.parametrize("bias", [False, True])
def test_linear_is_f_linear_bit_for_bit_and_repacks_a_changed_weight(bias):
    """`linear` (bf16 on a CPU through a packed weight: AMX tiles where this process has them, else oneDNN's
    layout) returns F.linear's bits at every row count a decode uses, in 2-D and 3-D; a weight changed in place is
    packed again (no stale copy); autograd and fp32 take F.linear."""
    from speclab.core import layers, native

    torch.manual_seed(0)
    w = torch.randn(96, 80).bfloat16()
    b = torch.randn(96).bfloat16() if bias else None
    with torch.inference_mode():
        for rows in (1, 2, 5, 9, 16, 64, 257):  # a long prefill too (above the checked counts: F.linear itself)
            x = torch.randn(rows, 80).bfloat16()
            assert torch.equal(layers.linear(x, w, b), F.linear(x, w, b)), rows
        x3 = torch.randn(2, 7, 80).bfloat16()
        assert torch.equal(layers.linear(x3, w, b), F.linear(x3, w, b))
    # the fast path is taken exactly where the packed product is F.linear's on this machine (checked here directly)
    if native.product_module() is not None:  # a native copy (its product at every row count: tests/test_native.py)
        assert layers.is_native(w._speclab_packed[1])
    else:
        same = layers._PACKED_LINEAR is not None  # a torch built without oneDNN: never packed
        if same:
            packed = torch.ops.mkldnn._reorder_linear_weight(w, layers.PACK_ROWS)
            same = all(torch.equal(layers._PACKED_LINEAR(x, packed, b, "none", [], ""), F.linear(x, w, b))
                       for x in (torch.randn(r, 80).bfloat16() for r in (1, 5, 37)))
        assert (w._speclab_packed[1] is not None) == same
    w.mul_(-1)
    with torch.inference_mode():
        assert torch.equal(layers.linear(x3, w, b), F.linear(x3, w, b))
    wg = w.float().requires_grad_(True)
    y = layers.linear(x3.float(), wg)
    y.sum().backward()
    assert wg.grad is not None
