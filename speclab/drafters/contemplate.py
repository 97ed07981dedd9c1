"""Contemplate rows on a frozen target (ConFu, ../shared/papers/confu.txt).

A contemplate row is an extra row of the target's forward given as an input embedding (not a token), at its own
position, seeing its own set of the cache's slots plus `s` soft-prompt key/value entries that no other row sees. Its
final-norm hidden state is a "future" vector f. The target's own rows never see the soft prompts or the contemplate
rows, and contemplate rows write nothing to the cache, so the target's tokens and cache are those of the plain
target, bit for bit.

One function computes them, `contemplate`, over the cache as it is after the call that wrote the slots they see:

    h = emb                                          [B, m, d]
    per layer: q, k, v of the rows (RoPE at `pos`)
               attend over [soft prompts ; cache slots 0..P-1 ; the rows themselves]
               under [all ; visible ; the row itself]
    f = final_norm(h)

The lean path (`contemplate_lean`) runs on the decoder's own fused weights and is differentiable with respect to
emb and the soft prompts (training uses it, with the frozen target's keys and values in place of the cache's); the
hf path runs transformers' decoder on `inputs_embeds` over a throwaway cache of [soft prompts ; cache slots], for
any architecture transformers runs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from speclab.core.layers import attend
from speclab.core.lean import ConRows, KVCache, LeanDecoder


def contemplate_lean(dec: LeanDecoder, ctx_k, ctx_v, emb: torch.Tensor, pos: torch.Tensor, visible: torch.Tensor,
                     soft_k: torch.Tensor, soft_v: torch.Tensor) -> torch.Tensor:
    """Future vectors f [B, m, d] of contemplate rows emb [B, m, d] at positions pos [B, m], row r seeing the
    context slots where visible [B, m, P] is True, every soft prompt (soft_k, soft_v [L, kv, s, D]) and itself.
    ctx_k / ctx_v: per layer, the context's post-RoPE keys and values [B, kv, >= P, D] (a sequence of L tensors,
    or an [L, B, kv, P, D] tensor); a lean cache's are `cache_context(cache, P)`."""
    B, m, _ = emb.shape
    P, s = visible.shape[-1], soft_k.shape[2]
    if int(pos.max()) >= dec.cos.shape[0]:
        dec._rope_table(2 * int(pos.max()) + 2)
    cos, sin = dec.cos[pos][:, :, None], dec.sin[pos][:, :, None]  # [B, m, 1, D]
    own = torch.eye(m, dtype=torch.bool, device=emb.device).expand(B, m, m)
    mask = torch.cat([visible.new_ones(B, m, s), visible, own], -1)[:, None]  # [B, 1, m, s + P + m]
    h = emb.to(dec.dtype)
    for i, L in enumerate(dec.layers):  # the target's own layers (`speclab.core.layers.FusedLayer`)
        q, k, v = L.qkv(h, cos, sin)  # [B, heads | kv_heads, m, D]
        keys = torch.cat([soft_k[i].to(h.dtype).expand(B, -1, -1, -1), ctx_k[i][:, :, :P].to(h.dtype), k], 2)
        vals = torch.cat([soft_v[i].to(h.dtype).expand(B, -1, -1, -1), ctx_v[i][:, :, :P].to(h.dtype), v], 2)
        h = L.finish(h, attend(q, keys, vals, mask, dec.scaling))
    return F.rms_norm(h, h.shape[-1:], dec.norm, dec.eps)


def cache_context(cache: KVCache):
    """A lean cache's keys and values as `contemplate_lean`'s context (batch 1): [L, 1, kv, slots, D] views."""
    return cache.k[:, None], cache.v[:, None]


def contemplate_hf(target, cache, emb: torch.Tensor, pos: torch.Tensor, visible: torch.Tensor,
                   soft_k: torch.Tensor, soft_v: torch.Tensor) -> torch.Tensor:
    """`contemplate_lean` through transformers' decoder (batch 1): `inputs_embeds` at `pos` over a throwaway
    DynamicCache holding [soft prompts ; the first P slots of `cache`] per layer, under a 4D additive mask."""
    from transformers import DynamicCache
    m, P, s = emb.shape[1], visible.shape[-1], soft_k.shape[2]
    ctx = DynamicCache(config=target.config)
    for i, layer in enumerate(cache.layers):
        k, v = layer.keys[:, :, :P], layer.values[:, :, :P]
        ctx.update(torch.cat([soft_k[i][None].to(k.dtype), k], 2), torch.cat([soft_v[i][None].to(v.dtype), v], 2), i)
    own = torch.eye(m, dtype=torch.bool, device=emb.device)[None]
    allowed = torch.cat([visible.new_ones(1, m, s), visible, own], -1)[:, None]
    mask = torch.zeros(allowed.shape, dtype=target.dtype, device=emb.device)
    mask.masked_fill_(~allowed, torch.finfo(target.dtype).min)
    out = target.decoder(inputs_embeds=emb.to(target.dtype), position_ids=pos, attention_mask=mask,
                         past_key_values=ctx, use_cache=True)
    return out.last_hidden_state  # transformers' final norm


@torch.inference_mode()
def contemplate(target, cache, emb: torch.Tensor, pos: torch.Tensor, visible: torch.Tensor,
                soft_k: torch.Tensor, soft_v: torch.Tensor) -> torch.Tensor:
    """Future vectors f [m, d] of contemplate rows emb [m, d] at positions pos [m] over the target's cache (batch
    1; visible [m, P] over its first P slots): the lean path when the target has it (exact mode included: its
    cache holds the bf16 values exactly in fp32), else transformers'. Counted as a target call."""
    from speclab.core.target import forward_clock
    target.calls += 1
    with forward_clock:
        if target.lean and not target.lean.exact:  # the rows alone in a forward of no plain rows (its fast path)
            con = ConRows(emb.to(target.device), pos.to(target.device), visible.to(target.device), soft_k, soft_v)
            return target.lean.forward(emb.new_zeros(0, dtype=torch.long), cache, con=con)[3]
        e, p, v = emb[None].to(target.device), pos[None].to(target.device), visible[None].to(target.device)
        if target.lean:
            ctx_k, ctx_v = cache_context(cache)
            return contemplate_lean(target.lean, ctx_k, ctx_v, e, p, v, soft_k, soft_v)[0]
        return contemplate_hf(target, cache, e, p, v, soft_k, soft_v)[0]


def last_token_rows(n_tokens: int, slots: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(pos [1], visible [1, slots]) of the one contemplate row after token n_tokens - 1 (>= 0) of a committed
    sequence whose first `slots` tokens are cached: it sees tokens 0..n_tokens - 1 and sits at position n_tokens
    (where the next token would)."""
    visible = torch.zeros(1, slots, dtype=torch.bool, device=device)
    visible[0, :n_tokens] = True
    return torch.tensor([n_tokens], device=device), visible


