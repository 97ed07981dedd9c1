"""A lean decoder forward over a Hugging Face model's own weights, with a preallocated KV cache.

On CPU (and for small models on any device) a transformers forward is mostly per-operation overhead:
module dispatch, mask and position building, cache bookkeeping, dtype round trips (see the zoo
experiment in the machine facts). `LeanDecoder` runs the same maths for the Llama family (Llama,
Qwen2, Qwen3: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU) with fewer operations:

- q/k/v and gate/up are fused into one matmul each. The fused tensors own the storage and the HF
  modules' weights become views into them, so memory is not doubled and the HF forward stays valid;
- cos/sin come from one table indexed by position (the HF rotary module's own `inv_freq`);
- keys and values are written in place into one preallocated tensor per cache (`KVCache`), so a
  rollback is a length change and keeping a tree path is one gather;
- the LM head runs only on the rows the caller needs.

Logits match the transformers forward to float rounding (tests/test_lean.py). Anything this module
does not cover (other architectures, sliding windows, dynamic rope, ...) is refused by `supports`,
and `Target` falls back to the transformers forward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

FAMILIES = ("llama", "qwen2", "qwen3")


def supports(model) -> str | None:
    """None when `LeanDecoder` can run `model`, else the reason it cannot."""
    cfg = model.config
    if cfg.model_type not in FAMILIES:
        return f"model type {cfg.model_type!r} (lean forward covers {', '.join(FAMILIES)})"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r}"
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or []):
        return "sliding-window layers"
    if getattr(cfg, "use_sliding_window", False):
        return "sliding-window attention"
    rope = getattr(model.model, "rotary_emb", None)
    if rope is None or getattr(rope, "rope_type", "default") in ("dynamic", "longrope"):
        return "a position-dependent rope scaling"
    if getattr(cfg, "mlp_bias", False):
        return "MLP biases"
    return None


class KVCache:
    """Keys and values of all layers in one preallocated tensor each: [layers, kv_heads, capacity, head_dim]
    (head-major, so attention reads contiguous rows and takes torch's fused CPU kernel)."""

    @torch.inference_mode()
    def __init__(self, n_layers: int, n_kv: int, head_dim: int, dtype, device, capacity: int = 256):
        self.k = torch.zeros(n_layers, n_kv, capacity, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.length = 0

    def get_seq_length(self) -> int:
        return self.length

    @torch.inference_mode()
    def reserve(self, n: int) -> None:
        cap = self.k.shape[2]
        if self.length + n > cap:
            new = max(2 * cap, self.length + n)
            for name in ("k", "v"):
                old = getattr(self, name)
                t = old.new_zeros(*old.shape[:2], new, old.shape[3])
                t[:, :, : self.length] = old[:, :, : self.length]
                setattr(self, name, t)

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    @torch.inference_mode()
    def keep(self, start: int, keep: torch.Tensor) -> None:
        """Keep positions [0, start) plus `start + keep` (ascending)."""
        idx = start + keep.to(self.k.device)
        m = keep.numel()
        self.k[:, :, start : start + m] = self.k[:, :, idx]
        self.v[:, :, start : start + m] = self.v[:, :, idx]
        self.length = start + m


class LeanDecoder:
    """The forward pass of a Llama-family HF model, over that model's weights (shared, not copied; only the
    small q/k norm weights are concatenated into a copy, so build a new decoder after training the model)."""

    def __init__(self, model):
        reason = supports(model)
        if reason:
            raise ValueError(f"lean forward does not support {reason}")
        cfg, inner = model.config, model.model
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        self.lm_head = model.get_output_embeddings().weight
        self.layers = [self._layer(layer) for layer in inner.layers]
        self.scaling = getattr(inner.layers[0].self_attn, "scaling", self.head_dim ** -0.5)
        self.dtype, self.device = self.embed.dtype, self.embed.device
        rope = inner.rotary_emb
        self.inv_freq = rope.inv_freq.float()
        self.rope_scale = float(getattr(rope, "attention_scaling", 1.0))
        self._rope_table(int(getattr(cfg, "max_position_embeddings", 2048)))

    def _layer(self, layer) -> dict:
        a, m = layer.self_attn, layer.mlp
        qkv = _fuse([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
        qkv_bias = None if a.q_proj.bias is None else _fuse([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
        gate_up = _fuse([m.gate_proj.weight, m.up_proj.weight])
        qk_norm = None
        if getattr(a, "q_norm", None) is not None:  # one [q_heads + kv_heads, D] weight for both norms
            qk_norm = torch.cat([a.q_norm.weight.expand(self.n_heads, -1), a.k_norm.weight.expand(self.n_kv, -1)])
        return {"in_norm": layer.input_layernorm.weight, "post_norm": layer.post_attention_layernorm.weight,
                "qkv": qkv, "qkv_bias": qkv_bias, "qk_norm": qk_norm, "o": a.o_proj.weight, "o_bias": a.o_proj.bias, "gate_up": gate_up, "down": m.down_proj.weight}

    def _rope_table(self, n: int) -> None:
        self.cos, self.sin = rope_tables(self.inv_freq, self.rope_scale, n, self.dtype)

    def new_cache(self, capacity: int = 256) -> KVCache:
        return KVCache(len(self.layers), self.n_kv, self.head_dim, self.dtype, self.device, capacity)

    def forward(self, ids: torch.Tensor, cache: KVCache, pos: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                layers: tuple[int, ...] = (), last: int | None = None, hidden: bool = False):
        """(logits, features, hidden) for `ids` [n] after the cache's tokens.

        logits [n or last, vocab]; features [n, len(layers) * d]: the outputs of those decoder layers, concatenated
        in the order given (None without layers); hidden [n or last, d]: the final-norm hidden state of the rows
        whose logits are returned (None unless asked). `mask` is an additive [1, 1, n, start + n] float mask (tree
        attention); the default is causal."""
        n, start = ids.numel(), cache.length
        end = start + n
        cache.reserve(n)
        if pos is None:
            pos = torch.arange(start, end, device=self.device)
        if end > self.cos.shape[0]:  # positions never exceed end - 1 (a tree node sits at start + its depth)
            self._rope_table(2 * end)
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # [n, 1, D]; sin carries rotate_half's sign
        if mask is None and n > 1:
            mask = torch.ones(n, end, dtype=torch.bool, device=self.device).tril(start)
        elif mask is not None:
            mask = mask[0, 0]  # Target has cast it to the model's dtype
        H, KV, D, eps = self.n_heads, self.n_kv, self.head_dim, self.eps
        h = self.embed[ids]
        kept = {}
        for i, L in enumerate(self.layers):
            x = F.rms_norm(h, h.shape[-1:], L["in_norm"], eps)
            qkv = F.linear(x, L["qkv"], L["qkv_bias"]).view(n, H + 2 * KV, D)
            qk, v = qkv[:, : H + KV], qkv[:, H + KV :]
            if L["qk_norm"] is not None:  # Qwen3: RMSNorm per head, q and k in one call
                qk = F.rms_norm(qk, (D,), None, eps) * L["qk_norm"]
            qk = apply_rope(qk, cos, sin)  # rotary embedding, q and k together
            k_cache, v_cache = cache.k[i], cache.v[i]  # [kv_heads, capacity, D]
            k_cache[:, start:end] = qk[:, H:].transpose(0, 1)
            v_cache[:, start:end] = v.transpose(0, 1)
            o = F.scaled_dot_product_attention(qk[None, :, :H].transpose(1, 2), k_cache[None, :, :end], v_cache[None, :, :end],
                                               attn_mask=mask, scale=self.scaling, enable_gqa=H != KV)  # 4D: the fused kernel
            h = h + F.linear(o[0].transpose(0, 1).reshape(n, H * D), L["o"], L["o_bias"])
            x = F.rms_norm(h, h.shape[-1:], L["post_norm"], eps)
            gate, up = F.linear(x, L["gate_up"]).chunk(2, -1)
            h = h + F.linear(F.silu(gate) * up, L["down"])
            if i in layers:
                kept[i] = h
        cache.length = end
        feats = (kept[layers[0]] if len(layers) == 1 else torch.cat([kept[i] for i in layers], -1)) if layers else None
        if last is not None:
            h = h[-last:]
        h = self.final_norm(h)
        return self.head(h), feats, h if hidden else None

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(h, h.shape[-1:], self.norm, self.eps)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.lm_head)


def rope_inv_freq(c) -> tuple[torch.Tensor, float]:
    """inv_freq and attention scaling of a drafter's rotary embedding (`c`: a config with rope_theta, rope_scaling,
    hidden_size, num_attention_heads, head_dim, max_position_embeddings) (transformers' own rope functions, so
    llama3 / linear / yarn scalings of public checkpoints are honoured)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    kw = {"rope_theta": c.rope_theta}
    if c.rope_scaling:
        kw["rope_scaling"] = dict(c.rope_scaling)
    cfg = LlamaConfig(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads, head_dim=c.head_dim,
                      max_position_embeddings=c.max_position_embeddings, **kw)
    rot = LlamaRotaryEmbedding(cfg)
    return rot.inv_freq.float().clone(), float(getattr(rot, "attention_scaling", 1.0))


def rope_tables(inv_freq: torch.Tensor, scale: float, n: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [n, head_dim] for positions 0..n-1; sin carries rotate_half's sign (see `apply_rope`)."""
    freqs = torch.arange(n, device=inv_freq.device).float()[:, None] * inv_freq.float()[None]
    emb = torch.cat([freqs, freqs], -1)
    sign = torch.cat([-torch.ones_like(freqs), torch.ones_like(freqs)], -1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * sign * scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding with tables from `rope_tables` (broadcast over heads): x*cos + rotate_half(x)*sin."""
    return x * cos + _swap_halves(x) * sin


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [x2, x1] on the last dim: rotate_half without its sign (the sin table has it)."""
    return x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)


def _fuse(params) -> torch.Tensor:
    """One tensor for the weights (or biases) of several Linear layers on the same input; the layers'
    parameters become views of it, so the HF forward keeps working on the same storage."""
    fused = torch.cat([p.data for p in params])
    row = 0
    for p in params:
        rows = p.shape[0]
        p.data = fused[row : row + rows]
        row += rows
    return fused
