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

from speclab.core.precision import Head, rms_norm32

FAMILIES = ("llama", "qwen2", "qwen3")
EXACT_TILE = 8  # rows per call in exact mode: a verification of up to 8 rows costs what one AR step costs
EXACT_TREE_ROOM = 128  # cache slots beyond the context for a verification tree's nodes in exact mode


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


class ConRows:
    """Extra rows in a verification call (a drafter's `speclab.core.protocol.ExtraRows`: ConFu's contemplate rows,
    its "wide" schedule; `speclab.core.contemplate`): input embeddings emb [m, d] at positions pos [m], row r seeing
    the cache slots where visible [m, slots] is True (the call's own rows included: slots = the cache after the
    call), the keys and values only they see soft_k / soft_v [layers, kv_heads, s, D] (ConFu's soft prompts) and
    itself."""

    def __init__(self, emb, pos, visible, soft_k, soft_v):
        self.emb, self.pos, self.soft_k, self.soft_v = emb, pos, soft_k, soft_v
        m, s = emb.shape[0], soft_k.shape[2]
        own = torch.eye(m, dtype=torch.bool, device=emb.device)
        self.mask = torch.cat([visible.new_ones(m, s), visible, own], -1)  # [m, s + slots + m]

    def attend(self, i: int, qk, v, k_cache, v_cache, end: int, H: int, scale: float) -> torch.Tensor:
        """Layer i's attention of the rows (qk [H + kv, m, D], v [kv, m, D]) -> [H, m, D]."""
        keys = torch.cat([self.soft_k[i].to(qk.dtype), k_cache[:, :end], qk[H:]], 1)
        vals = torch.cat([self.soft_v[i].to(v.dtype), v_cache[:, :end], v], 1)
        return F.scaled_dot_product_attention(qk[None, :H], keys[None], vals[None], attn_mask=self.mask, scale=scale,
                                              enable_gqa=keys.shape[0] != H)[0]


