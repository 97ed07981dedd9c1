"""EAGLE-3: an autoregressive tree drafter that reads the target's own features (Li et al., 2025).

The drafter is one decoder layer in the public EAGLE-3 layout (../shared/notes/drafter-formats.md), so a public
checkpoint loads as it is and ours is written the same way:

    features of three target layers, concatenated [3 * H_t] -> fc -> h                  (depth 0 only)
    x = cat(input_layernorm(embed(next token)), hidden_norm(h))                          [2 * H]
    h' = h + o_proj(attention(q/k/v_proj(x)));  h' = h' + mlp(post_attention_layernorm(h'))
    logits = lm_head(norm(h'))   over the draft vocabulary (full, or reduced: target id = id + d2t[id])

Position t pairs the target's feature f_t with the token x_{t+1} (the engine's catch-up pairing) and predicts
x_{t+2}; past depth 0 the drafter feeds back its own pre-norm output h' instead of fc(features).

Layer convention. `eagle_config.eagle_aux_hidden_state_layer_ids` are Hugging Face `hidden_states` indices:
id j is the residual stream *entering* decoder layer j (the output of layer j - 1); the public default is
(2, L // 2, L - 3). speclab's `Target.forward(layers=...)` names layer outputs, so id j is speclab layer j - 1
(`Eagle3Config.target_layers`). On the zoo's 6-layer target the default collapses to (2, 3, 3); the zoo drafter
uses (1, 3, 5): low, middle and the input of the last layer.

Drafting (EAGLE-2's dynamic tree): the root's top-k children; then `depth - 1` times the k best frontier nodes
(cumulative log-probability) are forwarded in one drafter call under a tree mask and expanded by their top-k;
at the end the best `total_tokens` nodes of everything expanded form the tree (ancestor-closed, since a score
only falls along a path). tree_topk = 1 is a chain. At T = 0 the tree is deterministic (verification treats its
nodes as point masses). At T > 0 the drafter samples (`draft_temp` times the target's temperature, its top-k and
top-p): a chain draws each token from q, a tree draws each expanded node's children from q without replacement or
i.i.d. (`scheme`; `speclab.core.tree.dynamic_tree`), and verification tests min(1, p/q); `scheme=topk` keeps the
deterministic drafts for comparison.

Catch-up with KV-only prefill: the backlog (tokens accepted since the drafter last looked, with the target's
features) needs only its keys and values in the drafter's cache. With one layer those depend on the inputs
alone, so every backlog row gets k/v projections and nothing else; only the last row runs attention, the MLP
and the head (its output is the root of the next draft). `kv_only=False` runs the whole layer and the head on
every row instead (the baseline `speclab eagle3-catchup` measures against); both give the same draft.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from speclab.checks import MAX_TREE_NODES, Bound
from speclab.core import native
from speclab.core.layers import DecoderLayer, Linear, causal_mask, rope_inv_freq, rope_tables
from speclab.core.lean import KVCache
from speclab.core.sampling import Sampling, chain_dists, draft_probs, draw_one
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
from speclab.drafters.schedule import LengthSchedule, adaptive_param, pays_params
from speclab.errors import ModelNotFound


def default_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's (2, L // 2, L - 3) in `hidden_states` indices; for shallow targets where those are not three
    distinct inputs of decoder layers 1..L-1, three spread ones (the zoo's 6 layers: 1, 3, 5)."""
    ids = (2, num_layers // 2, num_layers - 3)
    if len(set(ids)) == 3 and all(1 <= j < num_layers for j in ids):
        return ids
    if num_layers < 4:
        raise ValueError(f"EAGLE-3 reads three distinct target layers 1..L-1: it needs at least 4 (got {num_layers})")
    return (1, num_layers // 2, num_layers - 1)


@dataclass
class Eagle3Config:
    """The public EAGLE-3 config.json, as far as the drafter uses it."""
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    layer_ids: tuple[int, ...]  # eagle_config.eagle_aux_hidden_state_layer_ids (hidden_states indices)
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    extra: dict = field(default_factory=dict)  # other keys of the file, written back unchanged

    def __post_init__(self):
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        self.layer_ids = tuple(int(j) for j in self.layer_ids)

    @property
    def target_layers(self) -> tuple[int, ...]:
        """The layers in speclab's convention (`Target.forward(layers=...)`: outputs of decoder layer i)."""
        return tuple(j - 1 for j in self.layer_ids)

    @classmethod
    def from_dict(cls, d: dict, num_target_layers: int | None = None) -> Eagle3Config:
        d = dict(d)
        eagle = d.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        if ids is None:
            if num_target_layers is None:
                raise ValueError("config.json has no eagle_config.eagle_aux_hidden_state_layer_ids and the target's "
                                 "depth is unknown")
            ids = default_layer_ids(num_target_layers)
        rope = d.get("rope_parameters") or {}
        known = {"hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
                 "draft_vocab_size", "target_hidden_size", "head_dim", "rms_norm_eps", "max_position_embeddings",
                 "rope_theta", "rope_scaling"}
        return cls(hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
                   num_attention_heads=d["num_attention_heads"],
                   num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
                   vocab_size=d["vocab_size"], draft_vocab_size=d.get("draft_vocab_size") or d["vocab_size"],
                   target_hidden_size=d.get("target_hidden_size") or d["hidden_size"], layer_ids=tuple(ids),
                   head_dim=d.get("head_dim"), rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                   max_position_embeddings=d.get("max_position_embeddings", 2048),
                   rope_theta=d.get("rope_theta", rope.get("rope_theta", 10000.0)),
                   rope_scaling=(d.get("rope_scaling")
                                 or (rope if rope.get("rope_type", "default") != "default" else None)),
                   extra={k: v for k, v in d.items() if k not in known})

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("extra", "layer_ids")}
        out = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
               "tie_word_embeddings": False, "hidden_act": "silu", **self.extra, **d}
        out["eagle_config"] = {**(self.extra.get("eagle_config") or {}),
                               "eagle_aux_hidden_state_layer_ids": list(self.layer_ids)}
        return out


