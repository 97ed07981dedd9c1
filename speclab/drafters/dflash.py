"""DFlash: a block-diffusion drafter that proposes a whole block in one forward (z-lab's DFlash), with DSpark's
Markov head as an option (DeepSeek's DSpark). Reading notes: ../shared/papers/dflash-dspark-notes.txt.

The public layout (../shared/notes/drafter-formats.md), so a public checkpoint loads as it is:

    context  c = hidden_norm(fc(cat(target features of `target_layer_ids`)))           [n, H]  (cached as K/V)
    block    x = embed([last committed token, mask, ..., mask])                        [B, H]  (the target's embedding)
    every layer: q = q_norm(q_proj(ln(x))), keys/values = cat(k/v_proj(c), k/v_proj(ln(x))) (KV injection),
                 non-causal inside the block, rope over context + block positions; then the MLP
    logits of block rows 1..B-1 = target lm_head(norm(x))   (the target's head weight, in the drafter's dtype)

Row k of the block (a mask at position n + k) predicts the token there, so a block of B rows drafts B - 1 tokens.
Layer ids follow DFlash: id j is the output of decoder layer j (HF `hidden_states[j + 1]`), which is speclab's
`Target.forward(layers=...)` convention as it is.

Context keys and values depend on the target's features alone, so catch-up is KV-only by construction: the
backlog's features go through fc, hidden_norm and every layer's k/v projections in one call and nothing else.
The block's keys and values are written after the context and never committed (the next round overwrites them).

DSpark's Markov head (`markov_rank` r > 0): a bias W1[x_{k-1}] W2 (W1 [V, r], W2 [r, V]) added to row k's logits,
decoded left to right inside the block (r x V work per token; the backbone stays one call). Without it the rows
are independent and the whole block is one argmax.

Optional tree (`tree_topk` > 1, off by default): EAGLE-2's dynamic tree over the rows' top-k (with the Markov bias
of each parent's token), the best `total_tokens` nodes kept; it costs no drafter call beyond the block's. At T > 0
its children are drawn from the rows' q instead (`scheme`: without replacement or i.i.d.; topk keeps the greedy
tree), the first `total_tokens` drawn kept.

Verification: greedy drafts are the per-row argmax (point masses). Under sampling every token is drawn from its
row's distribution q_k (with the Markov bias of the token drawn before it; `draft_temp` times the target's
temperature) and q_k is recorded, so verification uses min(1, p/q) and the residual: lossless.
"""
from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from speclab.checks import MAX_TREE_NODES, Bound
from speclab.core import native
from speclab.core.layers import DecoderLayer, Linear, linear, rope_inv_freq, rope_tables
from speclab.core.lean import KVCache, mix_many
from speclab.core.sampling import Sampling, argmax, chain_dists, draft_probs, draw_one, uniforms
from speclab.core.target import forward_clock
from speclab.core.tree import DraftTree, TreeDraw, check_dynamic_tree, dynamic_tree
from speclab.drafters.checkpoint import (
    check_fits,
    load_strict,
    place,
    read_checkpoint,
    save_checkpoint,
)
from speclab.drafters.flashhead import HEAD_PARAMS, head_same_decode, with_head
from speclab.drafters.registry import SAMPLING_PARAMS, CostBench, DrafterEntry, ModelRole, Param, Shape, TrainEntry
from speclab.drafters.schedule import pays_params
from speclab.errors import InvalidInput, ModelNotFound


