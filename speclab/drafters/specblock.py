"""SpecBlock (Shi et al. 2026, ../shared/papers/specblock.txt): a block-iterative drafter. One drafter call
produces a *block* of K dependent positions; the draft tree grows by further blocks started from chosen positions.

- **Block forward** (eq. 1-2). A block started at the last committed token x_t fuses the target's multi-layer
  feature (c_t = W_cond [h_low, h_mid, h_top]), the token's embedding and K learnable position queries q_k:
  h_k^(0) = W_fuse [norm(c_t), norm(embed(x_t)), norm(q_k)]. *Prefix broadcast*: c_t and embed(x_t) are the same
  for the K rows; only q_k differs. The rows pass jointly through L decoder layers (the target's layer design,
  Qwen3-style here) with causal attention inside the block and full attention to the drafter's cache of the
  committed prefix.
- **Layer-wise shift** (eq. 3). Before every decoder layer, row k's state is concatenated with row k-1's state and
  projected back with a per-layer W_shift (row 1 pairs with itself).
- **LM head and rank head** (eq. 4). The LM head gives the draft distribution p_k; the rank head reads the last
  layer's state and a 15-number summary psi(p_k) (both stop-gradient) and predicts the bucket of the target
  token's rank in p_k: 1, 2-4, 5-10, > 10 (`BUCKETS`).
- **Block-iterative tree** (Algorithm 2). At each position the bucket sets the branching width (`widths`, the
  paper's maps [2, 4, 10, 0] and [2, 4, 6, 4]): the top-w tokens of p_k hang below the block's path; width 0
  ends the path. The path is each row's top-1 token (the rows were trained on correct prefixes: the valid-prefix
  mask). Positions of bucket b0 (the drafter expects the target's token at rank 1) may start a later block: the
  deepest `starts` of them do, batched into one drafter call per block (M = `blocks` calls per round). A later
  block conditions on the drafter's own last-layer state at its start (bypassing W_cond) and on the start's
  token, and attends to the prefix and to its path's rows of earlier blocks (the paper's Figure 3).
- **Committed prefix**: every committed token has the K/V of its own block's first row (its "position-1 row":
  token x_j with the target's feature f_{j-1}, at position j - 1, as EAGLE-3 pairs them). Catch-up computes those
  rows for the backlog in one call; the last committed token is the next round's root and waits.

At T = 0 the tree is deterministic (top-w tokens; verification treats them as point masses). At T > 0 a position's
w tokens are drawn from its row's q instead (`draft_temp` times the target's temperature; `scheme`: without
replacement or i.i.d.; topk keeps the greedy tree), and a later block starts only from a node that has no children
in its own block, so every node's children come from one row, whose q verification uses.
Each node carries its block and bucket for the trace (`DraftTree.extra`).
Training (valid-prefix mask, rank head after a warm-up, cross-block cuts) is `speclab.train.specblock`; it uses
this module's `SpecBlockModel` pieces, so drafting and training compute the same function.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from speclab.checks import MAX_TREE_NODES, Bound
from speclab.core import native
from speclab.core.layers import DecoderLayer, Linear, causal_mask, rope_inv_freq, rope_tables
from speclab.core.lean import KVCache
from speclab.core.sampling import Sampling, draft_probs, draw
from speclab.core.target import forward_clock
from speclab.core.tree import DraftTree
from speclab.drafters.checkpoint import check_fits, load_strict, place, read_checkpoint, save_checkpoint
from speclab.drafters.flashhead import HEAD_PARAMS, head_same_decode, with_head
from speclab.drafters.registry import SAMPLING_PARAMS, DrafterEntry, ModelRole, Param, Shape, TrainEntry
from speclab.drafters.schedule import pays_params
from speclab.errors import InvalidInput, ModelNotFound

BUCKETS = ("rank 1", "rank 2-4", "rank 5-10", "rank > 10")  # b0..b3 (paper §3.3)
BUCKET_EDGES = (1, 4, 10)  # the highest rank of b0, b1, b2
PSI_DIM = 15  # top-10 log-probs, logit gaps to ranks 2, 3, 5, top probability, entropy (paper Appendix B)


def bucket_of_rank(rank: torch.Tensor) -> torch.Tensor:
    """Bucket (0..3) of 1-based ranks: 1 -> b0, 2-4 -> b1, 5-10 -> b2, > 10 -> b3."""
    return torch.bucketize(rank, torch.tensor(BUCKET_EDGES, device=rank.device), right=False)


def rank_of(logits: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """1-based rank of `token` [..] in each row of logits [.., V] (ties counted in the token's favour)."""
    own = logits.gather(-1, token[..., None])
    return (logits > own).sum(-1) + 1


def psi(logits: torch.Tensor) -> torch.Tensor:
    """The 15-number summary of draft distributions [.., V] -> [.., 15]: the top-10 log-probabilities, the logit
    gaps from the top token to ranks 2, 3 and 5, the top probability and the entropy."""
    logits = logits.float()
    if logits.shape[-1] < 10:  # a tiny vocabulary: the missing ranks as impossible tokens
        logits = F.pad(logits, (0, 10 - logits.shape[-1]), value=-1e4)
    logp = torch.log_softmax(logits, -1)
    top = logits.topk(10, -1)  # logp's top 10 too (the same order; one top-k over the vocabulary, not two)
    top_logp = logp.gather(-1, top.indices).clamp(min=-1e4)  # a FlashHead row: -inf beyond its candidates
    gaps = (top.values[..., :1] - top.values[..., [1, 2, 4]]).clamp(max=1e4)
    p = logp.exp()
    entropy = -torch.where(p > 0, p * logp, 0.0).sum(-1, keepdim=True)
    return torch.cat([top_logp, gaps, top_logp[..., :1].exp(), entropy], -1)


@dataclass
class SpecBlockConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    target_hidden_size: int
    target_layers: tuple[int, ...]  # speclab's convention: the output of decoder layer j (low, mid, top)
    block_size: int = 4  # K, fixed at training
    layer_shift: bool = True  # False: the ablation without W_shift
    rank_hidden: int = 128
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        self.target_layers = tuple(int(j) for j in self.target_layers)
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(d.pop("extra"))
        d["target_layers"] = list(self.target_layers)
        return {"architectures": ["SpecBlockDrafter"], "model_type": "specblock", **d}

    @classmethod
    def from_dict(cls, d: dict) -> SpecBlockConfig:
        known = set(cls.__dataclass_fields__) - {"extra"}
        return cls(**{k: v for k, v in d.items() if k in known},
                   extra={k: v for k, v in d.items() if k not in known and k not in ("architectures", "model_type")})


class SpecBlockModel(nn.Module):
    """The drafter's weights and the pieces of its forward (drafting and training share them). The token
    embedding is the target's (frozen, not stored)."""

    def __init__(self, config: SpecBlockConfig):
        super().__init__()
        c = self.config = config
        H = c.hidden_size
        self.cond = Linear(len(c.target_layers) * c.target_hidden_size, H, bias=False)  # W_cond
        self.cond_norm, self.embed_norm, self.query_norm = (nn.RMSNorm(H, eps=c.rms_norm_eps) for _ in range(3))
        self.queries = nn.Parameter(torch.randn(c.block_size, H) * 0.02)  # q_1..q_K
        self.fuse = Linear(3 * H, H, bias=False)  # W_fuse
        self.layers = nn.ModuleList(DecoderLayer(H, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads,
                                                 c.head_dim, c.rms_norm_eps) for _ in range(c.num_hidden_layers))
        if c.layer_shift:  # W_shift per layer, starting as the identity on row k's own state
            self.shift = nn.ModuleList(Linear(2 * H, H, bias=False) for _ in range(c.num_hidden_layers))
            for s in self.shift:
                with torch.no_grad():
                    s.weight.normal_(0.0, 0.02).narrow(1, 0, H).add_(torch.eye(H))
        self.norm = nn.RMSNorm(H, eps=c.rms_norm_eps)
        self.lm_head = Linear(H, c.vocab_size, bias=False)
        self.rank_head = nn.Sequential(Linear(H + PSI_DIM, c.rank_hidden), nn.GELU(),
                                       Linear(c.rank_hidden, len(BUCKETS)))
        self.inv_freq, self.rope_scale = rope_inv_freq(c)  # fp32 on CPU, not a buffer: `.to(bf16)` leaves it

    # -- the forward, in pieces -------------------------------------------------------------------------------
    def inputs(self, cond: torch.Tensor, emb: torch.Tensor, k: torch.Tensor | slice) -> torch.Tensor:
        """Rows' first states W_fuse [norm(c), norm(embed(x)), norm(q_k)]: cond, emb [.., H] broadcast over the
        rows' position queries `k` (prefix broadcast) -> [.., len(k), H]."""
        q = self.query_norm(self.queries[k])
        lead = torch.broadcast_shapes(cond.shape[:-1], emb.shape[:-1])
        c = self.cond_norm(cond).expand(*lead, -1)[..., None, :].expand(*lead, q.shape[0], -1)
        e = self.embed_norm(emb).expand(*lead, -1)[..., None, :].expand(*lead, q.shape[0], -1)
        return self.fuse(torch.cat([c, e, q.expand(*lead, -1, -1)], -1))

    def shifted(self, i: int, x: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Layer i's input: W_shift^(i) [x_k, x_{k-1}] (`prev`: the rows' predecessors; a block's first row
        passes itself); x itself without the shift."""
        return self.shift[i](torch.cat([x, prev], -1)) if self.config.layer_shift else x

    def qkv(self, i: int, x: torch.Tensor, cos, sin):
        """Layer i's queries [.., heads, n, D] and keys, values [.., kv_heads, n, D] of rows x [.., n, H] (the
        target's layer design: `speclab.core.layers.DecoderLayer`)."""
        return self.layers[i].qkv(x, cos, sin)

    def finish(self, i: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The rest of layer i (`speclab.core.layers.Layer.finish`)."""
        return self.layers[i].finish(x, attn)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))

    def rank_logits(self, h: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The rank head's bucket logits [.., 4] from sg(h^(L)) and sg(psi(p))."""
        w = self.rank_head[0].weight
        return self.rank_head(torch.cat([h.detach().to(w.dtype), psi(logits.detach()).to(w.dtype)], -1))

    def rope(self, n: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(self.inv_freq.to(self.cond.weight.device), self.rope_scale, n, dtype)

    def save(self, out_dir: str | Path, dtype=torch.bfloat16, extra_files: dict[str, str] | None = None) -> None:
        """config.json + model.safetensors (speclab's layout: no public SpecBlock checkpoint exists)."""
        save_checkpoint(self, self.config.to_dict(), out_dir, dtype, extra_files)


def new_specblock(config, head_weight: torch.Tensor, *, hidden_layers: int = 2, block_size: int = 4,
                  layer_shift: bool = True, layer_ids: tuple[int, ...] | None = None,
                  rank_hidden: int = 128) -> SpecBlockModel:
    """A fresh drafter for a target (its transformers `config` and LM head weight [V, H]): the target's width,
    heads and MLP, `hidden_layers` decoder layers (the paper's L = 2), its low / mid / top layers as EAGLE-3
    picks them, the LM head starting as the target's."""
    from speclab.drafters.eagle3 import default_layer_ids
    ids = layer_ids or tuple(j - 1 for j in default_layer_ids(config.num_hidden_layers))
    c = SpecBlockConfig(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                        num_hidden_layers=hidden_layers, num_attention_heads=config.num_attention_heads,
                        num_key_value_heads=config.num_key_value_heads, vocab_size=head_weight.shape[0],
                        target_hidden_size=config.hidden_size, target_layers=ids, block_size=block_size,
                        head_dim=getattr(config, "head_dim", None), rms_norm_eps=config.rms_norm_eps,
                        max_position_embeddings=config.max_position_embeddings,
                        rope_theta=getattr(config, "rope_theta", 1e4), layer_shift=layer_shift,
                        rank_hidden=rank_hidden)
    m = SpecBlockModel(c)
    with torch.no_grad():
        m.lm_head.weight.copy_(head_weight.float())
    return m


def load_specblock(path: str | Path, target=None, device=None, dtype=None) -> SpecBlockModel:
    """A SpecBlock drafter from a directory with its config.json and model.safetensors; checked against `target`
    when given (vocabulary, feature width, layer ids); a missing or unexpected weight is refused by name."""
    p, raw, sd = read_checkpoint(path, "SpecBlock drafter")
    if raw.get("model_type") != "specblock":
        raise ModelNotFound(f"{p / 'config.json'} is not a SpecBlock drafter's (model_type "
                            f"{raw.get('model_type')!r}, not 'specblock')")
    try:
        cfg = SpecBlockConfig.from_dict(raw)
    except (KeyError, ValueError, TypeError) as e:
        raise ModelNotFound(f"{p / 'config.json'} is not a SpecBlock config ({type(e).__name__}: {e})") from e
    model = SpecBlockModel(cfg)
    load_strict(model, sd, p, "SpecBlock drafter")
    if target is not None:
        check_fits("SpecBlock drafter", p, target, cfg.vocab_size, cfg.target_hidden_size, "features")
        bad = [j for j in cfg.target_layers if not 0 <= j < target.num_layers]
        if bad:
            raise ModelNotFound(f"the SpecBlock drafter in {p} reads target layers {list(cfg.target_layers)}, but "
                                f"the target has {target.num_layers}")
    return place(model, path, target, device, dtype)


@dataclass
class _Start:
    """A block's start: its condition (c_t, or the drafter's own last-layer state), token, the tree node it hangs
    below (-1: the root), that node's depth, and the cache slots of its path's earlier draft rows."""
    cond: torch.Tensor  # [H]
    token: int
    node: int
    depth: int
    path: list[int]


class SpecBlockDrafter:
    """The SpecBlock drafter behind speclab's drafter protocol (speclab/core/protocol.py)."""
    name = "specblock"
    flash = None  # a FlashHead (speclab.drafters.flashhead), or None: the dense LM head

    def __init__(self, model: SpecBlockModel, target, *, blocks: int, starts: int, width_b0: int, width_b1: int,
                 width_b2: int, width_b3: int, rank: int, total_tokens: int, draft_temp: float = 1.0,
                 scheme: str = "wor"):
        self.m, self.target = model, target
        self.draft_temp, self.scheme = draft_temp, scheme
        self.blocks, self.starts, self.rank, self.total_tokens = blocks, starts, bool(rank), total_tokens
        self.widths = torch.tensor([width_b0, width_b1, width_b2, width_b3])
        c = model.config
        self.K, self.layers = c.block_size, c.target_layers
        self.H, self.KV, self.D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.scale = self.D ** -0.5
        self.device, self.dtype = model.cond.weight.device, model.cond.weight.dtype
        self.cos, self.sin = model.rope(max(c.max_position_embeddings, target.max_context) + self.K * blocks + 1,
                                        self.dtype)
        self.cache: KVCache | None = None
        self.known = 0  # committed tokens whose position-1 rows are in the cache (all but the root)
        self.pending_ids = self.pending_feats = None  # the backlog, ending with the root (the last committed token)
        # what serving-time adaptation reads (speclab.adaptation): every committed token and feature seen, and per
        # tree node (-1: the root) the draft distribution of the row that drafted its children, this round
        self.seen_ids: list[torch.Tensor] = []
        self.seen_feats: list[torch.Tensor] = []
        self.row_probs: dict[int, torch.Tensor] = {}

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.target.embed(ids.to(self.device)).to(self.dtype)

    def _rope(self, pos: torch.Tensor):
        return self.cos[pos][:, None], self.sin[pos][:, None]  # [n, 1, D]

    # -- protocol -------------------------------------------------------------------------------------------------
    def reset(self, prompt_ids: torch.Tensor, prompt_features: torch.Tensor | None,
              capacity: int | None = None) -> None:
        """`capacity` (committed tokens; None: grow on demand): the cache is sized once for the committed rows (all
        but the root) and the largest draft: a first block, then up to `starts` blocks per further block."""
        room = self.K * (1 + (self.blocks - 1) * self.starts)
        self.cache = KVCache(self.m.config.num_hidden_layers, self.KV, self.D, self.dtype, self.device,
                             None if capacity is None else capacity + room)
        self.known = 0
        self.seen_ids = [prompt_ids.cpu()]
        self.seen_feats = [prompt_features] if prompt_features is not None else []
        self.pending_ids = prompt_ids[1:].to(self.device)
        self.pending_feats = prompt_features.to(self.dtype) if prompt_features is not None else \
            torch.zeros(0, len(self.layers) * self.m.config.target_hidden_size, device=self.device, dtype=self.dtype)

    @torch.inference_mode()
    def catch_up(self, ids: torch.Tensor, features: torch.Tensor | None) -> None:
        """The backlog (token x_j with the target's feature f_{j-1}) into the cache as position-1 rows, all but
        the last (the next round's root), in one call through every layer (causal among themselves)."""
        if ids.numel():
            self.seen_ids.append(ids.cpu())
            self.seen_feats.append(features)
            self.pending_ids = torch.cat([self.pending_ids, ids.to(self.device)])
            self.pending_feats = torch.cat([self.pending_feats, features.to(self.dtype)])
        m = self.pending_ids.numel() - 1
        if m <= 0:
            return
        with forward_clock:  # a drafter forward: counted in the model-call share like the target's
            x = self.m.inputs(self.m.cond(self.pending_feats[:m]), self._embed(self.pending_ids[:m]), slice(0, 1))
            x = x[:, 0]  # [m, H]: each token's first row
            start, end = self.known, self.known + m
            cos, sin = self._rope(torch.arange(start, end, device=self.device))
            mask = causal_mask(m, end, self.device)
            self.cache.reserve(m)
            for i in range(len(self.m.layers)):
                x = self._layer(i, self.m.shifted(i, x, x), cos, sin, start, mask)
            self.cache.length = end
        self.known = end
        self.pending_ids, self.pending_feats = self.pending_ids[m:], self.pending_feats[m:]

    def block_forward(self, starts: list[_Start]):
        """One drafter call for every start's block, batched: rows [S*K] appended to the cache after the committed
        prefix (and earlier draft rows). Each row attends to the prefix, its start's path of earlier draft rows
        and its own block causally. Returns the rows' last-layer states [S, K, H], logits [S, K, V] (float32),
        buckets [S, K] and the rows' first cache slot."""
        K, S = self.K, len(starts)
        cond = torch.stack([s.cond for s in starts])  # [S, H]
        x = self.m.inputs(cond, self._embed(torch.tensor([s.token for s in starts])), slice(0, K))  # [S, K, H]
        slot0 = self.cache.length - self.known  # draft rows so far
        start, end = self.cache.length, self.cache.length + S * K
        base = self.known + torch.tensor([s.depth for s in starts], device=self.device)  # the start's position
        pos = (base[:, None] + torch.arange(K, device=self.device)).flatten()
        cos, sin = self._rope(pos)
        mask = torch.zeros(S * K, end, dtype=torch.bool, device=self.device)
        mask[:, : self.known] = True
        own = torch.ones(K, K, dtype=torch.bool, device=self.device).tril()
        for j, s in enumerate(starts):
            rows = slice(j * K, (j + 1) * K)
            if s.path:
                mask[rows, torch.tensor(s.path, device=self.device) + self.known] = True
            mask[rows, start + j * K: start + (j + 1) * K] = own
        self.cache.reserve(S * K)
        for i in range(len(self.m.layers)):
            prev = torch.cat([x[:, :1], x[:, :-1]], 1)  # row k-1 of the same block (row 1: itself)
            x = self._layer(i, self.m.shifted(i, x, prev).flatten(0, 1), cos, sin, start, mask).unflatten(0, (S, K))
        self.cache.length = end
        logits = self.flash(self.m.norm(x)) if self.flash is not None else self.m.logits(x).float()
        buckets = self.m.rank_logits(x, logits).argmax(-1) if self.rank else torch.zeros(S, K, dtype=torch.long)
        return x, logits, buckets.cpu(), slot0

    def _layer(self, i: int, x: torch.Tensor, cos, sin, start: int, mask: torch.Tensor) -> torch.Tensor:
        """Decoder layer i over rows x [n, H] (its input, after the shift): their keys and values written at cache
        slots start.., their queries attending over slots [0, start + n) under `mask` [n, start + n]. The same ops
        from C++ where the rows run natively (`native.decoder_layer`, as DFlash's block), else the model's pieces."""
        L, n = self.m.layers[i], x.shape[0]
        if native.active(x):
            return native.decoder_layer(L, i, native.rms(L.input_layernorm, x), x, cos, sin, [self.cache], [start],
                                        [n], [mask], self.scale)
        q, k, v = self.m.qkv(i, x, cos, sin)
        self.cache.write(i, start, k, v)
        return self.m.finish(i, x, self.cache.attend(i, q, start + n, mask, self.scale))

    @torch.inference_mode()
    def propose(self, max_depth: int, sampling: Sampling, generator: torch.Generator | None = None) -> DraftTree:
        if max_depth <= 0 or self.pending_ids is None or self.pending_ids.numel() != 1:
            return DraftTree.empty(self.device)
        root = _Start(self.m.cond(self.pending_feats[-1]), int(self.pending_ids[-1]), -1, 0, [])
        drawn = not sampling.greedy and self.scheme != "topk"
        tokens, parents, probs, block_of, bucket_of, cands = [], [], [], [], [], []
        self.row_probs = {}
        starts, budget = [root], min(self.total_tokens, MAX_TREE_NODES)
        widths = self.widths.tolist()
        with forward_clock:
            for b in range(self.blocks):
                if not starts or budget <= 0:
                    break
                h, logits, buckets, slot0 = self.block_forward(starts)
                rows_cands = self.flash.last_candidates if self.flash is not None else None  # [S, K, C]
                p = draft_probs(logits, sampling, self.draft_temp) if drawn else torch.softmax(logits, -1)
                buckets = buckets.tolist()
                if not drawn:  # every row's widest top-w at once, in one call and one copy to Python
                    t = p.topk(min(max(widths), budget, p.shape[-1]), -1)
                    top_ids, top_p = t.indices.tolist(), t.values.tolist()
                chains = []  # (depth, node, cond, token, path) of the path's nodes that may start a block
                for j, s in enumerate(starts):
                    parent, depth, path = s.node, s.depth, list(s.path)
                    for k in range(self.K):
                        w = min(widths[buckets[j][k]] if self.rank else widths[0], budget)
                        if w <= 0 or depth >= max_depth:
                            break
                        if drawn:  # w children drawn from the row's q, in the order drawn
                            ids = draw(p[j, k][None], w, self.scheme, generator)[0]
                            ids = ids[ids >= 0]
                            top = ids.tolist(), p[j, k][ids].tolist()
                            if chains and chains[-1][1] == parent:  # its children come from this row alone
                                chains.pop()
                        else:
                            top = top_ids[j][k][:w], top_p[j][k][:w]
                        self.row_probs.setdefault(parent, p[j, k])
                        first = len(tokens)
                        for tok, q in zip(*top):
                            tokens.append(tok), parents.append(parent), probs.append(q)
                            block_of.append(b), bucket_of.append(buckets[j][k] if self.rank else -1)
                            if rows_cands is not None:
                                cands.append(rows_cands[j, k])
                        budget -= len(top[0])
                        parent, depth = first, depth + 1
                        path = path + [slot0 + j * self.K + k]
                        if not self.rank or buckets[j][k] == 0:
                            chains.append((depth, first, h[j, k], tokens[first], path))
                chains.sort(key=lambda c: -c[0])
                starts = [_Start(c[2], c[3], c[1], c[0], c[4]) for c in chains[: self.starts]]
        if not tokens:
            return DraftTree.empty(self.device)
        tree = DraftTree(torch.tensor(tokens, device=self.device), torch.tensor(parents, device=self.device),
                         torch.tensor(probs, device=self.device),
                         extra={"block": torch.tensor(block_of), "bucket": torch.tensor(bucket_of)},
                         cands=torch.stack(cands) if cands else None)
        if drawn:  # each node's children came from one row: its q
            tree.draft_dists = torch.zeros(len(tokens) + 1, logits.shape[-1], device=self.device)
            for node, q in self.row_probs.items():
                tree.draft_dists[node + 1] = q
            tree.scheme = self.scheme
        return tree

    def history(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every committed token seen so far [n] and the target's features f_0..f_{n-2} [n-1, F] (x_j pairs with
        f_{j-1}): what `speclab.train.specblock.block_forward` trains on, without another target forward."""
        return torch.cat(self.seen_ids), torch.cat([f.to(self.dtype) for f in self.seen_feats])

    def commit(self, tree: DraftTree, accepted: torch.Tensor) -> None:
        """Draft rows are dropped: the accepted tokens come back through catch_up with the target's features."""
        self.cache.crop(self.known)


def _check(params: dict, target) -> None:
    if all(params[f"width_b{i}"] == 0 for i in range(len(BUCKETS))):
        raise InvalidInput("specblock: every width_b* is 0, so no position would get a draft token")


def _same_decode(params: dict) -> dict:
    """Without the rank head every position gets width_b0: the other widths do not change the decode."""
    if params.get("rank") == 0:
        return {**params, **{f"width_b{i}": 0 for i in range(1, len(BUCKETS))}}
    return params


WIDTH_HELP = "draft tokens at a position whose rank-head bucket is"
# CPU defaults picked by `speclab grid` on the zoo in the default dtype (data/zoo/specblock/README.md has the
# table): one block of K, width 2 at ranks 1-4 and 1 beyond (ending a path at rank > 10 cost more than it saved);
# the GPU presets are the paper's (M 2, widths [2, 4, 10, 0], 60 nodes)
PARAMS = (Param("blocks", 1, lambda t: Bound(1, 64), gpu=2, grid=(1, 2, 3), help="M: drafter calls (blocks) per round"),
          Param("starts", 1, lambda t: Bound(1, 64), gpu=2,
                help="most later blocks started per block (from the deepest rank-1 positions)"),
          Param("width_b0", 2, lambda t: Bound(0, 64), gpu=2, help=f"{WIDTH_HELP} b0 (rank 1)"),
          Param("width_b1", 2, lambda t: Bound(0, 64), gpu=4, help=f"{WIDTH_HELP} b1 (rank 2-4)"),
          Param("width_b2", 1, lambda t: Bound(0, 64), gpu=10, help=f"{WIDTH_HELP} b2 (rank 5-10)"),
          Param("width_b3", 1, lambda t: Bound(0, 64), gpu=0, help=f"{WIDTH_HELP} b3 (rank > 10; 0 = end the path)"),
          Param("rank", 1, lambda t: Bound(0, 1),
                help="1 = rank-guided widths and starts; 0 = a uniform tree (width_b0 everywhere, the ablation)"),
          Param("total_tokens", 16, lambda t: Bound(1, min(MAX_TREE_NODES, t.max_context)), gpu=60,
                help="draft nodes at most"))

# the shapes the conformance suite checks for this drafter (tests/test_conformance.py: greedy equals AR, sampling
# keeps the target's distribution, catch-up, reset), each with the random model `ModelRole.random` builds
_PAPER = dict(blocks=2, starts=2, width_b0=2, width_b1=4, width_b2=10, width_b3=0, rank=1, total_tokens=60)
SHAPES = (Shape("chain", dict(blocks=1, starts=1, width_b0=1, width_b1=1, width_b2=1, width_b3=1, rank=1,
                              total_tokens=16)),
          Shape("tree", dict(blocks=3, starts=1, width_b0=2, width_b1=4, width_b2=6, width_b3=4, rank=1,
                             total_tokens=24)),  # three blocks, the fallback widths
          Shape("tree-paper", _PAPER),  # the paper's widths, two blocks
          Shape("uniform-tree", dict(blocks=2, starts=2, width_b0=2, width_b1=0, width_b2=0, width_b3=0, rank=0,
                                     total_tokens=20)),  # no rank head: the ablation
          Shape("block-3", {**_PAPER, "blocks": 3}, dict(block_size=3)),  # another K
          Shape("flash", dict(blocks=2, head="flash", clusters=64, probes=1)),
          Shape("flash-adaptive", dict(blocks=2, head="flash", clusters=64, probes=4, margin=2.0)))

def row_call(target, model: SpecBlockModel, ids: torch.Tensor, context: int):
    """`ModelRole.call`: one drafter call of n rows after a `context`-token drafter cache: n / K blocks from the root
    (`SpecBlockDrafter.block_forward`, batched as further blocks are); False where K does not divide n."""
    d = SpecBlockDrafter(model, target, **{p.name: p.default for p in PARAMS})
    d.reset(ids[: context + 1], target.forward(ids[:context], target.new_cache(), layers=d.layers).features)
    d.catch_up(ids[:0], None)
    root = _Start(model.cond(d.pending_feats[-1]), int(d.pending_ids[-1]), -1, 0, [])

    def call(n: int) -> bool | None:
        if n % d.K:
            return False
        d.block_forward([root] * (n // d.K))
        d.cache.crop(d.known)
        return None
    return call


# stand down where drafting does not pay (`speclab.drafters.schedule.PaysRouter`), measured by `speclab grid` at T >
# 0: its rounds bring about 2 tokens at T > 0 for the cost of 5 or 6 plain steps: 0.48x AR at T = 1 without it,
# 0.80-0.83x with 3-4, zoo, AMD EPYC, 2026-12-02
PAYS = pays_params(4.0, probe=128)

ENTRY = DrafterEntry(
    name="specblock", label="SpecBlock", color="#8c6d31",
    train=TrainEntry("speclab.train.specblock", "SpecBlockTrainConfig", "train_specblock", "SpecBlock online from "
                     "the frozen target (blocks of K, rank head)", init_from="SpecBlock drafter"),
    build=with_head(lambda target, model, **params: SpecBlockDrafter(model, target, **params), "specblock",
                    lambda model, target: model.lm_head.weight),
    params=PARAMS + SAMPLING_PARAMS + PAYS + HEAD_PARAMS, check=_check, same_decode=head_same_decode(_same_decode),
    methods={"specblock": "SpecBlock: blocks of K dependent positions per drafter call (layer-wise shift); the "
                          "rank head sets each position's width (width_b0..b3) and which positions start the "
                          "next of `blocks` blocks"},
    model=ModelRole("specblock", "--specblock", "SpecBlock", "a SpecBlock drafter",
                    lambda path, target, paths: load_specblock(path, target), zoo="specblock",
                    card="data/zoo/specblock/README.md",
                    help="SpecBlock drafter directory for specblock (default: the zoo's)",
                    random=lambda target, seed, **kw: random_specblock(target, seed, **kw), call=row_call),
    shapes=SHAPES)


# ---- random drafters: `ModelRole.random` (the conformance suite's and the smoke tests' models, no files) ------------

def random_specblock(target, seed: int, **kw) -> SpecBlockModel:
    """A random SpecBlock drafter for `target` (seeded; `kw`: `new_specblock`'s, e.g. block_size), in its dtype and
    on its device: its LM head the target's, so it agrees with the target now and then, and a rank head that reads
    the hidden state only, with a lean to b0: buckets of every kind, and rank-1 positions that start later blocks."""
    torch.manual_seed(seed)
    m = new_specblock(target.config, target.head_weight, **kw)
    H = m.config.hidden_size
    with torch.no_grad():
        m.rank_head[0].weight.normal_(0, 1.0)
        m.rank_head[0].weight[:, H:] = 0
        m.rank_head[0].bias.zero_()
        m.rank_head[2].weight.normal_(0, 1.0)
        m.rank_head[2].bias.copy_(torch.tensor([3.0, 0, 0, 0]))
    return m.to(device=target.device, dtype=target.dtype).eval()