class _MidLayer(DecoderLayer):
    """EAGLE-3's one decoder layer (`speclab.core.layers.DecoderLayer`, the public `midlayer.*` names): attention
    reads [input_layernorm(embedding), hidden_norm(hidden)], 2 x d wide, without q/k norms (`Eagle3Model.qkv`);
    the rest is the shared layer's `finish`."""

    def __init__(self, c: Eagle3Config):
        super().__init__(c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads,
                         c.head_dim, c.rms_norm_eps, d_in=2 * c.hidden_size, qk_norm=False)
        self.hidden_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        # the parameters in the order EAGLE-3's layer always listed them (random init draws in construction order,
        # the shared layer's: the same; gradient clipping sums norms in this order: training's bits unchanged)
        order = ("hidden_norm", "input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
        self._modules = {k: self._modules[k] for k in order}


class Eagle3Model(nn.Module):
    """The drafter's weights in the public layout, and the pieces of its forward (used by the drafter and by
    training alike). `embed_tokens` is None when the checkpoint has none: the target's embedding is used."""

    def __init__(self, config: Eagle3Config, with_embedding: bool = False):
        super().__init__()
        c = self.config = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size) if with_embedding else None
        self.fc = Linear(len(c.layer_ids) * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = _MidLayer(c)
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.lm_head = Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(c.vocab_size, dtype=torch.bool))
        self.inv_freq, self.rope_scale = rope_inv_freq(c)  # fp32 on CPU, not a buffer: `.to(bf16)` leaves it

    # -- the forward, in pieces -------------------------------------------------------------------------------
    def qkv(self, emb: torch.Tensor, h: torch.Tensor, cos, sin, q_rows: slice | None = None):
        """Queries [.., heads, n_q, D] (of `q_rows`, default all) and keys, values [.., kv_heads, n, D] for
        inputs (embedding of the next token, hidden) [.., n, H]; rotary applied."""
        return self.midlayer.self_attn.qkv(self.attn_input(emb, h), cos, sin, q_rows)

    def attn_input(self, emb: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """What attention reads: [input_layernorm(embedding), hidden_norm(hidden)] [.., n, 2 x H]."""
        L = self.midlayer
        if native.active(emb):  # the same ops in one call (`speclab.core.native`)
            return native.pair_norm(L.input_layernorm, emb, L.hidden_norm, h)
        return torch.cat([native.rms(L.input_layernorm, emb), native.rms(L.hidden_norm, h)], -1)

    def finish(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The rest of the layer (`speclab.core.layers.Layer.finish`): residual + o_proj(attention output
        [.., heads, n, D]), then the MLP."""
        return self.midlayer.finish(h, attn)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary of pre-norm outputs h [.., H]."""
        return self.lm_head(native.rms(self.norm, h))

    def rope(self, n: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin tables for positions 0..n-1 (speclab.core.lean's convention), on the model's device."""
        return rope_tables(self.inv_freq.to(self.fc.weight.device), self.rope_scale, n, dtype)

    @property
    def draft_to_target(self) -> torch.Tensor:
        """[draft_vocab] target token id of every draft-vocabulary id."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    # -- files --------------------------------------------------------------------------------------------------
    def save(self, out_dir: str | Path, dtype=torch.bfloat16, extra_files: dict[str, str] | None = None) -> None:
        """config.json + model.safetensors in the public layout."""
        save_checkpoint(self, self.config.to_dict(), out_dir, dtype, extra_files)


def load_eagle3(path: str | Path, target=None, device=None, dtype=None) -> Eagle3Model:
    """An EAGLE-3 drafter from a directory with its config.json and `model.safetensors` or `pytorch_model.bin`
    (keys `midlayer.*` or vLLM's `layers.0.*`). Checked against `target` when given (vocabulary, feature width,
    layer ids); a missing or unexpected weight is refused by name."""
    p, raw, sd = read_checkpoint(path, "EAGLE-3 drafter")
    if raw.get("num_hidden_layers", 1) != 1:
        raise ModelNotFound(f"{p.resolve()} holds a {raw.get('num_hidden_layers')}-layer "
                            f"{', '.join(raw.get('architectures') or ['model'])}, not an EAGLE-3 drafter (one decoder "
                            "layer; config.json 'num_hidden_layers' 1)")
    try:
        cfg = Eagle3Config.from_dict(raw, target.num_layers if target is not None else None)
    except (KeyError, ValueError, TypeError) as e:
        raise ModelNotFound(f"{p / 'config.json'} is not an EAGLE-3 config ({type(e).__name__}: {e})") from e
    sd = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in sd.items()}
    model = Eagle3Model(cfg, with_embedding="embed_tokens.weight" in sd)
    load_strict(model, sd, p, "EAGLE-3 drafter", optional={"d2t", "t2d"})
    if target is not None:
        _check_against(cfg, target, p)
    return place(model, path, target, device, dtype)


def _check_against(cfg: Eagle3Config, target, where: Path) -> None:
    check_fits("EAGLE-3 drafter", where, target, cfg.vocab_size, cfg.target_hidden_size, "features")
    bad = [j for j in cfg.layer_ids if not 1 <= j < target.num_layers]
    if bad:
        raise ModelNotFound(f"the EAGLE-3 drafter in {where} reads hidden_states {list(cfg.layer_ids)}, but the "
                            f"target has {target.num_layers} layers (indices 1..{target.num_layers - 1} are inputs "
                            "of its decoder layers)")


class Eagle3Drafter:
    """The EAGLE-3 drafter behind speclab's drafter protocol (speclab/core/protocol.py)."""
    name = "eagle3"
    flash = None  # a FlashHead over the draft vocabulary (speclab.drafters.flashhead), or None: the dense LM head

    def __init__(self, model: Eagle3Model, target, *, depth: int, tree_topk: int, total_tokens: int,
                 draft_temp: float = 1.0, scheme: str = "wor", kv_only: bool = True, adaptive: str = "off"):
        if depth < 1 or tree_topk < 1 or total_tokens < 1:
            raise ValueError(f"eagle3 needs depth, tree_topk and total_tokens >= 1 (got {depth}, {tree_topk}, "
                             f"{total_tokens})")
        self.m, self.depth, self.tree_topk, self.total_tokens = model, depth, tree_topk, total_tokens
        self.kv_only, self.draft_temp, self.scheme = kv_only, draft_temp, scheme
        self.lengths = LengthSchedule(min(depth, total_tokens), adaptive)  # a chain's next length (`adaptive`)
        self.layers = model.config.target_layers
        c = model.config
        self.H, self.KV, self.D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.scale = self.D ** -0.5
        self.device, self.dtype = model.fc.weight.device, model.fc.weight.dtype
        self.embed = model.embed_tokens.weight if model.embed_tokens is not None else None
        self.target = target
        self.to_target = model.draft_to_target
        self.cos, self.sin = model.rope(max(c.max_position_embeddings, target.max_context) + 1, self.dtype)
        self.cache: KVCache | None = None
        self.known = 0  # positions (token-feature pairs) in the drafter's KV cache
        self.root_logits = None  # [1, draft_vocab]: the distribution after the last committed token
        self.root_h = None  # [1, H]: the drafter's pre-norm output at the last pair (fed back at depth 1)
        self.root_cands = None  # with a FlashHead: the root row's candidates [1, C] (target ids)
        self.pending_ids = self.pending_feats = None

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(self.device)
        return self.embed[ids] if self.embed is not None else self.target.embed(ids).to(self.dtype)

    def _rope(self, pos: torch.Tensor):
        return self.cos[pos][:, None], self.sin[pos][:, None]  # [n, 1, D]

    # -- protocol -------------------------------------------------------------------------------------------------
    @property
    def draft_slots(self) -> int:
        """Cache slots its largest draft takes after the committed pairs: tree_topk nodes per depth after the
        first (a chain: depth - 1)."""
        return self.tree_topk * (self.depth - 1)

    def reset(self, prompt_ids: torch.Tensor, prompt_features: torch.Tensor | None,
              capacity: int | None = None) -> None:
        """`capacity` (committed tokens; None: grow on demand): the cache is sized once for it and the largest
        draft (the committed pairs are one fewer than the committed tokens)."""
        self.cache = KVCache(1, self.KV, self.D, self.dtype, self.device,
                             None if capacity is None else capacity + self.draft_slots)
        self.known, self.root_logits, self.root_h = 0, None, None
        self.lengths.reset()
        self.pending_ids = prompt_ids[1:].to(self.device)
        self.pending_feats = prompt_features if prompt_features is not None else \
            torch.zeros(0, len(self.layers) * self.m.config.target_hidden_size, device=self.device, dtype=self.dtype)

    @torch.inference_mode()
    def catch_up(self, ids: torch.Tensor, features: torch.Tensor | None) -> None:
        """The backlog (token x_t with the target's feature f_{t-1}, at position t - 1) into the cache in one call:
        keys and values only for all rows but the last (`kv_only`), which alone runs the rest of the layer."""
        self._stash(ids, features)
        m = self.pending_ids.numel()
        if m == 0:
            return
        with forward_clock:  # a drafter forward: counted in the model-call share like the target's
            self._prefill(m)

    def _prefill(self, m: int) -> None:
        if self.kv_only and self._native_ok() and self.m.fc.bias is None and native.active(self.pending_feats):
            return self._native_prefill(m)
        emb, h = self._embed(self.pending_ids), self.m.fc(self.pending_feats.to(self.dtype))
        self.pending_ids, self.pending_feats = self.pending_ids[:0], self.pending_feats[:0]
        start, end = self.known, self.known + m
        cos, sin = self._rope(torch.arange(start, end, device=self.device))
        n_q = 1 if self.kv_only else m
        if native.active(emb):  # the same ops from C++ (`speclab.core.native`)
            h = Eagle3Drafter._native_layer([self], [start], [m], [n_q], emb, h, h[m - n_q :], cos, sin,
                                            q_rows=torch.tensor([m - 1], device=self.device) if self.kv_only else None)
        else:
            q, k, v = self.m.qkv(emb, h, cos, sin, q_rows=slice(m - 1, m) if self.kv_only else None)
            out = self._attend(q, k, v, start, mask=None)  # the last row sees everything; rows of a full pass, causal
            h = self.m.finish(h[m - n_q :], out)
        logits = self._logits(h)  # every row in the full pass (what a plain forward computes)
        self.known = end
        self.root_h, self.root_logits = h[-1:], logits[-1:]
        self.root_cands = self._cands()[-1:] if self.flash is not None else None

    def _native_prefill(self, m: int) -> None:
        """`_prefill`'s ops in one native call (`native.eagle3_prefill`: the same bits)."""
        L, start = self.m.midlayer, self.known
        self.cache.reserve(m)
        self.root_h, self.root_logits = native.eagle3_prefill(
            L, L.input_layernorm, L.hidden_norm, self.m.norm, self.m.lm_head, self.m.fc, self._embed_table(),
            self.pending_ids.to(self.device), self.pending_feats, self.cos, self.sin, self.cache, start, self.scale)
        self.pending_ids, self.pending_feats = self.pending_ids[:0], self.pending_feats[:0]
        self.cache.length = self.known = start + m
        self.root_cands = None

    # -- a batch of requests (`speclab.core.batch`): each request its own drafter, one model call per depth --------
    @staticmethod
    def catch_up_many(drafters: list[Eagle3Drafter], ids: list[torch.Tensor], features: list) -> None:
        """Each drafter's backlog waits for the `propose_many` that follows, whose first call digests them all."""
        for d, x, f in zip(drafters, ids, features):
            d._stash(x, f)

    def _stash(self, ids: torch.Tensor, features: torch.Tensor | None) -> None:
        """The backlog after whatever still waits (a backlog from reset: the prompt), until a prefill digests it."""
        if ids.numel():
            ids, features = ids.to(self.device), features.to(self.dtype)
            if self.pending_ids.numel():
                ids, features = torch.cat([self.pending_ids, ids]), torch.cat([self.pending_feats, features])
            self.pending_ids, self.pending_feats = ids, features

    @staticmethod
    @torch.inference_mode()
    def propose_many(drafters: list[Eagle3Drafter], depths: list[int], sampling: Sampling,
                     generators: list) -> list[DraftTree]:
        """Every drafter's backlog in ONE call (`_prefill` of each, rows together), then chains level by level, ONE
        call per depth for all requests (`_chain` of each, the same picks from each request's own generator); a tree
        or a FlashHead drafter proposes alone after the shared catch-up."""
        todo = [d for d in drafters if d.pending_ids.numel()]
        if todo:
            with forward_clock:
                Eagle3Drafter._prefill_many(todo)
        trees: list[DraftTree | None] = [None] * len(drafters)
        chains = []
        for j, (d, k) in enumerate(zip(drafters, depths)):
            depth = min(d.depth, k, d.total_tokens)
            if depth <= 0 or d.root_logits is None:
                trees[j] = DraftTree.empty(d.device)
            elif d.tree_topk > 1 or d.flash is not None:
                trees[j] = d.propose(k, sampling, generators[j])
            else:
                chains.append((j, depth))
        if chains:
            got = Eagle3Drafter._chains([drafters[j] for j, _ in chains], [n for _, n in chains], sampling,
                                        [generators[j] for j, _ in chains])
            for (j, _), tree in zip(chains, got):
                trees[j] = tree
        return trees  # type: ignore[return-value]

    @staticmethod
    def _prefill_many(drafters: list[Eagle3Drafter]) -> None:
        """`_prefill` of several drafters of one model in one pass: the backlogs' rows through fc and the layer's
        projections together; each drafter's rows written into its own cache; its last row (with `kv_only`; else
        every row, causal) attends and runs the rest of the layer."""
        d0, m = drafters[0], drafters[0].m
        ns = [d.pending_ids.numel() for d in drafters]
        bounds = [0, *torch.tensor(ns).cumsum(0).tolist()]
        emb = torch.cat([d._embed(d.pending_ids) for d in drafters])
        h = m.fc(torch.cat([d.pending_feats.to(d0.dtype) for d in drafters]))
        cos, sin = d0._rope(torch.cat([torch.arange(d.known, d.known + n, device=d0.device)
                                       for d, n in zip(drafters, ns)]))
        kv_only = all(d.kv_only for d in drafters)
        rows = torch.tensor(bounds[1:], device=d0.device) - 1 if kv_only else None
        if native.active(emb):  # the same ops from C++ (`speclab.core.native`)
            h = Eagle3Drafter._native_layer(drafters, [d.known for d in drafters], ns, [1] * len(ns) if kv_only else ns,
                                            emb, h, h[rows] if kv_only else h, cos, sin, q_rows=rows)
        else:
            q, k, v = m.qkv(emb, h, cos, sin, q_rows=rows)
            outs = [d._attend(q[:, j : j + 1] if kv_only else q[:, a:b], k[:, a:b], v[:, a:b], d.known, None)
                    for j, (d, a, b) in enumerate(zip(drafters, bounds, bounds[1:]))]
            h = m.finish(h[rows] if kv_only else h, torch.cat(outs, 1))
        for d in drafters:
            d.pending_ids, d.pending_feats = d.pending_ids[:0], d.pending_feats[:0]
            d.known = d.cache.length
        logits = d0._logits(h)
        for j, (d, b) in enumerate(zip(drafters, bounds[1:])):
            last = j if kv_only else b - 1
            d.root_h, d.root_logits = h[last : last + 1], logits[last : last + 1]
            d.root_cands = None

    @staticmethod
    def _chains(drafters: list[Eagle3Drafter], depths: list[int], sampling: Sampling,
                generators: list) -> list[DraftTree]:
        """`_chain` of several drafters, one call per depth for all of those still drafting (each request's own picks
        and generator, in the same order as alone)."""
        drawn = [not sampling.greedy and d.scheme != "topk" for d in drafters]
        logp = [torch.log_softmax(d.root_logits.float(), -1) for d in drafters]
        h = [d.root_h for d in drafters]
        tokens: list[list] = [[] for _ in drafters]
        logq: list[list] = [[] for _ in drafters]
        dists: list[list] = [[] for _ in drafters]
        for level in range(1, max(depths) + 1):
            live = [j for j, n in enumerate(depths) if level <= n]
            for j in live:
                d = drafters[j]
                if not drawn[j]:
                    lq, idx = logp[j].max(-1)
                    tok = d.to_target[idx]
                else:
                    tok, qx, q = draw_one(logp[j], sampling, d.draft_temp, generators[j], d.to_target,
                                          d.target.vocab_size)
                    lq = qx.log()
                    dists[j].append(q)
                tokens[j].append(tok)
                logq[j].append(lq)
            nxt = [j for j in live if level < depths[j]]
            if not nxt:
                break
            with forward_clock:  # the next node of every chain still drafting: one call
                d0, m = drafters[nxt[0]], drafters[nxt[0]].m
                pos = torch.tensor([drafters[j].known - 1 + level for j in nxt], device=d0.device)
                cos, sin = d0._rope(pos)
                hp = torch.cat([h[j] for j in nxt])
                emb = torch.cat([drafters[j]._embed(tokens[j][-1]) for j in nxt])
                if native.active(emb):  # the same ops from C++ (`speclab.core.native`)
                    live_d, ones = [drafters[j] for j in nxt], [1] * len(nxt)
                    hn = Eagle3Drafter._native_layer(live_d, [d.cache.length for d in live_d], ones, ones, emb, hp,
                                                     hp, cos, sin)
                else:
                    q, k, v = m.qkv(emb, hp, cos, sin)
                    o = torch.cat([drafters[j]._attend(q[:, i : i + 1], k[:, i : i + 1], v[:, i : i + 1],
                                                       drafters[j].cache.length, None) for i, j in enumerate(nxt)], 1)
                    hn = m.finish(hp, o)
                lp = d0._logp(hn)
            for i, j in enumerate(nxt):
                h[j], logp[j] = hn[i : i + 1], lp[i : i + 1]
        return [DraftTree.chain(torch.cat(t), torch.cat(lq).exp(), chain_dists(ds) if ds else None)
                for t, lq, ds in zip(tokens, logq, dists)]

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """The drafter's logits of pre-norm outputs h, computed in its dtype and returned as float32. Unlike the
        target's, they are not refined to fp32 (`speclab.core.precision.Head`): they only choose what to propose,
        and verification accepts by the target's logits (measured: refining cost 4% of EAGLE-3's tokens/s here)."""
        return self.flash(native.rms(self.m.norm, h)) if self.flash is not None else self.m.logits(h).float()

    def _logp(self, h: torch.Tensor) -> torch.Tensor:
        """The drafter's log-probabilities of pre-norm outputs h (float32): log_softmax of `_logits`, in one native call
        where the dense head runs natively (the same ops)."""
        if self.flash is None and native.active(h):
            return native.head_logp(self.m.norm, self.m.lm_head, h)
        return torch.log_softmax(self._logits(h), -1)

    def _cands(self) -> torch.Tensor:
        """The FlashHead's candidates of its last call, in target ids [rows, C]."""
        return self.to_target[self.flash.last_candidates]

    def _attend(self, q, k, v, start: int, mask: torch.Tensor | None):
        """Write k, v [kv_heads, n, D] at cache positions start.., attend queries [heads, n_q, D] over the cache up
        to there (default: causal for the last n_q rows; `mask` [n_q, end] bool otherwise)."""
        mask = self._slots(start, k.shape[1], q.shape[1], mask)
        self.cache.write(0, start, k, v)
        return self.cache.attend(0, q, self.cache.length, mask, self.scale)

    def _slots(self, start: int, n: int, n_q: int, mask: torch.Tensor | None) -> torch.Tensor | None:
        """Room for n rows at cache slots start.., which then end the cache; the mask of the last n_q rows' queries
        over it (default: causal) (`_attend`)."""
        self.cache.reserve(n)
        self.cache.length = start + n
        if mask is None and n_q > 1:
            mask = causal_mask(n_q, self.cache.length, self.device)
        return mask

    @staticmethod
    def _native_layer(drafters: list[Eagle3Drafter], starts: list[int], ns: list[int], nqs: list[int], emb, h, h_q,
                      cos, sin, masks: list | None = None, q_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The layer from C++ (`speclab.core.native.decoder_layer`) for drafters of one model: each one's ns[j] rows
        (embeddings `emb`, hidden `h`) written at its cache slots starts[j].. (`_slots`), its last nqs[j] rows querying
        (`q_rows` of all rows; None: every row) with residual `h_q`, under masks[j] (None: causal) -> their outputs."""
        masks = [d._slots(s, n, nq, mk) for d, s, n, nq, mk in
                 zip(drafters, starts, ns, nqs, masks or [None] * len(drafters))]
        m = drafters[0].m
        return native.decoder_layer(m.midlayer, 0, m.attn_input(emb, h), h_q, cos, sin, [d.cache for d in drafters],
                                    starts, ns, masks, drafters[0].scale, q_rows, nqs)

    @torch.inference_mode()
    def propose(self, max_depth: int, sampling: Sampling, generator: torch.Generator | None = None) -> DraftTree:
        depth = min(self.depth, max_depth)
        if depth <= 0 or self.root_logits is None:
            return DraftTree.empty(self.device)
        drawn = not sampling.greedy and self.scheme != "topk"
        if self.tree_topk == 1:
            return self._chain(min(self.lengths.length(sampling), max_depth), sampling if drawn else None, generator)
        return self._tree(depth, sampling if drawn else None, generator)

    def _forward_nodes(self, tokens, h_parent, depth_of_rows: int, mask):
        """One drafter call for draft nodes at the same depth (tokens [f], parents' outputs [f, H]), appended to
        the cache after the committed positions; returns their outputs [f, H] and draft log-probs [f, Vd]."""
        f = tokens.numel()
        start = self.cache.length
        p = self.known - 1 + depth_of_rows  # every node's position: one row of the tables, as many times as nodes
        cos, sin = self.cos[p : p + 1, None].expand(f, 1, -1), self.sin[p : p + 1, None].expand(f, 1, -1)
        with forward_clock:
            emb = self._embed(tokens)
            if native.active(emb):  # the same ops from C++ (`speclab.core.native`)
                h = Eagle3Drafter._native_layer([self], [start], [f], [f], emb, h_parent, h_parent, cos, sin, [mask])
            else:
                q, k, v = self.m.qkv(emb, h_parent, cos, sin)
                h = self.m.finish(h_parent, self._attend(q, k, v, start, mask))
            return h, self._logp(h)

    def _chain(self, depth: int, sampling: Sampling | None = None, generator=None) -> DraftTree:
        """A chain, one drafter call per token after the first: the argmax at every depth, or (`sampling`) a token
        drawn from the drafter's q (`speclab.core.sampling.draw_one`), q kept for verification."""
        if self._native_ok() and native.active(self.root_h):
            return self._native_chain(depth, sampling, generator)
        logp = torch.log_softmax(self.root_logits.float(), -1)
        h = self.root_h
        tokens, logq, dists, cands = [], [], [], [self.root_cands] if self.flash is not None else []
        for level in range(1, depth + 1):
            if sampling is None:
                lq, idx = logp.max(-1)
                tok = self.to_target[idx]
            else:
                tok, qx, q = draw_one(logp, sampling, self.draft_temp, generator, self.to_target,
                                      self.target.vocab_size)
                lq = qx.log()
                dists.append(q)
            tokens.append(tok)
            logq.append(lq)
            if level == depth:
                break
            h, logp = self._forward_nodes(tok, h, level, None)  # a chain: causal over the cache
            if self.flash is not None:
                cands.append(self._cands())
        tree = DraftTree.chain(torch.cat(tokens), torch.cat(logq).exp(), chain_dists(dists) if dists else None)
        tree.cands = torch.cat(cands) if cands else None
        return tree

    def _native_chain(self, depth: int, sampling: Sampling | None, generator) -> DraftTree:
        """`_chain`'s loop in one native call (`native.eagle3_chain`: the same ops, the same bits, the same uniforms
        in the same order), its depth - 1 drafter forwards writing cache slots from the cache's length on."""
        start, m, L = self.cache.length, self.m, self.m.midlayer
        self.cache.reserve(depth - 1)
        t = 0.0 if sampling is None else sampling.temperature * self.draft_temp
        u = torch.rand(depth, generator=generator) if sampling is not None else None  # `draw_one`'s, level by level
        with forward_clock(depth - 1):
            tokens, logq, q = native.eagle3_chain(
                L, L.input_layernorm, L.hidden_norm, m.norm, m.lm_head, self._embed_table(), self.cos, self.sin,
                self.known - 1, self.cache, start, self.scale, self.root_logits, self.root_h, depth, self.to_target,
                self.target.vocab_size, t, sampling.top_k if sampling else 0, sampling.top_p if sampling else 1.0, u)
        self.cache.length = start + depth - 1
        return DraftTree.chain(tokens, logq.exp(), chain_dists([q]) if q is not None else None)

    def _embed_table(self) -> torch.Tensor | None:
        """The table `_embed` takes rows of: its own, else the target's where that is a plain lookup (None: not)."""
        return self.embed if self.embed is not None else self.target.embed_table

    def _native_ok(self) -> bool:
        """Whether the catch-up and the chain may run natively: a dense head and an embedding table to read rows of."""
        return self.flash is None and self._embed_table() is not None

    def _tree(self, depth: int, sampling: Sampling | None = None, generator=None) -> DraftTree:
        """EAGLE-2 dynamic tree (speclab.core.tree.dynamic_tree): each depth's frontier is one drafter call under a tree
        mask over its ancestors' cache slots; a node's state is (its parent's output, its parent's slot)."""
        k, dev = self.tree_topk, self.device
        context = self.cache.length  # the slots every node sees: the committed pairs (and a subclass's own, ConFu's)
        n_slots_max = k * (depth - 1)
        slot_anc = torch.zeros(n_slots_max, n_slots_max, dtype=torch.bool, device=dev)
        slots = 0

        def expand(level, tokens, state):
            nonlocal slots
            h_parent, pslot = state
            f = tokens.numel()
            new = torch.arange(slots, slots + f, device=dev)
            slot_anc[new] = torch.where((pslot >= 0)[:, None], slot_anc[pslot.clamp(min=0)], False)
            slot_anc[new, new] = True
            mask = torch.cat([torch.ones(f, context, dtype=torch.bool, device=dev), slot_anc[new, : slots + f]], 1)
            h, logp = self._forward_nodes(tokens, h_parent, level, mask)
            slots += f
            return (logp, (h, new)) + ((self._cands(),) if self.flash is not None else ())

        logp0 = torch.log_softmax(self.root_logits[0].float(), -1)
        f0 = min(k, logp0.numel())
        root_state = (self.root_h.expand(f0, -1), torch.full((f0,), -1, device=dev))
        drawn = None if sampling is None else TreeDraw(lambda lp: draft_probs(lp, sampling, self.draft_temp),
                                                       self.scheme, generator, self.target.vocab_size)
        return dynamic_tree(logp0, expand, depth, k, self.total_tokens, root_state, self.to_target,
                            None if self.flash is None else self.root_cands[0], drawn)

    def commit(self, tree: DraftTree, accepted: torch.Tensor) -> None:
        """Drop the draft nodes' keys and values: the accepted tokens come back in the next catch-up paired with
        the target's features (what the drafter was trained on), not the drafter's own outputs."""
        if self.cache is not None:
            self.cache.crop(self.known)
        self.root_logits = self.root_h = None
        if self.tree_topk == 1:
            self.lengths.update(len(tree), accepted.numel())


def _check(p: dict, target) -> None:
    check_dynamic_tree("eagle3", "depth", p["depth"], p["depth"], p["tree_topk"])


def _same_decode(p: dict) -> dict:
    """A chain (tree_topk 1) drafts min(depth, total_tokens) tokens: that is all that tells two chains apart."""
    if p["tree_topk"] != 1:
        return p
    n = min(p["depth"], p["total_tokens"])
    return {**p, "depth": n, "total_tokens": n}


# CPU defaults picked by `speclab grid` on the zoo in the default dtype (data/zoo/eagle3/README.md has the tables):
# depth 4 at every temperature (at T > 0 it was 3 under token-by-token verification; with block verification a
# longer chain keeps more: depth 4 +7% over 3 at T = 0.7, as fast at T = 1, and as fast as 5 at both, AMD EPYC,
# 2026-12-02); GPU presets: EAGLE-3's evaluations (WhiFlash's Table 7)
PARAMS = (Param("depth", 4, lambda t: Bound(1, t.max_context), gpu=8, grid=(3, 4, 5, 6),
                help="draft tree depth (CPU default 4)"),
          Param("tree_topk", 1, lambda t: Bound(1, t.vocab_size), gpu=10, grid=(1, 2, 3, 4),
                help="children per expanded node (1 = a chain)"),
          Param("total_tokens", 8, lambda t: Bound(1, min(MAX_TREE_NODES, t.max_context)), gpu=60,
                grid=(4, 6, 8, 12, 16), help="draft nodes kept from the expanded tree"),
          adaptive_param("off", "a chain's length (at most min(depth, total_tokens); trees: off)"))

# the shapes the conformance suite checks for this drafter (tests/test_conformance.py: greedy equals AR, sampling
# keeps the target's distribution, catch-up, reset), each with the random model `ModelRole.random` builds
SHAPES = (Shape("chain", dict(depth=4, tree_topk=1, total_tokens=4)),
          Shape("chain-adaptive", dict(depth=4, tree_topk=1, total_tokens=4, adaptive="always")),
          Shape("tree", dict(depth=4, tree_topk=3, total_tokens=10)),
          Shape("tree-narrow", dict(depth=3, tree_topk=2, total_tokens=6)),
          Shape("tree-cut", dict(depth=5, tree_topk=4, total_tokens=4)),  # fewer nodes than the depth
          Shape("tree-wide", dict(depth=2, tree_topk=8, total_tokens=16)),
          Shape("reduced-vocab", dict(depth=4, tree_topk=1, total_tokens=4), dict(draft_vocab="half")),
          Shape("reduced-vocab-tree", dict(depth=4, tree_topk=3, total_tokens=10), dict(draft_vocab="half")),
          Shape("flash", dict(head="flash", clusters=64, probes=1), dict(draft_vocab="half")),
          Shape("flash-tree", dict(depth=4, tree_topk=3, head="flash", clusters=64, probes=4, margin=2.0),
                dict(draft_vocab="half")))

def row_call(target, model: Eagle3Model, ids: torch.Tensor, context: int):
    """`ModelRole.call`: one drafter call for a frontier of n nodes at depth 1 after a `context`-token drafter cache
    (what a round's drafting calls are: `Eagle3Drafter._forward_nodes`)."""
    d = Eagle3Drafter(model, target, depth=4, tree_topk=1, total_tokens=8)
    d.reset(ids[: context + 1], target.forward(ids[:context], target.new_cache(), layers=d.layers).features)
    d.catch_up(ids[:0], None)

    def call(n: int) -> None:
        d._forward_nodes(ids[context : context + n], d.root_h.expand(n, -1), 1, None)
        d.cache.crop(d.known)
    return call


# stand down where drafting does not pay (`speclab.drafters.schedule.PaysRouter`), measured by `speclab grid` at T >
# 0: at T = 0.7 and 1 no value above 2 was faster on the zoo, AMD EPYC, 2026-12-02
PAYS = pays_params(0.0)

ENTRY = DrafterEntry(
    name="eagle3", label="EAGLE-3", color="#9467bd",
    train=TrainEntry("speclab.train.eagle3", "Eagle3TrainConfig", "train_eagle3", "EAGLE-3 online from the frozen "
                     "target (training-time test)", init_from="EAGLE-3 drafter"),
    costs=(CostBench("catchup", "catchup_costs", "EAGLE-3's catch-up after a backlog: KV-only prefill vs a full "
                     "forward", "backlogs", "--backlog", "1,2,4,8,16,32,64", 1, "backlog", ("kv_only_ms", "full_ms"),
                     "catch-up", "EAGLE-3 catch-up: KV-only prefill vs a full forward of the backlog",
                     "ms per catch-up after a {context}-token drafter cache (lower is better)", "backlog tokens"),),
    params=PARAMS + SAMPLING_PARAMS + PAYS + HEAD_PARAMS, check=_check, same_decode=head_same_decode(_same_decode),
    build=with_head(lambda target, model, **params: Eagle3Drafter(model, target, **params), "eagle3",
                    lambda model, target: model.lm_head.weight),
    methods={"eagle3": "EAGLE-3: one-layer drafter on the target's features; dynamic tree (depth, tree_topk, "
                       "total_tokens), a chain when tree_topk = 1"},
    model=ModelRole("eagle3", "--eagle", "EAGLE-3", "an EAGLE-3 drafter",
                    lambda path, target, paths: load_eagle3(path, target),
                    zoo="eagle3", card="data/zoo/eagle3/README.md",
                    help="EAGLE-3 drafter directory for eagle3 (public layout; default: the zoo's)",
                    random=lambda target, seed, **kw: random_eagle3(target, seed, **kw), call=row_call),
    shapes=SHAPES)


# ---- random drafters: `ModelRole.random` (the conformance suite's and the smoke tests' models, no files) ------------

def config_for(target, draft_vocab: int | None = None) -> Eagle3Config:
    """An EAGLE-3 config shaped for `target`: its width, heads, MLP and default layers, a draft vocabulary of
    `draft_vocab` tokens (None: the target's)."""
    c = target.config
    return Eagle3Config(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                        head_dim=c.head_dim, vocab_size=target.vocab_size,
                        draft_vocab_size=draft_vocab or target.vocab_size, target_hidden_size=c.hidden_size,
                        layer_ids=default_layer_ids(target.num_layers), rms_norm_eps=c.rms_norm_eps,
                        max_position_embeddings=c.max_position_embeddings)


def random_eagle3(target, seed: int, draft_vocab: int | str | None = None) -> Eagle3Model:
    """A random EAGLE-3 drafter for `target` (seeded), frozen, in its dtype and on its device. `draft_vocab` (a size,
    or "half": half the target's) keeps every other target id in a reduced vocabulary, mapped back by d2t / t2d."""
    if draft_vocab == "half":
        draft_vocab = target.vocab_size // 2
    n = int(draft_vocab) if draft_vocab else 0
    torch.manual_seed(seed)
    m = Eagle3Model(config_for(target, n or None))
    if n:
        keep = torch.arange(0, 2 * n, 2)
        m.d2t.copy_(keep - torch.arange(n))
        m.t2d.zero_()
        m.t2d[keep] = True
    return m.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