def default_layer_ids(num_layers: int, n: int = 5) -> tuple[int, ...]:
    """DFlash's choice: n layer ids evenly spaced from 1 to L - 3 (rounded; 36 layers: 1, 9, 17, 25, 33; the zoo's
    6: 1, 2, 3). For targets too shallow for three distinct ids that way (L < 6), three spread over the whole
    depth (4 layers: 0, 1, 2)."""
    if num_layers < 3:
        raise InvalidInput(f"DFlash reads several target layers: it needs a target of at least 3 (this one has "
                           f"{num_layers})")
    hi = num_layers - 3
    ids = tuple(sorted({round(1 + i * (hi - 1) / max(n - 1, 1)) for i in range(n)})) if hi >= 1 else ()
    if len(ids) >= 3:
        return ids
    return tuple(sorted({0, (num_layers - 1) // 2, num_layers - 2}))


@dataclass
class DFlashConfig:
    """The public DFlash config.json (a Qwen3 config with `block_size` and `dflash_config`), as far as it is used."""
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    target_layer_ids: tuple[int, ...]  # dflash_config.target_layer_ids: outputs of these target decoder layers
    mask_token_id: int
    block_size: int = 16
    num_target_layers: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    attention_bias: bool = False
    markov_rank: int = 0  # DSpark's Markov head (0: none)
    confidence: bool = False  # DSpark's confidence head (`dspark_config`)
    confidence_temperatures: tuple[float, ...] = ()  # its sequential scaling, one temperature per block row (fitted)
    confidence_biases: tuple[float, ...] = ()  # and one bias per row (sigmoid(z / T + b); none: 0)
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    extra: dict = field(default_factory=dict)  # other keys of the file, written back unchanged

    def __post_init__(self):
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        self.target_layer_ids = tuple(int(j) for j in self.target_layer_ids)

    @classmethod
    def from_dict(cls, d: dict) -> DFlashConfig:
        d = dict(d)
        dc = d.get("dflash_config") or {}

        def get(name, default=None):
            return dc.get(name, d.get(name, default))

        if get("target_layer_ids") is None:
            raise ValueError("no dflash_config.target_layer_ids")
        if get("mask_token_id") is None:
            raise ValueError("no dflash_config.mask_token_id")
        rope = d.get("rope_parameters") or {}
        ds = d.get("dspark_config") or {}
        known = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "vocab_size", "block_size", "num_target_layers", "head_dim", "rms_norm_eps", "max_position_embeddings",
                 "rope_theta", "rope_scaling", "attention_bias", "markov_rank", "dspark_config"}
        return cls(hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
                   num_hidden_layers=d["num_hidden_layers"], num_attention_heads=d["num_attention_heads"],
                   num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
                   vocab_size=d["vocab_size"], target_layer_ids=tuple(get("target_layer_ids")),
                   mask_token_id=int(get("mask_token_id")), block_size=int(get("block_size", 16)),
                   num_target_layers=get("num_target_layers"), head_dim=d.get("head_dim"),
                   rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                   max_position_embeddings=d.get("max_position_embeddings", 2048),
                   rope_theta=d.get("rope_theta", rope.get("rope_theta", 10000.0)),
                   rope_scaling=(d.get("rope_scaling")
                                 or (rope if rope.get("rope_type", "default") != "default" else None)),
                   attention_bias=bool(d.get("attention_bias", False)), markov_rank=int(get("markov_rank", 0) or 0),
                   input_embedding_scale=float(get("input_embedding_scale", 1.0)),
                   output_multiplier=float(get("output_multiplier", 1.0)),
                   confidence=bool(ds.get("confidence_head", False)),
                   confidence_temperatures=tuple(float(t) for t in ds.get("confidence_temperatures") or ()),
                   confidence_biases=tuple(float(b) for b in ds.get("confidence_biases") or ()),
                   extra={k: v for k, v in d.items() if k not in known})

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items()
             if k not in ("extra", "target_layer_ids", "mask_token_id", "input_embedding_scale", "output_multiplier",
                          "confidence", "confidence_temperatures", "confidence_biases")}
        out = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_act": "silu",
               "tie_word_embeddings": False, **self.extra, **d}
        out["dflash_config"] = {**(self.extra.get("dflash_config") or {}),
                                "target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id}
        if self.confidence:
            out["dspark_config"] = {"confidence_head": True,
                                    "confidence_temperatures": list(self.confidence_temperatures),
                                    **({"confidence_biases": list(self.confidence_biases)}
                                       if self.confidence_biases else {})}
        return out


def _per_row(values: tuple[float, ...], z: torch.Tensor) -> torch.Tensor:
    """One value per block row of `z` [.., rows]: row k's, the last one past them."""
    k = min(z.shape[-1], len(values))
    return torch.tensor(values[:k] + (values[-1],) * (z.shape[-1] - k), device=z.device)


class DFlashModel(nn.Module):
    """The drafter's weights in the public layout and the pieces of its forward (drafting and training share
    them). It has no embedding and no LM head: the target's are used."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        c = self.config = config
        self.layers = nn.ModuleList(DecoderLayer(c.hidden_size, c.intermediate_size, c.num_attention_heads,
                                                 c.num_key_value_heads, c.head_dim, c.rms_norm_eps, c.attention_bias)
                                    for _ in range(c.num_hidden_layers))
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.fc = Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        if c.markov_rank > 0:
            self.markov_w1 = nn.Embedding(c.vocab_size, c.markov_rank)
            self.markov_w2 = Linear(c.markov_rank, c.vocab_size, bias=False)
        if c.confidence:  # DSpark: c_k = sigmoid(w . [h_k ; W1[x_{k-1}]])
            self.confidence_head = Linear(c.hidden_size + c.markov_rank, 1, bias=True)
        self.inv_freq, self.rope_scale = rope_inv_freq(c)  # fp32 on CPU, not a buffer: `.to(bf16)` leaves it

    # -- the forward, in pieces -------------------------------------------------------------------------------
    def context(self, feats: torch.Tensor) -> torch.Tensor:
        """The target context feature hidden_norm(fc(features)) [.., n, H]."""
        return native.rms(self.hidden_norm, self.fc(feats))

    def context_kv(self, i: int, ctx: torch.Tensor, cos, sin):
        """Layer i's keys and values [.., kv_heads, n, D] of context rows (rope applied; KV injection: the context
        goes straight into the projections, normed by `context`, not by the layer's input norm)."""
        return self.layers[i].self_attn.kv(ctx, cos, sin)

    def block_qkv(self, i: int, x: torch.Tensor, cos, sin):
        """Layer i's queries [.., heads, B, D] and keys, values [.., kv_heads, B, D] of block rows x [.., B, H]."""
        return self.layers[i].qkv(x, cos, sin)

    def finish(self, i: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The rest of layer i: residual + o_proj(attention output [.., heads, B, D]), then the MLP."""
        return self.layers[i].finish(x, attn)

    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor:
        """DSpark's bias W1[x_{k-1}] W2 [.., V] for previous tokens `prev` [..]."""
        return self.markov_w2(self.markov_w1(prev))

    def confidence_logits(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """DSpark's confidence head before its sigmoid: w . [h_k ; W1[x_{k-1}]] + b [..] of block rows' final-norm
        states h [.., H] and the tokens before them `prev` [..] (W1: the Markov head's embedding, when there is one)."""
        x = torch.cat([h, self.markov_w1(prev).to(h.dtype)], -1) if self.has_markov else h
        return self.confidence_head(x)[..., 0]

    def confidence(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """c_k, each block row's probability of being accepted given the rows before it were, with the fitted
        sequential scaling applied, sigmoid(z_k / T_k + b_k) (row k's temperature and bias, the last ones past
        them): [.., rows] float32."""
        z = self.confidence_logits(h, prev).float()
        temps, biases = self.config.confidence_temperatures, self.config.confidence_biases
        if temps:
            z = z / _per_row(temps, z)
        if biases:
            z = z + _per_row(biases, z)
        return torch.sigmoid(z)

    @property
    def has_confidence(self) -> bool:
        return self.config.confidence

    def rope(self, n: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(self.inv_freq.to(self.fc.weight.device), self.rope_scale, n, dtype)

    @property
    def has_markov(self) -> bool:
        return self.config.markov_rank > 0

    def save(self, out_dir: str | Path, dtype=torch.bfloat16, extra_files: dict[str, str] | None = None) -> None:
        """config.json + model.safetensors in the public layout."""
        save_checkpoint(self, self.config.to_dict(), out_dir, dtype, extra_files)


def load_dflash(path: str | Path, target=None, device=None, dtype=None) -> DFlashModel:
    """A DFlash drafter from a directory with its config.json (`dflash_config.target_layer_ids`, `mask_token_id`,
    `block_size`) and `model.safetensors` or `pytorch_model.bin`. Checked against `target` when given (width,
    vocabulary, layer ids); a missing or unexpected weight is refused by name."""
    p, raw, sd = read_checkpoint(path, "DFlash drafter")
    try:
        cfg = DFlashConfig.from_dict(raw)
    except (KeyError, ValueError, TypeError) as e:
        raise ModelNotFound(f"{p / 'config.json'} is not a DFlash config ({type(e).__name__}: {e})") from e
    if "markov_w1.weight" in sd and cfg.markov_rank == 0:  # a DSpark file that names its rank by shape only
        cfg.markov_rank = int(sd["markov_w1.weight"].shape[1])
    model = DFlashModel(cfg)
    load_strict(model, sd, p, "DFlash drafter")
    if target is not None:
        _check_against(cfg, target, p)
    return place(model, path, target, device, dtype)


def _check_against(cfg: DFlashConfig, target, where: Path) -> None:
    check_fits("DFlash drafter", where, target, cfg.vocab_size, cfg.hidden_size,
               "the embeddings and features (it shares the target's embedding and head)")
    bad = [j for j in cfg.target_layer_ids if not 0 <= j < target.num_layers]
    if bad:
        raise ModelNotFound(f"the DFlash drafter in {where} reads target layers {list(cfg.target_layer_ids)}, but the "
                            f"target has {target.num_layers} (0..{target.num_layers - 1})")
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        raise ModelNotFound(f"the DFlash drafter in {where} has mask_token_id {cfg.mask_token_id}, outside the "
                            f"target's vocabulary of {target.vocab_size}")


class DFlashDrafter:
    """The DFlash drafter behind speclab's drafter protocol (speclab/core/protocol.py)."""
    name = "dflash"
    flash = None  # a FlashHead over the target's head (speclab.drafters.flashhead), or None: the dense head
    confidence = False  # DSpark's c_k on each drafted row (`tree.extra["confidence"]`), when a scheduler asks for it

    def __init__(self, model: DFlashModel, target, *, block_size: int, markov: bool, tree_topk: int,
                 total_tokens: int, draft_temp: float = 1.0, scheme: str = "wor"):
        c = model.config
        if block_size < 2 or tree_topk < 1 or total_tokens < 1:
            raise ValueError(f"dflash needs block_size >= 2 (a block is the root and at least one mask), tree_topk and "
                             f"total_tokens >= 1 (got {block_size}, {tree_topk}, {total_tokens})")
        self.m, self.target, self.block_size = model, target, block_size
        self.tree_topk, self.total_tokens = tree_topk, total_tokens
        self.draft_temp, self.scheme = draft_temp, scheme
        self.markov = bool(markov) and model.has_markov
        self.layers = c.target_layer_ids
        self.H, self.KV, self.D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.scale = self.D ** -0.5
        self.device, self.dtype = model.fc.weight.device, model.fc.weight.dtype
        self.cos, self.sin = model.rope(max(c.max_position_embeddings, target.max_context) + block_size + 1, self.dtype)
        self.mask_ids = torch.full((block_size - 1,), c.mask_token_id, dtype=torch.long, device=self.device)
        self.head_weight = target.head_weight.to(self.device, self.dtype)  # the target's head, shared when dtypes agree
        self.cache: KVCache | None = None
        self.known = 0  # context positions (features) in the cache
        self.root = None  # the last committed token (the block's first row)
        self.pending_feats = None
        self.last_h: torch.Tensor | None = None  # the last block's mask rows, final-norm states

    def _rope(self, start: int, n: int):
        return self.cos[start : start + n][:, None], self.sin[start : start + n][:, None]  # [n, 1, D]

    # -- protocol -------------------------------------------------------------------------------------------------
    def reset(self, prompt_ids: torch.Tensor, prompt_features: torch.Tensor | None,
              capacity: int | None = None) -> None:
        """`capacity` (committed tokens; None: grow on demand): the cache is sized once for the context (one fewer
        than the committed tokens) and a block."""
        self.cache = KVCache(len(self.m.layers), self.KV, self.D, self.dtype, self.device,
                             None if capacity is None else capacity + self.block_size)
        self.known = 0
        self.root = prompt_ids[-1:].to(self.device)
        self.pending_feats = prompt_features if prompt_features is not None else \
            torch.zeros(0, len(self.layers) * self.m.config.hidden_size, device=self.device, dtype=self.dtype)

    @torch.inference_mode()
    def catch_up(self, ids: torch.Tensor, features: torch.Tensor | None) -> None:
        """The backlog's context keys and values (feature f_{t-1} of token x_t, at position t - 1) into every
        layer's cache in one call: fc, hidden_norm and the k/v projections, nothing else."""
        self._stash(ids, features)
        if self.pending_feats.shape[0]:
            with forward_clock:  # a drafter forward: counted in the model-call share like the target's
                DFlashDrafter._absorb([self])

    @staticmethod
    def catch_up_many(drafters: list[DFlashDrafter], ids: list[torch.Tensor], features: list) -> None:
        """Several drafters of one model catch up (a batch of requests, `speclab.core.batch`): their backlogs wait
        for the `propose_many` that follows, whose one drafter call writes every backlog's context keys and values
        before the blocks."""
        for d, x, f in zip(drafters, ids, features):
            d._stash(x, f)

    def _stash(self, ids: torch.Tensor, features: torch.Tensor | None) -> None:
        if ids.numel():
            self.root = ids[-1:].to(self.device)
            f = features.to(self.device, self.dtype)
            self.pending_feats = torch.cat([self.pending_feats, f]) if len(self.pending_feats) else f

    @staticmethod
    def _absorb(drafters: list[DFlashDrafter]) -> None:
        """The drafters' stashed backlogs through fc, hidden_norm and each layer's k/v projections together, written
        into each drafter's own cache."""
        todo = [d for d in drafters if d.pending_feats.shape[0]]
        if not todo:
            return
        m, ns = todo[0].m, [d.pending_feats.shape[0] for d in todo]
        feats = _cat([d.pending_feats for d in todo])
        if native.active(feats):  # fc, hidden_norm and every layer's keys and values in one call (the same bits)
            DFlashDrafter._native_call(todo, [0] * len(todo), _NO_IDS)
            return
        ctx = m.context(feats)
        cos, sin = _ropes(todo, [d.known for d in todo], ns)
        bounds = [0, *itertools.accumulate(ns)]
        for d, n in zip(todo, ns):
            d.pending_feats = d.pending_feats[:0]
            d.cache.reserve(n)
        for i in range(len(m.layers)):
            if native.active(ctx):  # the same ops from C++ (`speclab.core.native`)
                native.context_kv(m.layers[i], i, ctx, cos, sin, [d.cache for d in todo], [d.known for d in todo], ns)
                continue
            k, v = m.context_kv(i, ctx, cos, sin)
            for d, a, b in zip(todo, bounds, bounds[1:]):
                d.cache.write(i, d.known, k[:, a:b], v[:, a:b])
        for d, n in zip(todo, ns):
            d.cache.length = d.known = d.known + n

    @torch.inference_mode()
    def block_logits(self, n_rows: int) -> torch.Tensor:
        """One drafter forward of the block [root, mask x (n_rows - 1)] at positions known..: logits [n_rows - 1, V]
        of the mask rows (before any Markov bias). Block keys and values go after the context and stay uncommitted."""
        return DFlashDrafter.blocks_logits([self], [n_rows])[0]

    @staticmethod
    @torch.inference_mode()
    def blocks_logits(drafters: list[DFlashDrafter], n_rows: list[int]) -> list[torch.Tensor]:
        """The blocks of several drafters of one model in ONE forward: first the backlogs `catch_up_many` stashed
        (`_absorb`), then every block's rows through each layer's projections and MLP together, each block attending
        over its own drafter's context and itself (`mix_many`). Natively, with a dense head and the target's embedding
        table, both in one call (`native.dflash_block`: the same ops, the same bits)."""
        d0, m = drafters[0], drafters[0].m
        ids = _cat([torch.cat([d.root, d.mask_ids[: n - 1]]) for d, n in zip(drafters, n_rows)])
        if d0.flash is None and d0.target.embed_table is not None and native.active(ids):
            return DFlashDrafter._native_blocks(drafters, n_rows, ids)
        DFlashDrafter._absorb(drafters)
        x = d0.target.embed(ids).to(d0.dtype) * m.config.input_embedding_scale
        cos, sin = _ropes(drafters, [d.known for d in drafters], n_rows)
        for d, n in zip(drafters, n_rows):
            d.cache.reserve(n)
        caches, starts, masks = [d.cache for d in drafters], [d.known for d in drafters], [None] * len(drafters)
        # context and block, both ways: the same ops from C++ (`speclab.core.native`), or each layer from Python
        mix = None if native.active(x) else mix_many(caches, starts, n_rows, masks, d0.scale)
        for i, L in enumerate(m.layers):
            if mix is None:
                x = native.decoder_layer(L, i, native.rms(L.input_layernorm, x), x, cos, sin, caches, starts, n_rows,
                                         masks, d0.scale)
            else:
                q, k, v = m.block_qkv(i, x, cos, sin)
                x = m.finish(i, x, mix(i, q, k, v))
        # the mask rows' final-norm states (DSpark's confidence head reads them)
        h = native.rms(m.norm, _cat([x[a + 1 : a + n] for a, n in zip([0, *itertools.accumulate(n_rows)], n_rows)]))
        # the target's head weight after the drafter's own norm, in the drafter's dtype: draft logits only choose what
        # to propose (verification accepts by the target's), so they skip the fp32 refinement of the target's
        # (`speclab.core.precision.Head`; measured: it cost 7% of DFlash's tokens/s here)
        logits = (d0.flash(h) if d0.flash is not None else
                  linear(h, d0.head_weight).float() * m.config.output_multiplier)
        return DFlashDrafter._split(drafters, n_rows, h, logits)

    @staticmethod
    def _split(drafters: list[DFlashDrafter], n_rows: list[int], h: torch.Tensor, logits: torch.Tensor) -> list:
        """Each drafter's mask rows of the blocks' final-norm states (kept: DSpark's confidence head reads them) and
        logits, in order."""
        out, a = [], 0
        for d, n in zip(drafters, n_rows):
            d.last_h = h[a : a + n - 1]
            out.append(logits[a : a + n - 1])
            a += n - 1
        return out

    @staticmethod
    def _native_blocks(drafters: list[DFlashDrafter], n_rows: list[int], ids: torch.Tensor) -> list[torch.Tensor]:
        """`blocks_logits` in one native call: the stashed backlogs, then the blocks."""
        h, logits = DFlashDrafter._native_call(drafters, n_rows, ids)
        return DFlashDrafter._split(drafters, n_rows, h, logits)

    @staticmethod
    def _native_call(drafters: list[DFlashDrafter], n_rows: list[int], ids: torch.Tensor):
        """`native.dflash_block` over the drafters' stashed backlogs and their blocks ids (n_rows[j] rows each; no
        ids: the backlogs alone), each cache reserved for both and its context advanced by its backlog after."""
        d0 = drafters[0]
        ctx = [j for j, d in enumerate(drafters) if d.pending_feats.shape[0]]
        cn = [drafters[j].pending_feats.shape[0] for j in ctx]
        feats = _cat([drafters[j].pending_feats for j in ctx]) if ctx else None
        backlog = dict(zip(ctx, cn))
        for j, (d, n) in enumerate(zip(drafters, n_rows)):  # each cache's length is its context's (`known`)
            d.pending_feats = d.pending_feats[:0]
            d.cache.reserve(backlog.get(j, 0) + n)
        embed = d0.target.embed_table
        out = native.dflash_block(d0.m, [d.cache for d in drafters], [d.known for d in drafters], feats, ctx, cn, ids,
                                  n_rows, embed if embed is not None else _NO_IDS, d0.cos, d0.sin, d0.head_weight,
                                  d0.scale)
        for j, n in zip(ctx, cn):
            drafters[j].cache.length = drafters[j].known = drafters[j].known + n
        return out

    @torch.inference_mode()
    def propose(self, max_depth: int, sampling: Sampling, generator: torch.Generator | None = None) -> DraftTree:
        return DFlashDrafter.propose_many([self], [max_depth], sampling, [generator])[0]

    @staticmethod
    @torch.inference_mode()
    def propose_many(drafters: list[DFlashDrafter], depths: list[int], sampling: Sampling,
                     generators: list) -> list[DraftTree]:
        """Several drafters of one model propose with ONE drafter forward (`blocks_logits`); each then builds its own
        chain or tree from its rows (a FlashHead drafter proposes alone: its head keeps per-call state)."""
        rows = [min(d.block_size, k + 1) if d.root is not None else 0 for d, k in zip(drafters, depths)]
        go = [j for j, n in enumerate(rows) if n >= 2]
        trees = [DraftTree.empty(d.device) for d in drafters]
        if not go:
            return trees
        if any(drafters[j].flash is not None for j in go) and len(go) > 1:
            for j in go:
                trees[j] = drafters[j].propose(depths[j], sampling, generators[j])
            return trees
        for j in go:
            d = drafters[j]
            if d.flash is not None:  # clusters drawn from the centroid softmax when the block is sampled
                d.flash.temperature = 0.0 if d.tree_topk > 1 else sampling.temperature
                d.flash.generator = generators[j]
        with forward_clock:
            logits = DFlashDrafter.blocks_logits([drafters[j] for j in go], [rows[j] for j in go])
        greedy = [i for i, j in enumerate(go) if sampling.greedy and drafters[j].markov
                  and drafters[j].tree_topk == 1 and drafters[j].flash is None]
        if greedy:  # greedy Markov chains: each row's bias for every request in one op
            chains = DFlashDrafter._markov_chains([drafters[go[i]] for i in greedy], [logits[i] for i in greedy])
            for i, tree in zip(greedy, chains):
                trees[go[i]] = drafters[go[i]]._finish(tree)
        for i, (j, lg) in enumerate(zip(go, logits)):
            if i not in greedy:
                trees[j] = drafters[j].tree_of(lg, sampling, generators[j])
        return trees

    @staticmethod
    def _markov_chains(drafters: list[DFlashDrafter], logits: list[torch.Tensor]) -> list[DraftTree]:
        """Greedy chains of the Markov head for several drafters at once, left to right: row k of every block still
        drafting gets the Markov bias of its previous token in one call, then its argmax (what each drafter picks
        alone). From C++ where the layers run natively (`native.markov_chains`: the same ops, without a Python loop's
        ten calls a row)."""
        m = drafters[0].m
        prev = torch.cat([d.root for d in drafters])
        if native.active(prev):
            picks, probs = native.markov_chains(m.markov_w1, m.markov_w2, logits, prev)
            return [DraftTree.chain(t, p) for t, p in zip(picks, probs)]
        n = [lg.shape[0] for lg in logits]
        tokens = torch.zeros(len(drafters), max(n), dtype=torch.long, device=prev.device)
        rows: list[list[torch.Tensor]] = [[] for _ in drafters]
        for k in range(max(n)):
            live = [j for j, nj in enumerate(n) if k < nj]
            row = torch.stack([logits[j][k] for j in live]) + m.markov_bias(prev[live]).float()
            pick = argmax(row)
            prev = prev.clone()
            prev[live] = pick
            tokens[live, k] = pick
            for i, j in enumerate(live):
                rows[j].append(row[i])
        return [DraftTree.chain(tokens[j, : n[j]], torch.softmax(torch.stack(r), -1).gather(
            1, tokens[j, : n[j], None])[:, 0]) for j, r in enumerate(rows)]

    def tree_of(self, logits: torch.Tensor, sampling: Sampling, generator) -> DraftTree:
        """The draft from this drafter's block logits: a tree of the rows' top-k, a greedy chain of independent rows
        (one argmax), or left to right (the Markov head, or sampling); with DSpark's head, each row's c_k."""
        if self.scheme == "topk":  # deterministic drafts at T > 0 too (the comparison)
            sampling = Sampling()
        if self.tree_topk > 1:
            tree = self._tree(logits, sampling, generator)
        elif not self.markov and sampling.greedy:  # independent rows: the whole block is one argmax
            logp = torch.log_softmax(logits, -1)
            lq, tokens = logp.max(-1)
            tree = DraftTree.chain(tokens, lq.exp())
        elif sampling.greedy:  # the Markov head's bias row by row
            tree = DFlashDrafter._markov_chains([self], [logits])[0]
        else:
            tree = self._left_to_right(logits, sampling, generator)
        return self._finish(tree)

    def _finish(self, tree: DraftTree) -> DraftTree:
        """A drafted tree with what the drafter adds to it: FlashHead's candidates, DSpark's c_k of each row."""
        if self.flash is not None and len(tree):  # a node at depth d was drafted from block row d
            tree.cands = self.flash.last_candidates[tree.depth - 1]
        if self.confidence and self.m.has_confidence and tree.is_chain and len(tree):  # DSpark: c_k of each row
            prev = torch.cat([self.root, tree.tokens[:-1]])
            tree.extra["confidence"] = self.m.confidence(self.last_h[: len(tree)], prev)
        return tree

    def _left_to_right(self, logits: torch.Tensor, sampling: Sampling, generator) -> DraftTree:
        """Under sampling, row by row: add the Markov bias of the token before, then draw from q_k (kept for
        verification); from C++ where the layers run natively (`native.markov_draws`: the same ops). Without the head
        the rows are independent: one draw for the block (the same uniforms, in the same order)."""
        t = sampling.temperature * self.draft_temp
        if not self.markov:  # the rows' uniforms in one draw, in the order drawing row by row takes them
            tokens, qx, q = draw_one(logits, sampling, self.draft_temp, generator)
            return DraftTree.chain(tokens, qx, chain_dists([q]))
        if t > 0 and native.active(logits):
            tokens, qx, q = native.markov_draws(self.m.markov_w1, self.m.markov_w2, logits, self.root,
                                                uniforms(logits, generator), t, sampling.top_k, sampling.top_p)
            return DraftTree.chain(tokens, qx, chain_dists([q]))
        prev, tokens, dists, drawn = self.root, [], [], []
        for k in range(logits.shape[0]):
            row = logits[k : k + 1] + self.m.markov_bias(prev).float()
            prev, qx, q = draw_one(row, sampling, self.draft_temp, generator)
            prev = prev.view(1).to(self.device)
            dists.append(q)
            drawn.append(qx)
            tokens.append(prev)
        return DraftTree.chain(torch.cat(tokens), torch.cat(drawn), chain_dists(dists))

    def _tree(self, logits: torch.Tensor, sampling: Sampling, generator) -> DraftTree:
        """A tree from the rows' top-k (speclab.core.tree.dynamic_tree): depth d's children are row d's top tokens, with
        the Markov bias of their parent's token when the head is on; at T > 0 drawn from those rows' q instead. No
        drafter call beyond the block's."""
        def logp_after(row: int, parents: torch.Tensor) -> torch.Tensor:
            lg = logits[row].expand(parents.numel(), -1)
            return torch.log_softmax(lg + self.m.markov_bias(parents).float() if self.markov else lg, -1)

        drawn = None if sampling.greedy else TreeDraw(lambda lp: draft_probs(lp, sampling, self.draft_temp),
                                                      self.scheme, generator, logits.shape[-1])
        return dynamic_tree(logp_after(0, self.root)[0], lambda level, tokens, _: (logp_after(level, tokens), None),
                            logits.shape[0], self.tree_topk, self.total_tokens, None, sampled=drawn)

    def commit(self, tree: DraftTree, accepted: torch.Tensor) -> None:
        """Nothing to keep: the block's keys and values sit past `known` and the next block overwrites them; the
        accepted tokens come back in the next catch-up with the target's features."""
        if self.cache is not None:
            self.cache.crop(self.known)


def _check(p: dict, target) -> None:
    check_dynamic_tree("dflash", "block_size", p["block_size"], p["block_size"] - 1, p["tree_topk"])


def _same_decode(p: dict) -> dict:
    """Without a tree (tree_topk 1) total_tokens plays no part."""
    return {**p, "total_tokens": 16} if p["tree_topk"] == 1 else p


# CPU defaults picked by `speclab grid` on the zoo in the default dtype (data/zoo/dflash/README.md has the table):
# blocks of 5 at T = 0, of 6 at T > 0 (with block verification a longer sampled chain keeps more: 6 over 5 +8% at
# T = 0.7, +2% and +10% at T = 1 in two grids, AMD EPYC, 2026-12-02); GPU preset: DFlash's evaluations
PARAMS = (Param("markov", 1, lambda t: Bound(0, 1), grid=(0, 1),
                help="1 = DSpark's Markov head when the drafter has one, 0 = the plain parallel readout"),
          Param("block_size", 5, lambda t: Bound(2, min(MAX_TREE_NODES, t.max_context) + 1), gpu=16, sampled=6,
                grid=(2, 3, 4, 5, 6, 8, 10, 12, 16),
                help="block rows (the root + block_size - 1 masks; CPU default 5, 6 at T > 0)"),
          Param("tree_topk", 1, lambda t: Bound(1, t.vocab_size), help="children per row in a tree (1 = a chain)"),
          Param("total_tokens", 16, lambda t: Bound(1, min(MAX_TREE_NODES, t.max_context)),
                help="draft nodes kept from the tree"))

# the shapes the conformance suite checks for this drafter (tests/test_conformance.py: greedy equals AR, sampling
# keeps the target's distribution, catch-up, reset), each with the random model `ModelRole.random` builds
SHAPES = (Shape("chain", dict(block_size=4, markov=1), dict(markov_rank=8)),
          Shape("chain-long", dict(block_size=12, markov=1), dict(markov_rank=8)),
          Shape("chain-plain", dict(block_size=4, markov=0)),
          Shape("chain-plain-short", dict(block_size=2, markov=0)),
          Shape("chain-plain-long", dict(block_size=7, markov=0)),
          Shape("tree", dict(block_size=5, markov=1, tree_topk=3, total_tokens=8), dict(markov_rank=8)),
          Shape("tree-plain", dict(block_size=7, markov=0, tree_topk=2, total_tokens=12)),
          Shape("flash", dict(markov=0, head="flash", clusters=64, probes=4, margin=2.0), dict(markov_rank=8)),
          Shape("flash-markov", dict(markov=1, head="flash", clusters=64, probes=1), dict(markov_rank=8)),
          Shape("flash-tree", dict(tree_topk=2, head="flash", clusters=64, probes=1), dict(markov_rank=8)))

def row_call(target, model: DFlashModel, ids: torch.Tensor, context: int):
    """`ModelRole.call`: one drafter call over a block of n rows (the root and n - 1 masks) after a `context`-token
    context; False for n < 2 (a block is the root and at least one mask)."""
    blocks: dict[int, DFlashDrafter] = {}

    def call(n: int) -> bool | None:
        if n < 2:
            return False
        if n not in blocks:
            d = blocks[n] = DFlashDrafter(model, target, block_size=n, markov=False, tree_topk=1, total_tokens=16)
            d.reset(ids[: context + 1], target.forward(ids[:context], target.new_cache(), layers=d.layers).features)
            d.catch_up(ids[:0], None)
        blocks[n].propose(n, Sampling(), None)
        return None
    return call


# stand down where drafting does not pay (`speclab.drafters.schedule.PaysRouter`), measured by `speclab grid` at T >
# 0: every value above 0 slower at T = 0.7 and 1 on the zoo, AMD EPYC, 2026-12-02
PAYS = pays_params(0.0)

ENTRY = DrafterEntry(
    name="dflash", label="DFlash", color="#d62728",
    train=TrainEntry("speclab.train.dflash", "DFlashTrainConfig", "train_dflash", "DFlash (with DSpark's Markov "
                     "head) online from the frozen target", init_from="DFlash drafter"),
    trainings={"dspark": TrainEntry("speclab.train.dspark", "DSparkTrainConfig", "train_dspark", "DSpark's "
                                    "confidence head on a DFlash drafter (frozen), then its sequential temperature "
                                    "scaling on held-out greedy text", init_from="DFlash drafter",
                                    needs_init="the head sits on a trained DFlash drafter (the zoo's: "
                                    "data/zoo/dflash)")},
    costs=(CostBench("block", "block_costs", "what a DFlash block costs by block size (drafter call, Markov head, "
                     "verification)", "block_sizes", "--block-size", "2,3,4,6,8,12,16", 2, "block_size",
                     ("draft_ms", "draft_markov_ms", "verify_ms"), "part",
                     "DFlash: what a block costs (drafter call, Markov head, verification)",
                     "ms per block after a {context}-token context (lower is better)", "block size (rows)",
                     low_why="a block is the root and at least one mask"),),
    params=PARAMS + SAMPLING_PARAMS + PAYS + HEAD_PARAMS, check=_check, same_decode=head_same_decode(_same_decode),
    build=with_head(lambda target, model, markov, **params: DFlashDrafter(model, target, markov=bool(markov), **params),
                    "dflash", lambda model, target: target.head_weight,
                    scale=lambda model: model.config.output_multiplier),
    methods={"dflash": "DFlash: a block of masks drafted in one forward from the target's features (block_size "
                       "rows: block_size - 1 tokens); markov = 1 adds DSpark's Markov head when the drafter has one; "
                       "tree_topk > 1 makes a tree of the rows' top-k (best total_tokens kept)"},
    model=ModelRole("dflash", "--dflash", "DFlash", "a DFlash drafter",
                    lambda path, target, paths: load_dflash(path, target),
                    zoo="dflash", card="data/zoo/dflash/README.md",
                    help="DFlash drafter directory for dflash (public layout; default: the zoo's)",
                    random=lambda target, seed, **kw: random_dflash(target, seed, **kw), call=row_call),
    shapes=SHAPES)


# ---- random drafters: `ModelRole.random` (the conformance suite's and the smoke tests' models, no files) ------------

def mask_id_of(target) -> int:
    """The mask token a drafter for `target` drafts with: its tokenizer's (the zoo's reserves <|mask|>), else the
    last id of its vocabulary."""
    tok = target.tokenizer
    mask = getattr(tok, "mask_token", None)
    return int(tok.convert_tokens_to_ids(mask)) if mask else target.vocab_size - 1


def config_for(target, markov_rank: int = 0, layers: int = 2, mask_id: int | None = None) -> DFlashConfig:
    """A DFlash config shaped for `target`: its width, heads, MLP and default layers, `layers` decoder layers, blocks
    of 8, a Markov head of `markov_rank` (0: none)."""
    c = target.config
    return DFlashConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=layers,
                        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                        head_dim=c.head_dim, vocab_size=target.vocab_size,
                        target_layer_ids=default_layer_ids(target.num_layers),
                        mask_token_id=mask_id_of(target) if mask_id is None else mask_id, block_size=8,
                        rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.max_position_embeddings,
                        markov_rank=markov_rank)


def random_dflash(target, seed: int, markov_rank: int = 0, mask_id: int | None = None) -> DFlashModel:
    """A random DFlash drafter for `target` (seeded; weights larger than the default init, so its drafts are
    peaked and varied), frozen, in its dtype and on its device; with a Markov head of `markov_rank`."""
    torch.manual_seed(seed)
    m = DFlashModel(config_for(target, markov_rank, mask_id=mask_id))
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    return m.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)


_NO_IDS = torch.zeros(0, dtype=torch.long)


def _cat(ts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat of the tensors, or the one tensor as it is (a single request's rows: one op fewer, and no copy)."""
    return ts[0] if len(ts) == 1 else torch.cat(ts)


def _ropes(drafters: list[DFlashDrafter], starts: list[int], ns: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [rows, 1, D] of ns[j] rows from position starts[j] of each drafter, in order."""
    ropes = [d._rope(s, n) for d, s, n in zip(drafters, starts, ns)]
    return _cat([c for c, _ in ropes]), _cat([s for _, s in ropes])
