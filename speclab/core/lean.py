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

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from speclab.core import native
from speclab.core.layers import FusedLayer, attend, causal_mask, rope_tables
from speclab.core.precision import Head, rms_norm32

FAMILIES = ("llama", "qwen2", "qwen3")
EXACT_TILE = 8  # rows per call in exact mode: a verification of up to 8 rows costs what one AR step costs
TREE_ROOM = 128  # cache slots beyond a decode's tokens for the last verification tree's nodes (a larger tree
# grows a cache once in the usual mode; exact mode's fixed width refuses it)


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


class Segment(NamedTuple):
    """One sequence's rows in a batched forward (`LeanDecoder.forward_many`, `Target.forward_many`): token ids [n]
    after the tokens in its own cache, their positions (None: the cache's length on) and an additive tree mask
    [1, 1, n, cache + n] (None: causal)."""
    ids: torch.Tensor
    cache: Any
    pos: torch.Tensor | None = None
    mask: torch.Tensor | None = None


class ConRows:
    """Extra rows in a verification call (a drafter's `speclab.core.protocol.ExtraRows`: ConFu's contemplate rows,
    its "wide" schedule; `speclab.drafters.contemplate`): input embeddings emb [m, d] at positions pos [m], row r seeing
    the cache slots where visible [m, slots] is True (the call's own rows included: slots = the cache after the
    call), the keys and values only they see soft_k / soft_v [layers, kv_heads, s, D] (ConFu's soft prompts) and
    itself."""

    def __init__(self, emb, pos, visible, soft_k, soft_v):
        self.emb, self.pos, self.soft_k, self.soft_v = emb, pos, soft_k, soft_v
        m, s = emb.shape[0], soft_k.shape[2]
        own = torch.eye(m, dtype=torch.bool, device=emb.device)
        self.mask = torch.cat([visible.new_ones(m, s), visible, own], -1)  # [m, s + slots + m]

    def attend(self, i: int, q, k, v, cache: KVCache, end: int, scale: float) -> torch.Tensor:
        """Layer i's attention of the rows (q [heads, m, D], k, v [kv_heads, m, D]) over the soft prompts, the
        cache's first `end` slots and themselves -> [heads, m, D]."""
        keys = torch.cat([self.soft_k[i].to(k.dtype), cache.k[i, :, :end], k], 1)
        vals = torch.cat([self.soft_v[i].to(v.dtype), cache.v[i, :, :end], v], 1)
        return attend(q, keys, vals, self.mask, scale)


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

    def write(self, i: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer i's keys and values k, v [kv_heads, n, D] into slots start..start+n (the length stays: the caller
        says which slots count)."""
        end = start + k.shape[1]
        self.k[i, :, start:end], self.v[i, :, start:end] = k, v

    def attend(self, i: int, q: torch.Tensor, end: int, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        """The cached-attention step every forward over a `KVCache` takes (the target's, EAGLE-3's and ConFu's,
        DFlash's, SpecBlock's): queries q [heads, n, D] over layer i's first `end` slots under `mask` ([n, end]; None:
        every slot) -> [heads, n, D] (`speclab.core.layers.attend`)."""
        return attend(q, self.k[i, :, :end], self.v[i, :, :end], mask, scale)

    @torch.inference_mode()
    def keep(self, start: int, keep: torch.Tensor) -> None:
        """Keep positions [0, start) plus `start + keep` (ascending)."""
        idx = start + keep.to(self.k.device)
        m = keep.numel()
        self.k[:, :, start : start + m] = self.k[:, :, idx]
        self.v[:, :, start : start + m] = self.v[:, :, idx]
        self.length = start + m


def mix_many(caches: list[KVCache], starts: list[int], ns: list[int], masks: list, scale: float):
    """The attention step of a ragged batch (sequence j's ns[j] rows, in order, written at its cache's slots
    starts[j]..): `mix(i, q, k, v)` writes each sequence's keys and values into its own cache and attends its queries
    over that cache up to its last row under masks[j] ([n, end] bool or additive; None: every slot) -> [heads,
    rows, D]. Every model with `KVCache`s batches its sequences through it (the target's `forward_many`, DFlash's
    block forward)."""
    bounds = [0, *torch.tensor(ns).cumsum(0).tolist()]

    def mix(i, q, k, v):
        out = []
        for c, s0, n, mk, a, b in zip(caches, starts, ns, masks, bounds, bounds[1:]):
            c.write(i, s0, k[:, a:b], v[:, a:b])
            out.append(c.attend(i, q[:, a:b], s0 + n, mk, scale))
        return torch.cat(out, 1)
    return mix


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
        self.layers = [FusedLayer(layer, self.n_heads, self.n_kv, self.head_dim, self.eps) for layer in inner.layers]
        self.scaling = getattr(inner.layers[0].self_attn, "scaling", self.head_dim ** -0.5)
        self.dtype, self.device = self.embed.dtype, self.embed.device
        # causal masks additive in the queries' dtype, made once per forward (`layers.causal_mask`); on the CPU only,
        # where the same bits were checked
        self.mask_dtype = self.dtype if self.device.type == "cpu" else None
        rope = inner.rotary_emb
        self.inv_freq = rope.inv_freq.float()
        self.rope_scale = float(getattr(rope, "attention_scaling", 1.0))
        self.max_context = int(getattr(cfg, "max_position_embeddings", 2048))
        self._rope_table(self.max_context)
        self.logits, self.exact, self.tile = logits, exact, tile
        self.lm = Head(self.lm_head, logits)
        self._norm32: tuple[int, torch.Tensor] | None = None

    def _rope_table(self, n: int) -> None:
        self.cos, self.sin = rope_tables(self.inv_freq, self.rope_scale, n, self.dtype)

    def new_cache(self, capacity: int | None = None) -> KVCache:
        """A cache for `capacity` tokens (a decode's prompt + new tokens) and a verification tree of `TREE_ROOM`
        nodes beyond them, so a decode's last rounds do not grow it (None: `KVCache.DEFAULT_CAPACITY`; it grows
        when needed). In exact mode it never grows: its width is the attention width of every call
        (`_exact_forward`): that, and a tile's padding; keys and values are kept in fp32 (the bf16 values exactly),
        so the fixed-width attention needs no conversion per call."""
        if self.exact:
            width = -(-((capacity or KVCache.DEFAULT_CAPACITY) + TREE_ROOM + self.tile) // self.tile) * self.tile
            return KVCache(len(self.layers), self.n_kv, self.head_dim, torch.float32, self.device, width)
        return KVCache(len(self.layers), self.n_kv, self.head_dim, self.dtype, self.device,
                       None if capacity is None else capacity + TREE_ROOM)

    def forward(self, ids: torch.Tensor, cache: KVCache, pos: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, layers: tuple[int, ...] = (), last: int | None = None,
                hidden: bool = False, head=None, con: ConRows | None = None):
        """(logits, features, hidden, future) for `ids` [n] after the cache's tokens (`head`: another head than the
        model's on the final-norm states, e.g. a draft model's FlashHead).

        logits [n or last, vocab]; features [n, len(layers) * d]: the outputs of those decoder layers, concatenated
        in the order given (None without layers); hidden [n or last, d]: the final-norm hidden state of the rows
        whose logits are returned (None unless asked). `mask` is an additive [1, 1, n, start + n] float mask (tree
        attention); the default is causal. `con`: contemplate rows forwarded in the same call (ConFu's "wide"
        schedule, `speclab.drafters.contemplate`): they share the call's matrix products, write nothing to the cache,
        and their final-norm states come back as `future` [m, d] (None without them)."""
        n, start = ids.numel(), cache.length
        end = start + n
        top = end if con is None else max(end, int(con.pos.max()) + 1)
        if top > self.cos.shape[0]:  # positions never exceed end - 1 (a tree node sits at start + its depth)
            self._rope_table(2 * top)
        if self.exact:
            if con is not None:
                raise ValueError("exact mode forwards no contemplate rows in its verification (the after schedule)")
            if pos is None:
                pos = torch.arange(start, end, device=self.device)
            return (*self._exact_forward(ids, cache, pos, mask, layers, last, hidden, head), None)
        cache.reserve(n)
        if pos is None and mask is None and con is None and head is None and n and native.active(self.embed):
            # the whole forward below in one native call: the same ops, the same bits
            logits, feats, h = self._one_call([ids], [cache], layers, last)
            return logits, feats, h if hidden else None, None
        if pos is None:  # consecutive positions: the tables' rows as views (no index op, the same values)
            cos, sin = self.cos[start:end, None], self.sin[start:end, None]
        else:
            cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # [n, 1, D]; sin carries rotate_half's sign
        if mask is None and n > 1:
            mask = causal_mask(n, end, self.device, self.mask_dtype)
        elif mask is not None:
            mask = mask[0, 0]  # Target has cast it to the model's dtype
        h = self.embed[ids]
        if con is not None:  # contemplate rows ride along in every matrix product
            h = torch.cat([h, con.emb.to(h.dtype)])
            cos = torch.cat([cos, self.cos[con.pos][:, None]])
            sin = torch.cat([sin, self.sin[con.pos][:, None]])
        if native.active(h):  # the same ops from C++ (`speclab.core.native`), contemplate rows included
            h, kept = native.fused_layers(self.layers, h, cos, sin, [cache], [start], [n], [mask], self.scaling,
                                          layers, con)
            if con is not None:  # the kept layers' outputs of the plain rows only, as `_layers` keeps them
                kept = {i: x[:n] for i, x in kept.items()}
        else:
            h, kept = self._layers(h, cos, sin, self._mix(cache, start, n, self._sdpa(cache, mask), con), layers, n)
        h, h_con = (h[:n], h[n:]) if con is not None else (h, None)
        cache.length = end
        feats = (kept[layers[0]] if len(layers) == 1 else torch.cat([kept[i] for i in layers], -1)) if layers else None
        if last is not None:
            h = h[-last:]
        h = self.final_norm(h)
        future = None if h_con is None else F.rms_norm(h_con, h_con.shape[-1:], self.norm, self.eps)
        return (head or self.head)(h), feats, h if hidden else None, future

    def forward_many(self, segs: list[Segment], layers: tuple[int, ...] = (),
                     hidden: bool = False) -> list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
        """Several sequences' rows in ONE forward, each after its own cache (`Segment`: ids, cache, positions,
        tree mask): every matrix product runs once over all rows (the weights are read once for the whole batch),
        attention runs per sequence over its own cache. -> per segment (logits, features, hidden), as `forward`
        returns them for that segment alone (to float rounding: the products' row count differs)."""
        if self.exact:  # batch-invariance is per call: each sequence on its own
            return [self.forward(s.ids, s.cache, s.pos, s.mask, layers, None, hidden)[:3] for s in segs]
        ns = [s.ids.numel() for s in segs]
        bounds = [0, *torch.tensor(ns).cumsum(0).tolist()]
        for s, n in zip(segs, ns):
            s.cache.reserve(n)
        if native.active(self.embed) and all(s.pos is None and s.mask is None and n for s, n in zip(segs, ns)):
            # chains and single rows in one native call: the same ops, the same bits
            top = max(s.cache.length + n for s, n in zip(segs, ns))
            if top > self.cos.shape[0]:
                self._rope_table(2 * top)
            logits, feats, h = self._one_call([s.ids.to(self.device) for s in segs], [s.cache for s in segs], layers)
            return [(logits[a:b], None if feats is None else feats[a:b], h[a:b] if hidden else None)
                    for a, b in zip(bounds, bounds[1:])]
        pos = torch.cat([torch.arange(s.cache.length, s.cache.length + n, device=self.device) if s.pos is None
                         else s.pos.to(self.device) for s, n in zip(segs, ns)])
        if int(pos.max()) + 1 > self.cos.shape[0]:
            self._rope_table(2 * (int(pos.max()) + 1))
        masks = []
        for s, n in zip(segs, ns):
            end = s.cache.length + n
            masks.append(s.mask[0, 0] if s.mask is not None else
                         causal_mask(n, end, self.device, self.mask_dtype) if n > 1 else None)
        h, cos, sin = self.embed[torch.cat([s.ids for s in segs]).to(self.device)], self.cos[pos][:, None], \
            self.sin[pos][:, None]
        caches, starts = [s.cache for s in segs], [s.cache.length for s in segs]
        if native.active(h):  # the same ops from C++ (`speclab.core.native`)
            h, kept = native.fused_layers(self.layers, h, cos, sin, caches, starts, ns, masks, self.scaling, layers)
        else:
            h, kept = self._layers(h, cos, sin, mix_many(caches, starts, ns, masks, self.scaling), layers, bounds[-1])
        h = self.final_norm(h)
        logits = self.head(h)
        feats = torch.cat([kept[i] for i in layers], -1) if layers else None  # once for every row: a view each
        out = []
        for s, a, b in zip(segs, bounds, bounds[1:]):
            s.cache.length += b - a
            out.append((logits[a:b], None if feats is None else feats[a:b], h[a:b] if hidden else None))
        return out

    def _one_call(self, ids: list[torch.Tensor], caches: list[KVCache], layers: tuple[int, ...], last=None):
        """`forward` / `forward_many` of sequences of rows at consecutive positions after their (reserved) caches,
        causal, in one native call (`native.lean_forward`: the same ops, the same bits); the caches' lengths move on.
        -> (logits, features or None, final-norm states) of every sequence's rows in order."""
        logits, risky, h, feats = native.lean_forward(self, ids, caches, layers, last)
        for x, c in zip(ids, caches):
            c.length += x.numel()
        if risky is not None:  # rows whose refined maximum an unrefined logit could reach: in full fp32
            logits = self.lm.full_rows(logits, h, risky)
        return logits, feats, h

    def _layers(self, h, cos, sin, mix, layers, n: int):
        """The decoder layers (`speclab.core.layers.FusedLayer`) over rows h; `mix(i, q, k, v)` is layer i's attention
        step for queries [heads, rows, D] and the rows' keys and values (it writes them to the cache and attends:
        `_mix`, or a batch's per-sequence steps). -> (the last states, the kept layers' outputs of the first n rows)."""
        kept = {}
        for i, L in enumerate(self.layers):
            q, k, v = L.qkv(h, cos, sin)  # [heads | kv_heads, rows, D]
            h = L.finish(h, mix(i, q, k, v))
            if i in layers:
                kept[i] = h[:n]
        return h, kept

    def _mix(self, cache: KVCache, start: int, n: int, attend, con: ConRows | None = None):
        """The attention step of n plain rows written at cache slots start..start+n; `attend(q, i, end)` is the
        attention of queries [heads, n, D] over layer i's cache up to slot `end` (the fused kernel, or exact mode's
        fixed-shape one). Contemplate rows `con` (after the plain rows) attend over [soft prompts ; cache ;
        themselves] (`ConRows`); the plain rows' attention is the same call as without them."""
        def mix(i, q, k, v):
            cache.write(i, start, k[:, :n], v[:, :n])
            o = attend(q[:, :n], i, start + n)  # [heads, n, D]
            if con is not None:
                o = torch.cat([o, con.attend(i, q[:, n:], k[:, n:], v[:, n:], cache, start + n, self.scaling)], 1)
            return o
        return mix

    def _sdpa(self, cache: KVCache, mask):
        """Attention through torch's fused kernel over the first `end` cache slots (`KVCache.attend`)."""
        return lambda q, i, end: cache.attend(i, q, end, mask, self.scaling)

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
            mix = self._mix(cache, start + r0, T, self._fixed_attention(cache, order, bias))
            h, kept = self._layers(self.embed[tid], self.cos[tpos][:, None], self.sin[tpos][:, None], mix, layers, T)
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

    def _fixed_attention(self, cache: KVCache, order: torch.Tensor, bias: torch.Tensor):
        """Attention of one tile over every slot of the (fp32) cache, in fp32, in fixed shapes (scores [kv_heads,
        group * T, W]), so a row's result depends on that row alone. The softmax of row r runs over its scores
        in the order `order[r]` (the slots it sees first, ascending: its context in sequence order, whichever slots
        a tree put it in) with the additive `bias` in that order; the probabilities go back to their slots for the
        product with the values, whose sum over slots adds the unseen ones as exact zeros."""
        H, KV = self.n_heads, self.n_kv
        G = H // KV

        def attend(q, i, end):
            k_cache, v_cache = cache.k[i], cache.v[i]  # every slot: the fixed width
            T, D = q.shape[1], q.shape[2]
            s = (torch.bmm(q.float().reshape(KV, G * T, D), k_cache.transpose(1, 2)) * self.scaling).view(KV, G, T, -1)
            idx = order.expand_as(s)
            p = torch.zeros_like(s).scatter_(-1, idx, torch.softmax(s.gather(-1, idx) + bias, -1))
            return torch.bmm(p.view(KV, G * T, -1), v_cache).view(H, T, D).to(q.dtype)
        return attend

    def norm32(self) -> torch.Tensor:
        """The final norm's weight in fp32 (what `rms_norm32` multiplies by), made again after a change in place."""
        version = -1 if self.norm.is_inference() else self.norm._version
        if self._norm32 is None or self._norm32[0] != version:
            self._norm32 = (version, self.norm.float())
        return self._norm32[1]

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm: in fp32 when the logits are (`speclab.core.precision`), else in the model's dtype."""
        if self.lm.refine:
            return rms_norm32(h, self.norm, self.eps)
        if native.active(h):  # the same op in one pass (about a fifth of ATen's time on a decode's row)
            return native.rms_norm(h, self.norm, self.eps)
        return F.rms_norm(h, h.shape[-1:], self.norm, self.eps)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits of final-norm states (`speclab.core.precision.Head`)."""
        return self.lm(h)

