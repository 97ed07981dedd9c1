"""Training a SpecBlock drafter (`speclab train specblock`) online from the frozen target, on its regenerated
outputs (paper §3.3):

- **Blocks everywhere.** A window's tokens x_1..x_N each get their position-1 row (token x_j with the target's
  feature f_{j-1}: the committed prefix as drafting caches it); at `block_frac` of the positions (anchors) a block
  of K rows predicts x_{j+1}..x_{j+K}, attending to the prefix rows up to j and causally within the block.
- **Cross-block.** Per anchor a cut s is drawn from 1..K; a second block conditions on the first block's
  last-layer state at s (bypassing W_cond), takes x_{j+s} as its token and predicts x_{j+s+1}..; it attends to
  the prefix, the first block's rows up to s and itself: what a later block sees when drafting.
- **Valid-prefix mask** (eq. 5-6). A row's loss counts only while every earlier row on its path predicted the
  target's token (argmax); the second block starts with the first block's mask at s. Each position's loss is
  the cross-entropy against the target's distribution (its top tokens plus a rest bucket), averaged over the
  rows the mask admits.
- **Rank head.** Cross-entropy against the bucket of the target token's rank in the row's draft distribution,
  masked the same way, switched on after `rank_warmup` steps (the paper's 2,000 of its much longer run).

`block_forward` is the drafting forward written for many blocks at once (the same `SpecBlockModel` pieces; a
test checks it against `SpecBlockDrafter` row for row). The ablations are switches: `layer_shift=False` (the
model), `valid_prefix=False` (the loss).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from speclab.drafters.specblock import BUCKETS, SpecBlockModel, bucket_of_rank, load_specblock, rank_of
from speclab.metrics import implied_tau
from speclab.train import lm
from speclab.train.corpus import DOMAINS
from speclab.train.threads import own_threads


@dataclass(kw_only=True)
class SpecBlockTrainConfig(lm.OnlineSchedule):
    target_dir: str
    corpus_dir: str
    out_dir: str
    lr: float = 1e-3  # the zoo recipe's peak
    block_size: int = lm.option(4, "K, the positions of one block (fixed for the drafter's life)", lo=2, hi=64)
    hidden_layers: int = lm.option(2, "L, the drafter's depth (decoder layers)", lo=1, flag="--layers")
    layer_shift: bool = lm.option(True, "no layer-wise shift (the ablation without W_shift)", flag="--no-shift")
    valid_prefix: bool = lm.option(True, "supervise every row, not only those after a right prefix (the ablation)",
                                   flag="--no-valid-prefix")
    block_frac: float = 0.25  # share of positions that start a (first) block
    rank_warmup: int = lm.option(300, "steps before the rank head's loss is switched on", lo=0)
    loss_topk: int = lm.option(  # lm.topk_soft_ce
        32, "the target's distribution by its k most likely tokens + a bucket for the rest (0: all of it)", lo=0)


def target_features(target, ids: torch.Tensor, layers, topk: int):
    """The drafter's features [B, N, F] (speclab layers j = hidden_states[j + 1]) and the target's next-token
    distributions by their top tokens (probabilities, ids) [B, N, k]."""
    return lm.target_features(target, ids, [j + 1 for j in layers], topk)


def _attend(q, keys: list, values: list, masks: list, scale: float):
    """Attention of queries q [.., h, n, D] over several key groups (each [.., kv, m_i, D] broadcast to q's
    leading dims, with a mask [.., n, m_i] or None), one softmax over all of them (GQA: kv heads repeated)."""
    h = q.shape[-3]
    scores, vs = [], []
    for k, v, mask in zip(keys, values, masks):
        rep = h // k.shape[-3]
        k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
        s = torch.matmul(q, k.transpose(-1, -2)) * scale
        if mask is not None:
            s = s.masked_fill(~mask.unsqueeze(-3), float("-inf"))
        scores.append(s)
        vs.append(v)
    p = torch.softmax(torch.cat(scores, -1), -1)
    out, at = 0, 0
    for s, v in zip(scores, vs):
        out = out + torch.matmul(p[..., at: at + s.shape[-1]], v)
        at += s.shape[-1]
    return out


def block_forward(m: SpecBlockModel, embed_w: torch.Tensor, ids: torch.Tensor, feats: torch.Tensor,
                  anchors: torch.Tensor, cuts: torch.Tensor):
    """The drafting forward for many blocks of one batch of windows.

    ids [B, N], feats [B, N, F] (f_j at position j). Prefix rows: token x_j with f_{j-1} for j = 1..N-1 (row r = j-1
    at position r). anchors [B, A]: the prefix row r whose token starts a first block (its rows k = 1..K at
    positions r..r+K-1; k = 1 is the prefix row itself). cuts [B, A] in 1..K: the first block's row s whose state,
    with the token it predicts (x_{r+1+s}), starts the second block (positions r+s..). -> the first block's
    last-layer states and logits, then the second's: [B, A, K, H], [B, A, K, V] each; and every prefix row's
    logits [B, P, V] (each is a block's first row: the loss of position 1 uses all of them)."""
    c, K = m.config, m.config.block_size
    B, N = ids.shape
    P, A = N - 1, anchors.shape[1]
    dev = ids.device
    scale = c.head_dim ** -0.5
    emb = F.embedding(ids, embed_w).to(m.cond.weight.dtype)  # [B, N, H]
    bi, ai = torch.arange(B, device=dev)[:, None], torch.arange(A, device=dev)[None]
    cos, sin = m.rope(P + 2 * K, m.cond.weight.dtype)

    def rope(pos):  # tables broadcast over heads: [.., n, 1, D]
        return cos[pos][..., None, :], sin[pos][..., None, :]

    see_p = torch.arange(P, device=dev)[None, None, None, :] <= anchors[..., None, None]  # [B, A, 1, P]
    causal = torch.ones(K, K, dtype=torch.bool, device=dev).tril()
    # the prefix rows and every first block, layer by layer (a block's row 1 is its prefix row)
    xp = m.inputs(m.cond(feats[:, :-1]), emb[:, 1:], slice(0, 1))[:, :, 0]  # [B, P, H]
    x1 = m.inputs(m.cond(feats[bi, anchors]), emb[bi, anchors + 1], slice(1, K))  # [B, A, K-1, H]
    pos1 = anchors[..., None] + torch.arange(1, K, device=dev)
    kv1 = []  # per layer: the prefix's and the first blocks' keys and values (the second block reads them)
    for i in range(len(m.layers)):
        xp_in = m.shifted(i, xp, xp)
        x1_in = m.shifted(i, x1, torch.cat([xp[bi, anchors][:, :, None], x1[:, :, :-1]], 2))
        qp, kp, vp = m.qkv(i, xp_in, *rope(torch.arange(P, device=dev)))  # [B, h | kv, P, D]
        q1, k1, v1 = m.qkv(i, x1_in, *rope(pos1))  # [B, A, h | kv, K-1, D]
        kp_a, vp_a = kp[:, None], vp[:, None]  # broadcast over anchors
        op = _attend(qp, [kp], [vp], [torch.ones(P, P, dtype=torch.bool, device=dev).tril()], scale)
        o1 = _attend(q1, [kp_a, k1], [vp_a, v1], [see_p, causal[1:, 1:]], scale)
        xp, x1 = m.finish(i, xp_in, op), m.finish(i, x1_in, o1)
        kv1.append((kp_a, vp_a, k1, v1))
    h1 = torch.cat([xp[bi, anchors][:, :, None], x1], 2)  # [B, A, K, H]
    # the second blocks: the first block's state at the cut and the token its row s predicts
    x2 = m.inputs(h1[bi, ai, cuts - 1], emb[bi, (anchors + 1 + cuts).clamp(max=N - 1)], slice(0, K))
    pos2 = anchors[..., None] + cuts[..., None] + torch.arange(K, device=dev)
    on_path = (torch.arange(2, K + 1, device=dev)[None, None, :] <= cuts[..., None])[:, :, None]  # rows 2..s
    for i in range(len(m.layers)):
        x2_in = m.shifted(i, x2, torch.cat([x2[:, :, :1], x2[:, :, :-1]], 2))
        q2, k2, v2 = m.qkv(i, x2_in, *rope(pos2))
        kp_a, vp_a, k1, v1 = kv1[i]
        o2 = _attend(q2, [kp_a, k1, k2], [vp_a, v1, v2], [see_p, on_path, causal], scale)
        x2 = m.finish(i, x2_in, o2)
    return h1, m.logits(h1), x2, m.logits(x2), m.logits(xp)


def pick_anchors(B: int, N: int, K: int, frac: float, rng: np.random.Generator):
    """[B, A] prefix rows that start a first block (room for K predicted tokens after them) and [B, A] cuts."""
    P = N - 1
    room = P - K  # row r predicts x_{r+2}..x_{r+K+1}: r + K + 1 <= N - 1
    A = max(1, int(round(frac * room)))
    anchors = np.stack([np.sort(rng.choice(room, size=A, replace=False)) for _ in range(B)])
    cuts = rng.integers(1, K + 1, size=(B, A))
    return torch.from_numpy(anchors).long(), torch.from_numpy(cuts).long()


def valid_prefix(correct: torch.Tensor, start: torch.Tensor | None = None) -> torch.Tensor:
    """The valid-prefix mask m [.., K] from whether each row's argmax is the target's token [.., K] (eq. 5):
    m_1 = `start` (1: a first block), m_{k+1} = m_k * correct_k."""
    first = torch.ones_like(correct[..., :1]) if start is None else start[..., None].to(correct.dtype)
    return torch.cat([first, correct[..., :-1]], -1).cumprod(-1)


def block_loss(m: SpecBlockModel, h1, lg1, h2, lg2, lgp, ids, tgt, anchors, cuts, cfg: SpecBlockTrainConfig,
               rank_on: bool):
    """The draft loss (eq. 6, per position over the rows the mask admits, summed over positions of both blocks)
    and the rank head's (masked cross-entropy on rank buckets, when `rank_on`) -> (loss, metrics)."""
    K = m.config.block_size
    B, N = ids.shape
    p_top, idx = tgt
    bi = torch.arange(B)[:, None, None]
    k = torch.arange(1, K + 1)
    # first block at anchor row r (token x_{r+1}): row k predicts x_{r+1+k} from the target's row r + k
    t1 = anchors[..., None] + k  # target rows [B, A, K]
    y1 = ids[bi, t1 + 1]
    t2 = anchors[..., None] + cuts[..., None] + k
    exists2 = t2 + 1 <= N - 1
    t2c = t2.clamp(max=N - 2)
    y2 = ids[bi, t2c + 1]
    correct1 = (lg1.argmax(-1) == y1).float()
    correct2 = (lg2.argmax(-1) == y2).float() * exists2
    path1 = torch.cat([torch.ones_like(correct1[..., :1]), correct1], -1).cumprod(-1)  # [B, A, K+1]
    reach2 = path1.gather(-1, cuts[..., None])[..., 0]  # block 1 right up to the cut
    if cfg.valid_prefix:
        m1, m2 = valid_prefix(correct1), valid_prefix(correct2, reach2) * exists2
    else:
        m1, m2 = torch.ones_like(correct1), exists2.float()
    ce1 = lm.topk_soft_ce(lg1.float(), p_top[bi, t1], idx[bi, t1])
    ce2 = lm.topk_soft_ce(lg2.float(), p_top[bi, t2c], idx[bi, t2c])
    # eq. 6 averages position k's loss over the N_k rows the mask admits; early in a run on this scale N_k of the
    # later positions is a handful of rows whose noise dominated the clipped gradient (position 1's accuracy
    # stalled near 7% after 130 steps). Dividing by all rows of the position instead weights it by the share of
    # paths that reach it: the same curriculum, with later positions joining as the earlier ones get right.
    per_k = [(mm * ce).flatten(0, 1).sum(0) / ex.flatten(0, 1).sum(0).clamp_min(1)
             for mm, ce, ex in ((m1, ce1, torch.ones_like(m1)), (m2, ce2, exists2.float()))]
    # position 1 of a block is its prefix row, computed for every position anyway: its loss is taken on all of
    # them (row r predicts x_{r+2} from the target's row r + 1), four times the anchors' rows
    P = lgp.shape[1]
    ce_p = lm.topk_soft_ce(lgp[:, : P - 1].float(), p_top[:, 1:P], idx[:, 1:P])
    draft = ce_p.mean() + per_k[0][1:].sum() + per_k[1].sum()
    metrics = {"draft_loss": float(draft.detach()), "chain_acc": path1[..., 1:].mean((0, 1)).tolist(),
               "tau_block": implied_tau(correct1)}
    rank_loss = torch.zeros(())
    labels = torch.cat([bucket_of_rank(rank_of(lg1.detach(), y1)), bucket_of_rank(rank_of(lg2.detach(), y2))], 2)
    rl = m.rank_logits(torch.cat([h1, h2], 2), torch.cat([lg1, lg2], 2)).float()
    mask = torch.cat([m1, m2], 2) > 0
    if mask.any():
        pred = rl.argmax(-1)
        metrics["rank_acc"] = float((pred == labels)[mask].float().mean())
        metrics["bucket_freq"] = torch.bincount(labels[mask], minlength=len(BUCKETS)).tolist()
        if rank_on:
            rank_loss = F.cross_entropy(rl[mask], labels[mask])
    metrics["rank_loss"] = float(rank_loss.detach())
    return draft + rank_loss, metrics


@torch.no_grad()
def evaluate(m: SpecBlockModel, embed_w, target, data, cfg: SpecBlockTrainConfig) -> dict:
    """Per domain on validation windows: the first block's chain accuracy per position (every earlier row right),
    the implied tau of its top-1 chain, the rank head's accuracy and its confusion matrix (rows: true bucket)."""
    m.eval()
    res, rng = {}, np.random.default_rng(0)
    for d in DOMAINS:
        ids = lm.val_windows(data, d, cfg.eval_windows, cfg.seq_len + 1)
        if not len(ids):
            continue
        feats, tgt = target_features(target, ids, m.config.target_layers, cfg.loss_topk)
        anchors, cuts = pick_anchors(ids.shape[0], ids.shape[1], m.config.block_size, cfg.block_frac, rng)
        with lm.autocast(cfg.precision):
            out = block_forward(m, embed_w, ids, feats, anchors, cuts)
        _, met = block_loss(m, *out, ids, tgt, anchors, cuts, cfg, True)
        h1, lg1 = out[0], out[1]
        res[d] = {"chain_acc": met["chain_acc"], "tau": met["tau_block"], "rank_acc": met.get("rank_acc"),
                  "loss": met["draft_loss"], "confusion": confusion(m, h1, lg1, ids, anchors, cfg)}
    m.train()
    return res


def confusion(m, h1, lg1, ids, anchors, cfg) -> list[list[int]]:
    """The rank head's confusion matrix [true bucket][predicted] on the first blocks' rows the mask admits."""
    K = m.config.block_size
    bi = torch.arange(ids.shape[0])[:, None, None]
    y = ids[bi, anchors[..., None] + torch.arange(1, K + 1) + 1]
    labels = bucket_of_rank(rank_of(lg1.float(), y))
    pred = m.rank_logits(h1, lg1).argmax(-1)
    mask = valid_prefix((lg1.argmax(-1) == y).float()) > 0 if cfg.valid_prefix else torch.ones_like(y, dtype=bool)
    cm = torch.zeros(len(BUCKETS), len(BUCKETS), dtype=torch.long)
    cm.index_put_((labels[mask], pred[mask]), torch.ones_like(labels[mask]), accumulate=True)
    return cm.tolist()


def val_line(val: dict) -> str:
    return "val tau (block 1 chain) " + " ".join(f"{d}={v['tau']:.2f}" for d, v in val.items()) + \
        " · rank acc " + " ".join(f"{d}={v['rank_acc'] or 0:.2f}" for d, v in val.items())


@own_threads
def train_specblock(cfg: SpecBlockTrainConfig, log=print) -> dict:
    from speclab.drafters.specblock import new_specblock

    _, data, target, rng = lm.frozen_target_setup(cfg)
    embed_w = target.get_input_embeddings().weight
    if cfg.init_from:
        m = load_specblock(cfg.init_from).float().requires_grad_(True)
    else:
        m = new_specblock(target.config, target.get_output_embeddings().weight, hidden_layers=cfg.hidden_layers,
                          block_size=cfg.block_size, layer_shift=cfg.layer_shift).float()
    m.train()

    def step(n: int):
        ids = lm.sample_windows(data, cfg.domain_weights, cfg, rng)  # [B, seq_len + 1]
        feats, tgt = target_features(target, ids, m.config.target_layers, cfg.loss_topk)
        anchors, cuts = pick_anchors(ids.shape[0], ids.shape[1], m.config.block_size, cfg.block_frac, rng)
        with lm.autocast(cfg.precision):
            out = block_forward(m, embed_w, ids, feats, anchors, cuts)
        loss, met = block_loss(m, *out, ids, tgt, anchors, cuts, cfg, n >= cfg.rank_warmup)
        return lm.Step(loss, ids.numel(), {"metrics": met},
                       {"acc": "/".join(f"{a:.2f}" for a in met["chain_acc"]),
                        "rank": f"{met.get('rank_acc', 0):.2f}"})

    return lm.online_loop(
        "specblock", m, cfg, step, lambda: evaluate(m, embed_w, target, data, cfg), val_line, log,
        f", {m.config.num_hidden_layers} layers, K = {m.config.block_size}, target layers "
        f"{m.config.target_layers}, shift {m.config.layer_shift}, valid prefix {cfg.valid_prefix}")


def val_table(val: dict) -> str:
    """Markdown: per domain, the implied tau of the first block's top-1 chain, the chain accuracy at every
    position (every earlier row right too), the rank head's accuracy and the draft loss."""
    K = len(next(iter(val.values()))["chain_acc"])
    rows = ["| domain | tau (block chain) | " + " | ".join(f"chain acc {k}" for k in range(1, K + 1))
            + " | rank acc | loss |", "|---|---|" + "---|" * (K + 2)]
    for d, v in val.items():
        rows.append(f"| {d} | {v['tau']:.2f} | " + " | ".join(f"{a:.3f}" for a in v["chain_acc"])
                    + f" | {v['rank_acc'] or float('nan'):.3f} | {v['loss']:.3f} |")
    return "\n".join(rows)