class KVCache:
    """Keys and values of all layers in one preallocated tensor each: [layers, kv_heads, capacity, head_dim]
    (head-major, so attention reads contiguous rows and takes torch's fused CPU kernel). A decode sizes it once
    (the target's `new_cache(capacity)`, a drafter's `reset(..., capacity)`); `reserve` grows it (doubling) only
    for callers that gave no size (None: `DEFAULT_CAPACITY` slots)."""

    DEFAULT_CAPACITY = 256

    @torch.inference_mode()
    def __init__(self, n_layers: int, n_kv: int, head_dim: int, dtype, device, capacity: int | None = None):
        capacity = self.DEFAULT_CAPACITY if capacity is None else capacity
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

    def __init__(self, model, logits: str = "fp32", exact: bool = False, tile: int = EXACT_TILE):
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
        self.max_context = int(getattr(cfg, "max_position_embeddings", 2048))
        self._rope_table(self.max_context)
        self.logits, self.exact, self.tile = logits, exact, tile
        self.lm = Head(self.lm_head, logits)

    def _layer(self, layer) -> dict:
        a, m = layer.self_attn, layer.mlp
        qkv = _fuse([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
        qkv_bias = None if a.q_proj.bias is None else _fuse([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
        gate_up = _fuse([m.gate_proj.weight, m.up_proj.weight])
        qk_norm = None
        if getattr(a, "q_norm", None) is not None:  # one [q_heads + kv_heads, D] weight for both norms
            qk_norm = torch.cat([a.q_norm.weight.expand(self.n_heads, -1), a.k_norm.weight.expand(self.n_kv, -1)])
        return {"in_norm": layer.input_layernorm.weight, "post_norm": layer.post_attention_layernorm.weight,
                "qkv": qkv, "qkv_bias": qkv_bias, "qk_norm": qk_norm, "o": a.o_proj.weight, "o_bias": a.o_proj.bias,
                "gate_up": gate_up, "down": m.down_proj.weight}

    def _rope_table(self, n: int) -> None:
        self.cos, self.sin = rope_tables(self.inv_freq, self.rope_scale, n, self.dtype)

    def new_cache(self, capacity: int | None = None) -> KVCache:
        """A cache for `capacity` tokens (None: `KVCache.DEFAULT_CAPACITY`; it grows when needed). In exact mode it
        never grows: its width is the attention width of every call (`_exact_forward`): `capacity` (a decode's
        prompt + new tokens), room for a tree of `EXACT_TREE_ROOM` nodes beyond it and a tile's padding; keys and
        values are kept in fp32 (the bf16 values exactly), so the fixed-width attention needs no conversion per
        call."""
        capacity = KVCache.DEFAULT_CAPACITY if capacity is None else capacity
        if self.exact:
            width = -(-(capacity + EXACT_TREE_ROOM + self.tile) // self.tile) * self.tile
            return KVCache(len(self.layers), self.n_kv, self.head_dim, torch.float32, self.device, width)
        return KVCache(len(self.layers), self.n_kv, self.head_dim, self.dtype, self.device, capacity)

    def forward(self, ids: torch.Tensor, cache: KVCache, pos: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, layers: tuple[int, ...] = (), last: int | None = None,
                hidden: bool = False, head=None, con: ConRows | None = None):
        """(logits, features, hidden, future) for `ids` [n] after the cache's tokens (`head`: another head than the
        model's on the final-norm states, e.g. a draft model's FlashHead).

        logits [n or last, vocab]; features [n, len(layers) * d]: the outputs of those decoder layers, concatenated
        in the order given (None without layers); hidden [n or last, d]: the final-norm hidden state of the rows
        whose logits are returned (None unless asked). `mask` is an additive [1, 1, n, start + n] float mask (tree
        attention); the default is causal. `con`: contemplate rows forwarded in the same call (ConFu's "wide"
        schedule, `speclab.core.contemplate`): they share the call's matrix products, write nothing to the cache,
        and their final-norm states come back as `future` [m, d] (None without them)."""
        n, start = ids.numel(), cache.length
        end = start + n
        if pos is None:
            pos = torch.arange(start, end, device=self.device)
        top = end if con is None else max(end, int(con.pos.max()) + 1)
        if top > self.cos.shape[0]:  # positions never exceed end - 1 (a tree node sits at start + its depth)
            self._rope_table(2 * top)
        if self.exact:
            if con is not None:
                raise ValueError("exact mode forwards no contemplate rows in its verification (the after schedule)")
            return (*self._exact_forward(ids, cache, pos, mask, layers, last, hidden, head), None)
        cache.reserve(n)
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # [n, 1, D]; sin carries rotate_half's sign
        if mask is None and n > 1:
            mask = torch.ones(n, end, dtype=torch.bool, device=self.device).tril(start)
        elif mask is not None:
            mask = mask[0, 0]  # Target has cast it to the model's dtype
        h, kept, h_con = self._layers(ids, cache, start, cos, sin, self._sdpa(mask), layers, con)
        cache.length = end
        feats = (kept[layers[0]] if len(layers) == 1 else torch.cat([kept[i] for i in layers], -1)) if layers else None
        if last is not None:
            h = h[-last:]
        h = self.final_norm(h)
        future = None if h_con is None else F.rms_norm(h_con, h_con.shape[-1:], self.norm, self.eps)
        return (head or self.head)(h), feats, h if hidden else None, future

    def _layers(self, ids, cache: KVCache, start: int, cos, sin, attend, layers, con: ConRows | None = None):
        """The decoder layers over rows `ids` written at cache slots start..start+n; `attend(q, k_cache, v_cache, end)`
        is the attention of queries [heads, n, D] over the layer's cache up to slot `end` (the fused kernel, or exact
        mode's fixed-shape one). Contemplate rows `con` ride along in every matrix product; the plain rows' attention
        is the same call as without them, and theirs runs over [soft prompts ; cache ; themselves] (`ConRows`).
        -> (the plain rows' last states, the kept layers' outputs, the contemplate rows' last states or None)."""
        n = ids.numel()
        m = 0 if con is None else con.emb.shape[0]
        H, KV, D, eps = self.n_heads, self.n_kv, self.head_dim, self.eps
        h = self.embed[ids]
        if con is not None:
            h = torch.cat([h, con.emb.to(h.dtype)])
            cos = torch.cat([cos, self.cos[con.pos][:, None]])
            sin = torch.cat([sin, self.sin[con.pos][:, None]])
        kept = {}
        for i, L in enumerate(self.layers):
            x = F.rms_norm(h, h.shape[-1:], L["in_norm"], eps)
            qkv = F.linear(x, L["qkv"], L["qkv_bias"]).view(n + m, H + 2 * KV, D)
            qk, v = qkv[:, : H + KV], qkv[:, H + KV :]
            if L["qk_norm"] is not None:  # Qwen3: RMSNorm per head, q and k in one call
                qk = F.rms_norm(qk, (D,), None, eps) * L["qk_norm"]
            qk = apply_rope(qk, cos, sin)  # rotary embedding, q and k together
            k_cache, v_cache = cache.k[i], cache.v[i]  # [kv_heads, capacity, D]
            k_cache[:, start : start + n] = qk[:n, H:].transpose(0, 1)
            v_cache[:, start : start + n] = v[:n].transpose(0, 1)
            o = attend(qk[:n, :H].transpose(0, 1), k_cache, v_cache, start + n)  # [H, n, D]
            if con is not None:
                o = torch.cat([o, con.attend(i, qk[n:].transpose(0, 1), v[n:].transpose(0, 1), k_cache, v_cache,
                                             start + n, H, self.scaling)], 1)
            h = h + F.linear(o.transpose(0, 1).reshape(n + m, H * D), L["o"], L["o_bias"])
            x = F.rms_norm(h, h.shape[-1:], L["post_norm"], eps)
            gate, up = F.linear(x, L["gate_up"]).chunk(2, -1)
            h = h + F.linear(F.silu(gate) * up, L["down"])
            if i in layers:
                kept[i] = h[:n]
        return (h[:n], kept, h[n:]) if m else (h, kept, None)

    def _sdpa(self, mask):
        """Attention through torch's fused kernel (4D inputs) over the first `end` cache slots."""
        H, KV = self.n_heads, self.n_kv

        def attend(q, k_cache, v_cache, end):
            return F.scaled_dot_product_attention(q[None], k_cache[None, :, :end], v_cache[None, :, :end],
                                                  attn_mask=mask, scale=self.scaling, enable_gqa=H != KV)[0]
        return attend

    def _exact_forward(self, ids, cache: KVCache, pos, mask, layers, last, hidden, head=None):
        """The same forward, batch-invariant: rows go through in tiles of exactly `tile` rows (the last tile padded),
        and every tile attends over the same `exact_width` cache slots, so every matmul, norm and softmax of a row
        has the same shape whether 1 row or n rows are forwarded: a row's result never depends on how many rows
        run with it. Costs a tile's rows for a 1-row call and a fixed attention width (`speclab costs forward`)."""
        n, start, T, W = ids.numel(), cache.length, self.tile, cache.k.shape[2]
        if cache.k.dtype != torch.float32 or start + -(-n // T) * T > W:
            raise ValueError(f"exact mode: {n} rows after {start} cached need more than the {W} slots of the "
                             "exact-width cache (build it with this decoder's new_cache, for the whole decode)")
        cols = torch.arange(W, device=self.device)
        if mask is None:  # causal: row r sees slots up to start + r
            allowed = cols[None] <= (start + torch.arange(n, device=self.device))[:, None]
        else:  # the caller's additive [1, 1, n, start + n] tree mask, widened to W slots
            allowed = torch.zeros(n, W, dtype=torch.bool, device=self.device)
            allowed[:, : start + n] = mask[0, 0] == 0
        hs: list[torch.Tensor] = []
        kept_all: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
        for r0 in range(0, n, T):
            m = min(T, n - r0)
            tid = torch.zeros(T, dtype=ids.dtype, device=self.device)
            tid[:m] = ids[r0 : r0 + m]
            tpos = torch.full((T,), int(pos[r0 + m - 1]), dtype=torch.long, device=self.device)
            tpos[:m] = pos[r0 : r0 + m]
            ok = torch.zeros(T, W, dtype=torch.bool, device=self.device)
            ok[:m] = allowed[r0 : r0 + m]
            ok[torch.arange(m, T), start + r0 + torch.arange(m, T)] = True  # a padding row sees itself only
            # each row's softmax runs over its context in sequence order, packed to the front (a tree node's
            # ancestors sit at scattered slots; AR's at consecutive ones): slots it sees first, in slot order
            order = torch.where(ok, cols, cols + W).sort(-1).values % W
            bias = torch.zeros(T, W, device=self.device).masked_fill_(~ok.gather(-1, order), float("-inf"))
            h, kept, _ = self._layers(tid, cache, start + r0, self.cos[tpos][:, None], self.sin[tpos][:, None],
                                   self._fixed_attention(order, bias), layers)
            hs.append(h[:m])
            for i in layers:
                kept_all[i].append(kept[i][:m])
        cache.length = start + n
        h = torch.cat(hs)
        feats = (torch.cat([torch.cat(kept_all[i]) for i in layers], -1)) if layers else None
        rows = h if last is None else h[-last:]
        # the head on whole tiles too (fixed shape; padded with copies of the last row), then the rows asked for
        padded = torch.cat([rows, rows[-1:].expand(-rows.shape[0] % T, -1)])
        normed = self.final_norm(padded)
        logits = torch.cat([(head or self.head)(normed[j : j + T])
                            for j in range(0, normed.shape[0], T)])[: rows.shape[0]]
        normed = normed[: rows.shape[0]]
        return logits, feats, normed if hidden else None

    def _fixed_attention(self, order: torch.Tensor, bias: torch.Tensor):
        """Attention of one tile over every slot of the (fp32) cache, in fp32, in fixed shapes (scores [kv_heads,
        group * T, W]), so a row's result depends on that row alone. The softmax of row r runs over its scores
        in the order `order[r]` (the slots it sees first, ascending: its context in sequence order, whichever slots
        a tree put it in) with the additive `bias` in that order; the probabilities go back to their slots for the
        product with the values, whose sum over slots adds the unseen ones as exact zeros."""
        H, KV = self.n_heads, self.n_kv
        G = H // KV

        def attend(q, k_cache, v_cache, end):
            T, D = q.shape[1], q.shape[2]
            s = (torch.bmm(q.float().reshape(KV, G * T, D), k_cache.transpose(1, 2)) * self.scaling).view(KV, G, T, -1)
            idx = order.expand_as(s)
            p = torch.zeros_like(s).scatter_(-1, idx, torch.softmax(s.gather(-1, idx) + bias, -1))
            return torch.bmm(p.view(KV, G * T, -1), v_cache).view(H, T, D).to(q.dtype)
        return attend

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm: in fp32 when the logits are (`speclab.core.precision`), else in the model's dtype."""
        if self.lm.refine:
            return rms_norm32(h, self.norm, self.eps)
        return F.rms_norm(h, h.shape[-1:], self.norm, self.eps)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits of final-norm states (`speclab.core.precision.Head`)."""
        return self.lm(h)


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
