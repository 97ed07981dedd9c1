"""Train a DFlash drafter (optionally with DSpark's Markov head) online from a frozen target.

No feature dump: every batch of corpus windows goes through the frozen target first (no grad), which gives the
context features of the chosen layers and its next-token distributions. Then, as DFlash trains:

- random anchors start the blocks: block j is [x_{a_j}, mask x (B - 1)] at positions a_j .. a_j + B - 1, and its
  row k predicts x_{a_j + k};
- each block attends to the context features of positions < a_j and, bidirectionally, to its own rows; never to
  another block (many blocks per window in one forward, one mask);
- the loss of row k is the cross-entropy against the target's distribution at position a_j + k - 1 (its top 32
  tokens and one bucket for the rest, `lm.topk_soft_ce`, or with `--loss-topk 0` its full distribution;
  distillation: the drafter learns what verification compares it with), weighted exp(-(k - 1) / gamma), plus
  `--loss-tv` times DSpark's L_tv (1 - sum min(p, q): trains for sampled decoding);
- the block size is drawn per step from 2..block_size, so every block size a user picks at decode time was seen.

With a Markov head the same backbone is trained on both readouts, the base logits U and U + W1[x_{k-1}] W2 (the
true previous token, teacher-forced): one drafter serves `dflash:markov=0` and `dflash:markov=1`, and the
measured gain of the head is the head's alone. `precision="bf16"` runs the target in bf16 and the drafter in bf16
autocast (`speclab.train.speed` measures both on the CPU at hand). The drafter's layers start as copies of the
target's first layers (same shapes), its norms at one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from speclab.drafters.dflash import (
    DFlashConfig,
    DFlashModel,
    default_layer_ids,
    load_dflash,
)
from speclab.metrics import implied_tau
from speclab.train import lm
from speclab.train.corpus import DOMAINS
from speclab.train.threads import own_threads


@dataclass
class DFlashTrainConfig(lm.OnlineSchedule):
    lr: float = field(default=1.5e-3, kw_only=True)
    target_dir: str
    corpus_dir: str
    out_dir: str
    layer_ids: tuple[int, ...] | None = None  # target decoder layers; None = default_layer_ids(target depth)
    num_layers: int = lm.option(  # DSpark: a 2-layer drafter with the Markov head beats a 5-layer DFlash
        2, "drafter depth (decoder layers)", lo=1, flag="--layers")
    block_size: int = lm.option(  # the largest block trained (and the config's default)
        16, "the largest block trained (each step draws its block size from 2..this)", lo=2, hi=64)
    markov_rank: int = lm.option(64, "rank of DSpark's Markov head (0: none)", lo=0)
    loss_topk: int = lm.option(  # 0: the target's full distribution; k: its k most likely tokens + a rest bucket
        32, "the loss against the target's k most likely tokens and a rest bucket (0: its full distribution)", lo=0)
    loss_tv: float = lm.loss_tv_option()
    gamma: float = 4.0  # loss weight exp(-(k - 1) / gamma) of block row k
    rows: int = 512  # block rows per window (anchors = rows // block size of the step; blocks may overlap)


def new_drafter(target, cfg: DFlashTrainConfig, mask_token_id: int) -> DFlashModel:
    tc = target.config
    L = tc.num_hidden_layers
    c = DFlashConfig(hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
                     num_hidden_layers=cfg.num_layers, num_attention_heads=tc.num_attention_heads,
                     num_key_value_heads=tc.num_key_value_heads,
                     head_dim=getattr(tc, "head_dim", None), vocab_size=tc.vocab_size,
                     target_layer_ids=tuple(cfg.layer_ids or default_layer_ids(L)), mask_token_id=mask_token_id,
                     block_size=cfg.block_size, num_target_layers=L, rms_norm_eps=tc.rms_norm_eps,
                     max_position_embeddings=tc.max_position_embeddings, markov_rank=cfg.markov_rank,
                     rope_theta=float((getattr(tc, "rope_parameters", None) or {}).get("rope_theta", 10000.0)))
    m = DFlashModel(c)
    layers = target.get_decoder().layers
    for i, layer in enumerate(m.layers):  # start from the target's first layers (same shapes, Qwen3 names)
        src = layers[min(i, len(layers) - 1)].state_dict()
        missing, _ = layer.load_state_dict({k: v for k, v in src.items() if k in layer.state_dict()}, strict=False)
        assert not missing, missing
    if m.has_markov:
        torch.nn.init.normal_(m.markov_w1.weight, std=1.0 / math.sqrt(cfg.markov_rank))
        torch.nn.init.zeros_(m.markov_w2.weight)  # the head starts as no bias: training starts from plain DFlash
    return m


def pick_blocks(T: int, size: int, rows: int, rng: np.random.Generator) -> torch.Tensor:
    """Sorted distinct anchors a (1 <= a <= T - size) for about rows // size blocks of `size` rows."""
    n = max(1, min(rows // size, T - size))
    return torch.from_numpy(np.sort(rng.choice(np.arange(1, T - size + 1), size=n, replace=False)))


def block_forward(m: DFlashModel, embed_w: torch.Tensor, head_w: torch.Tensor, ids: torch.Tensor, feats: torch.Tensor,
                  anchors: torch.Tensor, size: int, states: bool = False):
    """Base logits [Bw, nb, size - 1, V] of every block's mask rows, for windows ids [Bw, T] with the target's
    features [Bw, T, F] (row t: the feature of token t) and blocks of `size` rows at `anchors` [nb]; with `states`,
    (logits, the rows' final-norm states [Bw, nb, size - 1, H]) (DSpark's confidence head reads them)."""
    Bw, T = ids.shape
    nb = anchors.numel()
    c = m.config
    k_in = torch.arange(size)
    pos = (anchors[:, None] + k_in[None]).flatten()  # [nb * size]
    blk = ids[:, anchors][:, :, None].expand(Bw, nb, size).clone()
    blk[:, :, 1:] = c.mask_token_id
    x = F.embedding(blk.flatten(1), embed_w).float() * c.input_embedding_scale  # [Bw, R, H]
    cos, sin = m.rope(T + size, torch.float32)
    cq, sq = cos[pos][:, None], sin[pos][:, None]
    cc, sc = cos[:T, None], sin[:T, None]
    bid = torch.arange(nb).repeat_interleave(size)
    see_ctx = torch.arange(T)[None, :] < anchors[bid][:, None]  # [R, T]: context strictly before the anchor
    see_blk = bid[:, None] == bid[None, :]  # [R, R]: its own block, both ways
    mask = torch.cat([see_ctx, see_blk], 1)
    ctx = m.context(feats)
    for i in range(len(m.layers)):
        ck, cv = m.context_kv(i, ctx, cc, sc)
        q, k, v = m.block_qkv(i, x, cq, sq)
        o = F.scaled_dot_product_attention(q, torch.cat([ck, k], -2), torch.cat([cv, v], -2), attn_mask=mask,
                                           scale=c.head_dim ** -0.5,
                                           enable_gqa=c.num_attention_heads != c.num_key_value_heads)
        x = m.finish(i, x, o)
    h = m.norm(x.view(Bw, nb, size, -1)[:, :, 1:])
    logits = F.linear(h, head_w) * c.output_multiplier
    return (logits, h) if states else logits


def block_loss(m: DFlashModel, logits: torch.Tensor, ids: torch.Tensor, target_top: tuple,
               anchors: torch.Tensor, gamma: float, tv: float = 0.0) -> tuple[torch.Tensor, dict]:
    """(loss, metrics): weighted soft cross-entropy of the base logits (and of base + Markov bias when the head is
    there) against the target's distributions (`target_features`: log-probs over the vocabulary, or the top tokens
    and a rest bucket), plus `tv` times DSpark's L_tv (1 - sum min(p, q), `lm.acceptance`: the acceptance of a
    sampled draft token; over the top tokens, a lower bound); per-row accuracy, per-row sampling acceptance (`alpha`,
    the same sum) and the greedy acceptance length implied by the leading matches of each block (bonus included),
    for each readout."""
    size = logits.shape[2] + 1
    k = torch.arange(1, size)
    prev_pos = anchors[:, None] + k[None] - 1  # [nb, size - 1]: the position whose distribution row k must match
    first, idx = target_top[0][:, prev_pos], target_top[1]  # [Bw, nb, size - 1, top or V]
    if idx is None:  # the full distribution, from its log-probs
        p, top = first.exp(), first.argmax(-1)
    else:
        p, idx = first, idx[:, prev_pos]
        top = idx[..., 0]
    w = torch.exp(-(k - 1).float() / gamma)
    readouts = {"base": logits}
    if m.has_markov:
        readouts["markov"] = logits + m.markov_bias(ids[:, prev_pos])
    total, metrics = 0.0, {}
    for name, lg in readouts.items():
        lg = lg.float()
        ce = lm.soft_ce(lg, p, idx)  # [Bw, nb, size - 1]
        accept = lm.acceptance(lg if tv else lg.detach(), p, idx)  # [Bw, nb, size - 1]
        total = total + ((ce + tv * (1.0 - accept)) * w).sum(-1).mean() / w.sum()
        match = (lg.detach().argmax(-1) == top).float()
        metrics[name] = {"loss": float(ce.detach().mean()), "acc": match.mean((0, 1)).tolist(),
                         "alpha": accept.detach().mean((0, 1)).tolist(), "tau": implied_tau(match),
                         "tau_sampled": implied_tau(accept.detach())}
    return total, metrics


def target_features(target, ids: torch.Tensor, layer_ids, top: int = 32):
    """Context features (outputs of `layer_ids`: HF hidden_states[j + 1]) and the target's next-token distributions
    (`lm.target_dist`: its `top` most likely tokens and a rest bucket, a gather instead of a product over the
    vocabulary in the loss; 0: its log-probs over the vocabulary), no grad."""
    return lm.target_features(target, ids, [j + 1 for j in layer_ids], top)


def val_blocks(m, embed_w, head_w, target, data, cfg, states: bool = False):
    """Per domain, validation windows with blocks of the full size every `block_size` positions through the
    drafter: (domain, ids, the target's top tokens, anchors, `block_forward`'s output (with `states`: and the rows'
    states)). The validation of DFlash's training and of DSpark's head's."""
    size = cfg.block_size
    for d in DOMAINS:
        ids = lm.val_windows(data, d, cfg.eval_windows, cfg.seq_len)
        feats, top = target_features(target, ids, m.config.target_layer_ids)
        anchors = torch.arange(1, cfg.seq_len - size + 1, size)
        with lm.autocast(cfg.precision):
            out = block_forward(m, embed_w, head_w, ids, feats, anchors, size, states=states)
        yield d, ids, top, anchors, out


@torch.no_grad()
def evaluate(m, embed_w, head_w, target, data, cfg: DFlashTrainConfig) -> dict:
    """Per domain, on validation windows with blocks of the full size every `block_size` positions: per-readout
    loss, per-row accuracy and implied tau."""
    m.eval()
    res = {d: block_loss(m, logits, ids, top, anchors, cfg.gamma)[1]
           for d, ids, top, anchors, logits in val_blocks(m, embed_w, head_w, target, data, cfg)}
    m.train()
    return res


@own_threads
def train_dflash(cfg: DFlashTrainConfig, log=print) -> dict:
    tok, data, target, rng = lm.frozen_target_setup(cfg)
    mask_id = tok.convert_tokens_to_ids(tok.mask_token) if tok.mask_token else None
    if mask_id is None:
        raise ValueError(f"the tokenizer of {cfg.target_dir} has no mask token (DFlash drafts blocks of masks)")
    embed_w = target.get_input_embeddings().weight
    head_w = target.get_output_embeddings().weight
    m = load_dflash(cfg.init_from).float().requires_grad_(True) if cfg.init_from else new_drafter(target, cfg, mask_id)
    m.train()

    def step(_):
        ids = lm.sample_windows(data, cfg.domain_weights, cfg, rng)  # [B, seq_len + 1]
        feats, logp = target_features(target, ids, m.config.target_layer_ids, cfg.loss_topk)
        size = int(rng.integers(2, cfg.block_size + 1))
        anchors = pick_blocks(ids.shape[1], size, cfg.rows, rng)
        with lm.autocast(cfg.precision):
            logits = block_forward(m, embed_w, head_w, ids, feats, anchors, size)
        loss, metrics = block_loss(m, logits, ids, logp, anchors, cfg.gamma, cfg.loss_tv)
        last = metrics.get("markov", metrics["base"])
        return lm.Step(loss, ids.numel(), {"block": size, "metrics": metrics}, {"acc1": f"{last['acc'][0]:.2f}"})

    return lm.online_loop(
        "dflash", m, cfg, step, lambda: evaluate(m, embed_w, head_w, target, data, cfg),
        lambda val: "val tau (greedy/sampled, top-32 bound) " + " ".join(
            f"{d}={v[k]['tau']:.2f}/{v[k]['tau_sampled']:.2f}" for d, v in val.items() for k in v), log,
        f", {m.config.num_hidden_layers} layers, target layers {m.config.target_layer_ids}, blocks up to "
        f"{cfg.block_size}, markov rank {m.config.markov_rank}")


def val_table(val: dict) -> str:
    """Markdown: per domain and readout, the implied greedy tau of a full block and the accuracy of rows 1, 2, 4."""
    rows = ["| domain | readout | tau (full block) | acc row 1 | acc row 2 | acc row 4 | loss |",
            "|---|---|---|---|---|---|---|"]
    for d, v in val.items():
        for name, r in v.items():
            a = r["acc"]
            rows.append(f"| {d} | {name} | {r['tau']:.2f} | {a[0]:.3f} | {a[1]:.3f} | {a[min(3, len(a) - 1)]:.3f} | "
                        f"{r['loss']:.3f} |")
    return "\n".join(rows)


def curve_table(records: list[dict]) -> str:
    """Markdown: tokens seen, minutes and per domain the implied tau (base / markov) at each validation."""
    return lm.val_curve(records, lambda d: f"{d} tau (base / markov)",
                        lambda v: " / ".join(f"{x['tau']:.2f}" for x in v.values()))
