"""The model code every forward in speclab shares: one decoder layer, one attention step and the rotary embedding.

The target's lean forward (`speclab.core.lean`), ConFu's contemplate rows on it (`speclab.drafters.contemplate`) and
the drafters (EAGLE-3 and ConFu, DFlash, SpecBlock: `speclab.drafters`) all run the Llama / Qwen decoder layer:

    q, k, v = heads(input_norm(h))     per-head q / k RMSNorms (Qwen3, DFlash, SpecBlock); RoPE on q and k
    a = softmax(q k^T * scale + mask) v         grouped-query: a kv head serves heads / kv_heads query heads
    h = h + o_proj(a);  h = h + down(silu(gate(x)) * up(x)),  x = post_attention_norm(h)

`Layer` writes it once, in the two pieces on either side of attention: `qkv` and `finish`. Attention sits between
them because each caller attends over its own keys: a KV cache (`attend`, the step `speclab.core.lean.KVCache.attend`
takes over a cache), a block's context and itself (DFlash), the soft prompts, a cache and itself (ConFu's
contemplate rows), training's unrolled windows. Two kinds of weights carry the layer, each computing its projections
its own way (a fused matmul is not bitwise the split ones, so each keeps the one its logits were always made with):

- `FusedLayer`: a Hugging Face Llama / Qwen2 / Qwen3 layer's weights for the lean forward, q/k/v and gate/up fused
  into one matmul each, both q/k norms in one call;
- `DecoderLayer`: the drafters' nn.Module, one Linear per projection, with the public checkpoints' parameter names
  (`self_attn.q_proj`, `mlp.gate_proj`, `input_layernorm`, ...). Its variants are parameters: EAGLE-3's layer reads
  [embedding, hidden] (`d_in` = 2 x d; it builds that input itself, `speclab.drafters.eagle3`) and has no q/k norms;
  DFlash's context rows take the layer's keys and values alone (`Attention.kv`, no input norm: the context is
  normed before it).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from speclab.core import pages

# -- the matmul -----------------------------------------------------------------------------------------------------

# bf16 weights on a CPU through a packed copy (`linear`): the layout of `native.cpp`'s own product where this process
# has one (`NATIVE_SOURCE`: AMX tiles, or AVX512-BF16 dot products), else oneDNN's prepacked layout; False (or
# SPECLAB_PACKED=0 in the environment, to compare): F.linear everywhere
PACKED = os.environ.get("SPECLAB_PACKED", "1") != "0"
PACK_ROWS = 8  # the batch size oneDNN's layout is chosen for (a packing chosen for 1 row differs in the last bit from
# F.linear from about 40 rows on; 8 matched F.linear at 1 to 200 rows here)
CHECK_ROWS = (1, 5, 37, 200)  # a decode step, a verification, prefills: where oneDNN's copy must be F.linear's bits;
# above the last, F.linear (oneDNN's product of 257 rows differed from F.linear's in the last bit on 512 x 1536)
TILE_ROWS = 32  # the most rows a native product takes (oneDNN's AMX product of 33 rows and more sums in another
# order, so a few outputs in 10,000 differ in the last bit); more rows beside a native copy: oneDNN's kept copy
# (`_wide`)
# `speclab.core.native` sets this to a function that returns its compiled module where one of its products runs in
# this process (AMX tiles the kernel lets it use, or AVX512-BF16), else None
NATIVE_SOURCE: Callable[[], Any] | None = None
# `speclab.core.native` sets this to a function that returns its compiled module where its attention runs in this
# process (`attend`), else None
ATTENTION_SOURCE: Callable[[], Any] | None = None
# a native product's copy by its dims: the operator that multiplies by it
_NATIVE_OPS = {6: "tile_linear", 4: "dp_linear"}
_PACKED_LINEAR: Any
try:
    _PACKED_LINEAR = torch.ops.mkldnn._linear_pointwise
except (AttributeError, RuntimeError):  # a torch built without oneDNN: F.linear everywhere
    _PACKED_LINEAR = None


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, w, b)`, bitwise. A bf16 call on a CPU outside autograd multiplies by a copy of w packed once:
    F.linear reorders the weight on every call, which on the zoo's shapes (1-16 rows) is a third to half of the
    call, and oneDNN's product of a few rows costs 1.4-1.6x what `native.cpp`'s AMX tile product costs, and 1.5-3x
    what its AVX512-BF16 product costs on a CPU without AMX (measured: docs/ARCHITECTURE.md "Prepacked weights").
    The copy is checked against F.linear when it is made, and a weight whose packed product differs in any bit (or a
    torch and CPU with no product) keeps F.linear."""
    if PACKED and w.dtype is torch.bfloat16 and x.dtype is torch.bfloat16 and w.device.type == "cpu" \
            and not torch.is_grad_enabled():
        packed = _packed(w, b)
        if packed is not None:
            return by_packed(x, w, packed, b)
    return F.linear(x, w, b)


def by_packed(x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x times w by its packed copy (`_packed`): a native product's (`is_native`) up to `TILE_ROWS` rows; oneDNN's
    (that copy, or `_wide`'s beside a native copy) up to the last of `CHECK_ROWS`; F.linear above."""
    rows = x.numel() // max(x.shape[-1], 1)
    if packed.dtype is torch.int8:  # a drafter's int8 weight (`quantize_int8`)
        if rows > INT8_ROWS:
            return F.linear(x, w, b)
        return torch.ops.speclab.i8_linear(x, packed, _wide(w, b), b, w.shape[0], w.shape[1])
    onednn: torch.Tensor | None = packed
    if is_native(packed):
        if rows <= TILE_ROWS:
            return getattr(torch.ops.speclab, _NATIVE_OPS[packed.dim()])(x, packed, b, w.shape[0], w.shape[1])
        onednn = _wide(w, b)
    if onednn is not None and rows <= CHECK_ROWS[-1]:
        return _PACKED_LINEAR(x, onednn, b, "none", [], "")
    return F.linear(x, w, b)


def _packed(w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor | None:
    """w's packed copy, made on first use and kept on w itself (so it lives and dies with w; a weight changed in
    place since is packed again): the layout of this process's native product where it has one and its products
    are F.linear's bits at 1 to `TILE_ROWS` rows (checked at four), else oneDNN's where they are at `CHECK_ROWS`;
    None where neither is. A drafter's int8 weight (`quantize_int8`, unchanged since): its packed int8 values."""
    held = getattr(w, "_speclab_int8", None)
    if held is not None and held[0] == w._version:
        return held[1]

    def make():
        mod = NATIVE_SOURCE() if NATIVE_SOURCE is not None else None
        if mod is not None:
            cand = _made(mod.native_pack, w)
            if cand is not None and _agrees(lambda x: by_packed(x, w, cand, b), w, b, (1, 5, 16, TILE_ROWS)):
                return pages.on_huge_pages(cand)
        return _onednn(w, b, CHECK_ROWS)
    return _kept(w, "_speclab_packed", make)


def is_native(packed: torch.Tensor) -> bool:
    """Whether a packed copy is a native product's (`native.cpp`'s tile or dot-product layout), not oneDNN's."""
    return packed.dim() in _NATIVE_OPS


def _wide(w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor | None:
    """oneDNN's copy of w beside its native copy, for calls of more rows than the native product takes (a
    verification of a big tree, a batch of many requests, a prefill), made on first use and kept on w like
    `_packed`'s; None where its products are not F.linear's bits at `CHECK_ROWS` above `TILE_ROWS`, or there is no
    oneDNN. An int8 weight's (`quantize_int8`): its scales and sums [2, N]."""
    held = getattr(w, "_speclab_int8", None)
    if held is not None and held[0] == w._version:
        return held[2]
    return _kept(w, "_speclab_wide",
                 lambda: _onednn(w, b, (TILE_ROWS + 1, *[r for r in CHECK_ROWS if r > TILE_ROWS])))


def _onednn(w: torch.Tensor, b: torch.Tensor | None, rows) -> torch.Tensor | None:
    """w prepacked into oneDNN's layout where its products are F.linear's bits at `rows`, else None."""
    if _PACKED_LINEAR is None:
        return None
    cand = _made(lambda w: torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS), w)
    if cand is not None and _agrees(lambda x: _PACKED_LINEAR(x, cand, b, "none", [], ""), w, b, rows):
        return cand
    return None


# -- int8 drafter weights -------------------------------------------------------------------------------------------

# the most rows a drafter's int8 weight multiplies by `native.cpp`'s int8 product (`by_packed`; its `int8_max_rows`,
# set from this); more take F.linear by the bf16 weight, which holds the same values
INT8_ROWS = 8


def quantize_int8(w: torch.Tensor) -> None:
    """A drafter's bf16 weight [N, K] as int8 values q times one power-of-two scale per output, in place: w becomes
    exactly q x scale (|q| <= 127 and a power of two make every product a bf16 value) and keeps q packed for
    `native.cpp`'s int8 product (`i8_linear`: half the bytes, the input rows quantized to 8 bits each call) with the
    scales and q's sums (`_packed`, `_wide`). A drafter's weights may be anything without losing exactness: the
    target verifies; what it costs in acceptance is measured."""
    if w.dtype is not torch.bfloat16 or w.dim() != 2 or w.device.type != "cpu":
        raise ValueError(f"quantize_int8 takes a 2-D bf16 CPU weight (got {tuple(w.shape)} {w.dtype} on {w.device})")
    N, K = w.shape
    with torch.no_grad():
        wf = w.float()
        top = wf.abs().amax(1).clamp_min(torch.finfo(torch.float32).tiny)
        scale = torch.exp2(torch.ceil(torch.log2(top / 127)))  # the smallest power of two with |w| / scale <= 127
        q = torch.round(wf / scale[:, None]).clamp_(-127, 127)
        w.copy_((q * scale[:, None]).to(torch.bfloat16))  # exact: 8 significant bits times a power of two
        G, KQ = -(-N // 64), -(-K // 4)
        padded = torch.zeros(G * 64, KQ * 4, dtype=torch.int8)
        padded[:N, :K] = q.to(torch.int8)
        packed = padded.view(G, 64, KQ, 4).permute(0, 2, 1, 3).contiguous()  # [G, KQ, 64, 4]
        meta = torch.stack([scale, q.sum(1)]).float().contiguous()  # [2, N]: the scales, q's sums (exact in fp32)
    w._speclab_int8 = (w._version, packed, meta)  # type: ignore[attr-defined]


def reads_int8(model) -> bool:
    """Whether a drafter model's products read int8 weights (`quantize_int8`): an nn.Module's parameters, or a draft
    model's (a `Target`'s) lean layers."""
    lean = getattr(model, "lean", None)
    if lean is not None:
        return hasattr(lean.layers[0].qkv_w, "_speclab_int8")
    return isinstance(model, nn.Module) and any(hasattr(p, "_speclab_int8") for p in model.parameters())


def _made(pack, w: torch.Tensor) -> torch.Tensor | None:
    """pack(w), or None for a shape the product refuses."""
    try:
        return pack(w)
    except RuntimeError:
        return None


def _agrees(product, w: torch.Tensor, b: torch.Tensor | None, rows) -> bool:
    """Whether product(x) is F.linear(x, w, b) bit for bit on random inputs of each row count in `rows`: normal ones
    and SwiGLU-like ones (silu(gate) * up: many small values beside a few large), whose sums tell two summation
    orders apart several times more often (a one-row blocking that normal inputs passed, `native.cpp`'s `dp_block`)."""
    gen = torch.Generator().manual_seed(0)

    def inputs(n):
        x = torch.randn(n, w.shape[1], generator=gen)
        return x.to(w.dtype), (F.silu(3 * x) * torch.randn(x.shape, generator=gen)).to(w.dtype)
    try:
        return all(torch.equal(product(x), F.linear(x, w, b)) for n in rows for x in inputs(n))
    except RuntimeError:  # a shape the product refuses
        return False


def _kept(w: torch.Tensor, attr: str, make):
    """make()'s value kept on w under `attr` while w is unchanged in place (an inference tensor never changes)."""
    version = w._version if not w.is_inference() else -1
    held = getattr(w, attr, None)
    if held is None or held[0] != version:
        held = (version, make())
        setattr(w, attr, held)
    return held[1]


class Linear(nn.Linear):
    """nn.Linear through `linear` (same parameters, same state-dict keys)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


# -- the rotary embedding -------------------------------------------------------------------------------------------


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


_ROPE_KEPT: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # inference mode's tables, by what makes them
_ROPE_KEEP = 8  # at most this many kept (a few models x dtypes)


def rope_tables(inv_freq: torch.Tensor, scale: float, n: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [n, head_dim] for positions 0..n-1; sin carries rotate_half's sign (see `apply_rope`).
    In inference mode the same tables are returned again for the same arguments (read only: a drafter built for
    every request of a batch takes them in 3 us instead of 0.3 ms); outside it, made anew (training's autograd may
    not save inference tensors)."""
    key = (tuple(inv_freq.tolist()), scale, n, dtype, inv_freq.device) if torch.is_inference_mode_enabled() else None
    if key is not None and key in _ROPE_KEPT:
        return _ROPE_KEPT[key]
    freqs = torch.arange(n, device=inv_freq.device).float()[:, None] * inv_freq.float()[None]
    emb = torch.cat([freqs, freqs], -1)
    sign = torch.cat([-torch.ones_like(freqs), torch.ones_like(freqs)], -1)
    tables = (emb.cos() * scale).to(dtype), (emb.sin() * sign * scale).to(dtype)
    if key is not None:
        if len(_ROPE_KEPT) >= _ROPE_KEEP:
            _ROPE_KEPT.clear()
        _ROPE_KEPT[key] = tables
    return tables


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding with tables from `rope_tables` (broadcast over heads): x*cos + rotate_half(x)*sin."""
    return x * cos + _swap_halves(x) * sin


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [x2, x1] on the last dim: rotate_half without its sign (the sin table has it)."""
    return x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)


# -- attention ------------------------------------------------------------------------------------------------------


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Attention of queries q [.., heads, n, D] over keys and values [.., kv_heads, slots, D] (grouped-query when
    kv_heads < heads) under `mask` ([.., n, slots]: bool, True = seen, or additive; None: every slot), through
    torch's fused kernel. A 3-D call runs as a batch of one: the fused CPU kernel takes 4-D inputs only. On a CPU
    outside autograd where `native.cpp`'s attention runs (`ATTENTION_SOURCE`), through its operator
    `speclab::attention`: a bf16 decode's few query rows by its own loop (the fused kernel's cost grows 4x from 20 to
    200 keys; docs/ARCHITECTURE.md), everything else the fused kernel as here."""
    if q.device.type == "cpu" and not torch.is_grad_enabled() and ATTENTION_SOURCE is not None \
            and ATTENTION_SOURCE() is not None:
        return torch.ops.speclab.attention(q, k, v, mask, scale)
    gqa = q.shape[-3] != k.shape[-3]
    if gqa and mask is not None and q.is_cuda:  # CUDA's kernels take a mask or enable_gqa, not both (the math
        # fallback then: a dozen kernels per call, measured on an H200), so the kv heads are repeated instead
        rep = q.shape[-3] // k.shape[-3]
        k, v, gqa = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3), False
    if q.dim() == 3:
        return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale,
                                              enable_gqa=gqa)[0]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def causal_mask(n: int, end: int, device=None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[n, end]: the last n of `end` slots as rows, each seeing every slot up to its own. Bool, or with `dtype` (the
    queries') the additive mask (0, or -inf where hidden) that attention makes of the bool one in every layer, made
    once per forward instead: the same bits (ad hoc check, bf16 and fp32), 3% of a 5-row bf16 verification saved."""
    see = torch.ones(n, end, dtype=torch.bool, device=device).tril(end - n)
    return see if dtype is None else torch.zeros(n, end, dtype=dtype, device=device).masked_fill_(~see, float("-inf"))


# -- the decoder layer ----------------------------------------------------------------------------------------------


class Layer:
    """The decoder layer's math in its two pieces around attention. `qkv(h, cos, sin)`: queries [.., heads, n, D],
    keys and values [.., kv_heads, n, D] of rows h [.., n, d] (input norm, projections, q/k norms, RoPE at the rows'
    cos / sin [.., n, 1, D]); `finish(h, attn)`: the rest. A subclass holds the weights and says how each projection
    is computed (`attn_out`, `post_norm`, `ffn`)."""

    def qkv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        raise NotImplementedError

    def attn_out(self, a: torch.Tensor) -> torch.Tensor:
        """o_proj of the heads' outputs, concatenated [.., n, heads * D]."""
        raise NotImplementedError

    def post_norm(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        """The SwiGLU MLP: down(silu(gate(x)) * up(x))."""
        raise NotImplementedError

    def finish(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The layer after attention: residual + o_proj(attention output attn [.., heads, n, D]), then residual +
        the MLP of the post-attention norm."""
        h = h + self.attn_out(attn.transpose(-2, -3).flatten(-2))
        return h + self.ffn(self.post_norm(h))


class FusedLayer(Layer):
    """A Hugging Face Llama / Qwen2 / Qwen3 decoder layer's weights as the lean forward runs them (shared, not
    copied): q/k/v and gate/up fused into one matmul each (the HF modules' weights become views of the fused tensors,
    so memory is not doubled and the HF forward stays valid), the q and k norms' weights (Qwen3) in one
    [heads + kv_heads, D] tensor so both norms are one call (a copy: build a new layer after training the model)."""

    def __init__(self, layer, heads: int, kv_heads: int, head_dim: int, eps: float):
        a, m = layer.self_attn, layer.mlp
        self.H, self.KV, self.D, self.eps = heads, kv_heads, head_dim, eps
        self.in_norm, self.post = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        self.qkv_w = _fuse([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
        self.qkv_b = None if a.q_proj.bias is None else _fuse([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
        self.qk_norm = None
        if getattr(a, "q_norm", None) is not None:
            self.qk_norm = torch.cat([a.q_norm.weight.expand(heads, -1), a.k_norm.weight.expand(kv_heads, -1)])
        self.o, self.o_bias = a.o_proj.weight, a.o_proj.bias
        self.gate_up, self.down = _fuse([m.gate_proj.weight, m.up_proj.weight]), m.down_proj.weight

    def qkv(self, h, cos, sin):
        H, KV, D = self.H, self.KV, self.D
        x = F.rms_norm(h, h.shape[-1:], self.in_norm, self.eps)
        qkv = linear(x, self.qkv_w, self.qkv_b).unflatten(-1, (H + 2 * KV, D))
        qk, v = qkv[..., : H + KV, :], qkv[..., H + KV :, :]
        if self.qk_norm is not None:  # Qwen3: RMSNorm per head, q and k in one call
            qk = F.rms_norm(qk, (D,), None, self.eps) * self.qk_norm
        qk = apply_rope(qk, cos, sin).transpose(-2, -3)  # rotary embedding, q and k together
        return qk[..., :H, :, :], qk[..., H:, :, :], v.transpose(-2, -3)

    def attn_out(self, a):
        return linear(a, self.o, self.o_bias)

    def post_norm(self, h):
        return F.rms_norm(h, h.shape[-1:], self.post, self.eps)

    def ffn(self, x):
        gate, up = linear(x, self.gate_up).chunk(2, -1)
        return linear(F.silu(gate) * up, self.down)


def _fuse(params) -> torch.Tensor:
    """One tensor for the weights (or biases) of several Linear layers on the same input; the layers'
    parameters become views of it, so the HF forward keeps working on the same storage."""
    fused = pages.on_huge_pages(torch.cat([p.data for p in params]))
    row = 0
    for p in params:
        rows = p.shape[0]
        p.data = fused[row : row + rows]
        row += rows
    return fused


class Attention(nn.Module):
    """q/k/v/o projections from `d_in` (EAGLE-3 reads [embedding, hidden], 2 x d), optionally with per-head q/k
    RMSNorms (Qwen3, DFlash, SpecBlock)."""

    def __init__(self, d_in: int, d_model: int, heads: int, kv_heads: int, head_dim: int, bias: bool = False,
                 qk_norm_eps: float | None = None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = Linear(d_in, heads * head_dim, bias=bias)
        self.k_proj = Linear(d_in, kv_heads * head_dim, bias=bias)
        self.v_proj = Linear(d_in, kv_heads * head_dim, bias=bias)
        self.o_proj = Linear(heads * head_dim, d_model, bias=bias)
        self.qk_norm = qk_norm_eps is not None
        if self.qk_norm:
            self.q_norm = nn.RMSNorm(head_dim, eps=qk_norm_eps)
            self.k_norm = nn.RMSNorm(head_dim, eps=qk_norm_eps)

    def qkv(self, x: torch.Tensor, cos, sin, q_rows: slice | None = None):
        """Queries [.., heads, n_q, D] of the rows `q_rows` (default all) and keys, values [.., kv_heads, n, D] of
        normed inputs x [.., n, d_in]; rotary applied (cos / sin [.., n, 1, D])."""
        xq = x if q_rows is None else x[..., q_rows, :]
        q = self.q_proj(xq).unflatten(-1, (self.heads, self.head_dim))
        if self.qk_norm:
            q = self.q_norm(q)
        k, v = self.kv(x, cos, sin)
        cq, sq = (cos, sin) if q_rows is None else (cos[..., q_rows, :, :], sin[..., q_rows, :, :])
        return apply_rope(q, cq, sq).transpose(-2, -3), k, v

    def kv(self, x: torch.Tensor, cos, sin):
        """Keys and values [.., kv_heads, n, D] of normed inputs x [.., n, d_in] (rotary applied to the keys)."""
        k = self.k_proj(x).unflatten(-1, (self.kv_heads, self.head_dim))
        if self.qk_norm:
            k = self.k_norm(k)
        v = self.v_proj(x).unflatten(-1, (self.kv_heads, self.head_dim))
        return apply_rope(k, cos, sin).transpose(-2, -3), v.transpose(-2, -3)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, d_model: int, intermediate: int):
        super().__init__()
        self.gate_proj = Linear(d_model, intermediate, bias=False)
        self.up_proj = Linear(d_model, intermediate, bias=False)
        self.down_proj = Linear(intermediate, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(Layer, nn.Module):
    """The drafters' decoder layer, in the public checkpoints' layout: pre-norms `input_layernorm` /
    `post_attention_layernorm`, `self_attn` with per-head q/k norms (Qwen3-style: DFlash's and SpecBlock's; none
    with `qk_norm=False`), a SwiGLU `mlp`. `d_in`: the width attention reads, when it is not the residual's
    (EAGLE-3's 2 x d; that layer builds its own input and calls `self_attn.qkv`)."""

    def __init__(self, d_model: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, eps: float,
                 bias: bool = False, d_in: int | None = None, qk_norm: bool = True):
        super().__init__()
        self.self_attn = Attention(d_in or d_model, d_model, heads, kv_heads, head_dim, bias,
                                   qk_norm_eps=eps if qk_norm else None)
        self.mlp = MLP(d_model, intermediate)
        self.input_layernorm = nn.RMSNorm(d_model, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(d_model, eps=eps)

    def qkv(self, h, cos, sin):
        return self.self_attn.qkv(self.input_layernorm(h), cos, sin)

    def attn_out(self, a):
        return self.self_attn.o_proj(a)

    def post_norm(self, h):
        return self.post_attention_layernorm(h)

    def ffn(self, x):
        return self.mlp(x)
