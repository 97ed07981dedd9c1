"""Train an EAGLE-3 drafter online from a frozen target, with training-time test (EAGLE-3, Li et al. 2025).

No feature dump on disk: every batch of windows (corpus text or the target's own continuations,
`speclab.train.regenerate`) goes through the frozen target first (no grad), which gives the three feature layers
and its next-token distributions; then the drafter is unrolled on its own outputs for `ttt_steps` steps.

Row i of a window pairs the target's feature f_i with the token x_{i+1}. Step 0 reads fc(f_i) and predicts
x_{i+2}. Step s reads its own step-(s-1) output at row i with the token x_{i+s+1} (at position i + s) and
predicts x_{i+s+2}; its query attends to the step-0 keys of rows <= i (the context, causal) and to row i's own
keys of steps 1..s (its draft ancestors): exactly what a depth-(s+1) node sees when drafting. The loss of step s
is the cross-entropy of the drafter against the target's distribution at position i + s + 1 (= KL + the
target's entropy; over the full vocabulary, or over the target's `loss_topk` most likely tokens and one bucket for
the rest, `lm.topk_soft_ce`),
weighted 0.8^s as in EAGLE-3. Logged per step: the accuracy (the draft's argmax, as a target token, equals the
target's argmax) and the implied greedy tau of a chain as deep as the unroll (`speclab.metrics.implied_tau`): 1 + the
mean number of leading steps that match (step s reads the true token, which is the draft's own exactly when the
steps before matched).

`precision="bf16"` runs the target in bf16 (the features a bf16 decode gives the drafter) and the drafter in bf16
autocast; this CPU has native bf16 (`speclab.train.speed` measures both).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from speclab.drafters.eagle3 import (
    Eagle3Config,
    Eagle3Model,
    default_layer_ids,
    load_eagle3,
)
from speclab.metrics import implied_tau
from speclab.train import lm
from speclab.train.corpus import DOMAINS
from speclab.train.threads import own_threads


@dataclass
class Eagle3TrainConfig(lm.OnlineSchedule):
    target_dir: str
    corpus_dir: str
    out_dir: str
    layer_ids: tuple[int, ...] | None = None  # hidden_states indices; None = default_layer_ids(target depth)
    draft_vocab_size: int | None = lm.option(  # None = the target's vocabulary; smaller = the most frequent tokens
        None, "the draft head's vocabulary, the training data's most frequent tokens (default: the target's whole "
        "vocabulary, or --init-from's)", lo=2, flag="--draft-vocab")
    intermediate_size: int | None = None  # None = the target's
    ttt_steps: int = lm.option(3, "training-time-test steps (unrolled on its own outputs, step 0 included)", lo=1)
    loss_topk: int = lm.option(  # 0: the target's full distribution; k: its k most likely tokens + a rest bucket
        32, "the loss against the target's k most likely tokens, renormalised (0: its full distribution)", lo=0)
    loss_tv: float = lm.loss_tv_option()
    step_weight: float = 0.8


def new_drafter(target, cfg: Eagle3TrainConfig, token_counts: np.ndarray | None = None) -> Eagle3Model:
    """A fresh drafter shaped like one of the target's layers; its LM head starts as the target's (rows of the
    draft vocabulary), its norms at one."""
    tc = target.config
    L = tc.num_hidden_layers
    vocab = tc.vocab_size
    dv = cfg.draft_vocab_size or vocab
    c = Eagle3Config(hidden_size=tc.hidden_size, intermediate_size=cfg.intermediate_size or tc.intermediate_size,
                     num_attention_heads=tc.num_attention_heads, num_key_value_heads=tc.num_key_value_heads,
                     head_dim=getattr(tc, "head_dim", None), vocab_size=vocab, draft_vocab_size=dv,
                     target_hidden_size=tc.hidden_size, layer_ids=tuple(cfg.layer_ids or default_layer_ids(L)),
                     rms_norm_eps=tc.rms_norm_eps, max_position_embeddings=tc.max_position_embeddings,
                     rope_theta=float((getattr(tc, "rope_parameters", None) or {}).get("rope_theta", 10000.0)))
    m = Eagle3Model(c)
    keep = torch.arange(vocab)
    if dv < vocab:
        if token_counts is None:
            raise ValueError("a reduced draft vocabulary needs token counts")
        keep = frequent_tokens(token_counts, dv)
        _set_vocab(m, keep)
    with torch.no_grad():
        m.lm_head.weight.copy_(target.get_output_embeddings().weight[keep].float())
    return m


def frequent_tokens(token_counts: np.ndarray, n: int) -> torch.Tensor:
    """The ids of the `n` most frequent tokens, ascending (a draft vocabulary)."""
    return torch.from_numpy(np.argsort(-token_counts, kind="stable")[:n]).sort().values


def _set_vocab(m: Eagle3Model, keep: torch.Tensor) -> None:
    """d2t / t2d of a draft vocabulary `keep` (target ids, ascending)."""
    m.d2t.copy_(keep - torch.arange(keep.numel()))
    m.t2d.zero_()
    m.t2d[keep] = True


def shrink_vocab(m: Eagle3Model, keep: torch.Tensor) -> Eagle3Model:
    """A copy of a trained drafter whose head keeps only the target tokens `keep` (a subset of its vocabulary):
    everything else is the same weights, so a full-vocabulary drafter can go on training with a smaller head."""
    draft_ids = m.t2d.cumsum(0) - 1  # target id -> row of the current head
    if not bool(m.t2d[keep].all()):
        raise ValueError("the new draft vocabulary must be inside the drafter's")
    small = Eagle3Model(replace(m.config, draft_vocab_size=keep.numel()))
    state = {k: v for k, v in m.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    small.load_state_dict(state, strict=False)
    with torch.no_grad():
        small.lm_head.weight.copy_(m.lm_head.weight[draft_ids[keep]])
    _set_vocab(small, keep)
    return small


def ttt_forward(m: Eagle3Model, embed: torch.nn.Embedding, ids: torch.Tensor, feats: torch.Tensor, steps: int,
                future: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    """Unrolled drafter outputs for windows ids [B, T] with target features [B, T, F]: logits [steps][B, T-1, Vd].
    Row i of step s predicts ids[i + s + 2] (rows past the window are garbage; the loss masks them).

    `future` (ConFu, `speclab.drafters.confu`): (embedding [B, T-1, H], hidden [B, T-1, H], has [B, T-1] bool) of
    each row's future slot, one more key and value every step of row i sees (where `has`), at position i + 1."""
    B, T = ids.shape
    R = T - 1
    c = m.config
    cos, sin = m.rope(R + steps, feats.dtype if feats.is_floating_point() else torch.float32)
    cos, sin = cos.float(), sin.float()
    pos = torch.arange(R)
    h = m.fc(feats[:, :R])
    causal = torch.ones(R, R, dtype=torch.bool).tril()
    rep = c.num_attention_heads // c.num_key_value_heads
    scale = c.head_dim ** -0.5
    keys, vals, out = [], [], []
    if future is not None:  # ConFu's future slot: one key and value per row, the same at every step
        _, kf, vf = m.qkv(future[0].float(), future[1].float(), cos[pos + 1][:, None], sin[pos + 1][:, None])
        kf, vf = kf.repeat_interleave(rep, 1), vf.repeat_interleave(rep, 1)
        no_future = ~future[2][:, None, :, None]  # [B, 1, R, 1]
    for s in range(steps):
        tok = F.pad(ids[:, 1 + s :], (0, s), value=0)  # x_{i+s+1}, padded past the window
        p = pos + s
        q, k, v = m.qkv(embed(tok).float(), h, cos[p][:, None], sin[p][:, None])  # [B, heads, R, D]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        if s == 0:
            k0, v0 = k, v
        else:
            keys.append(k)
            vals.append(v)
        ctx = (q @ k0.transpose(-1, -2)) * scale  # step-0 keys: the context, causal
        ctx = ctx.masked_fill(~causal, float("-inf"))
        diag = [(q * kj).sum(-1, keepdim=True) * scale for kj in keys]  # row i's own keys of steps 1..s
        if future is not None:
            diag.append(((q * kf).sum(-1, keepdim=True) * scale).masked_fill(no_future, float("-inf")))
        w = torch.softmax(torch.cat([ctx, *diag], -1).float(), -1).to(q.dtype)
        o = w[..., :R] @ v0
        for j, vj in enumerate(vals + ([vf] if future is not None else [])):
            o = o + w[..., R + j : R + j + 1] * vj
        h = m.finish(h, o)
        out.append(m.logits(h))
    return out


def ttt_loss(logits: list[torch.Tensor], target: tuple, m: Eagle3Model, weight: float,
             rows: torch.Tensor | None = None, tv: float = 0.0):
    """(weighted loss, per-step loss, per-step accuracy, implied greedy tau, per-step sampling acceptance) against
    the target's distributions: `target` is `target_features`' (log-probs [B, T, V], None) or (top probabilities
    [B, T, k], their ids); the sampling acceptance sum(min(p, q)) needs the full distributions (else []). `rows`
    [B, T-1] bool: the rows the loss and the figures cover (default all). `tv` > 0 adds tv * (1 - sum min(p, q))
    per step (DSpark's L_tv, the acceptance of a token drawn from q), over the target's top tokens when only those
    are known: a lower bound of the acceptance, which the tail can only raise."""
    first, idx = target
    t2d, d2t = m.t2d, m.d2t
    reduced = not bool(t2d.all())
    keep = None
    if idx is None:
        p_top = first.argmax(-1)  # reduced: the target's distribution over the draft vocabulary, renormalised
        p = torch.softmax(first[..., t2d], -1) if reduced else first.exp()
    else:
        p_top, p = idx[..., 0], first
        if reduced:  # the top tokens outside the draft vocabulary are dropped (`topk_soft_ce`); ids into it
            keep = t2d[idx]
            idx = ((t2d.cumsum(0) - 1)[idx]).clamp_min(0)
    R = first.shape[1] - 1
    total, losses, accs, matches, alphas = 0.0, [], [], [], []
    for s, lg in enumerate(logits):
        n = R - s  # rows whose prediction lies inside the window
        lg = lg[:, :n].float()
        sel = torch.ones(lg.shape[:2], dtype=torch.bool, device=lg.device) if rows is None else rows[:, :n]
        sl = slice(1 + s, 1 + s + n)
        loss = lm.soft_ce(lg, p[:, sl], None if idx is None else idx[:, sl],
                          None if keep is None else keep[:, sl])[sel].mean()
        accept = None  # sum min(p, q): the acceptance of a token drawn from q, over what is known of p
        if idx is None:
            pt = first[:, sl].exp()
            accept = lm.acceptance(lg if tv else lg.detach(), pt[..., t2d] if reduced else pt)
            alphas.append(float(accept.detach()[sel].mean()))
        elif tv:
            accept = lm.topk_acceptance(lg, p[:, sl], idx[:, sl], None if keep is None else keep[:, sl])
        if tv:
            loss = loss + tv * (1.0 - accept)[sel].mean()
        draft = lg.detach().argmax(-1)
        match = (draft + d2t[draft]) == p_top[:, sl]
        total = total + weight ** s * loss
        losses.append(float(loss.detach()))
        accs.append(float(match[sel].float().mean()))
        matches.append(match[:, : R - len(logits) + 1])
    lead = torch.stack(matches, -1).float()  # [B, rows every step predicts, steps]
    tau = implied_tau(lead, None if rows is None else rows[:, : lead.shape[1]])
    return total, losses, accs, tau, alphas


def target_features(target, ids: torch.Tensor, layer_ids, topk: int = 0) -> tuple[torch.Tensor, tuple]:
    """The drafter's input features (fp32) and the target's next-token distributions: (log-probs, None) over the
    vocabulary, or (probabilities, ids) of its `topk` most likely tokens (`lm.target_dist`; the rest is one bucket
    of the loss, `lm.topk_soft_ce`)."""
    return lm.target_features(target, ids, layer_ids, topk)


def train_step(m: Eagle3Model, embed, target, ids: torch.Tensor, cfg: Eagle3TrainConfig):
    """One step's forward and loss (the caller runs the backward): `ttt_loss`'s tuple."""
    feats, tgt = target_features(target, ids, m.config.layer_ids, cfg.loss_topk)
    with lm.autocast(cfg.precision):
        logits = ttt_forward(m, embed, ids, feats, cfg.ttt_steps)
    return ttt_loss(logits, tgt, m, cfg.step_weight, tv=cfg.loss_tv)


@torch.no_grad()
def evaluate(m, embed, target, data, cfg: Eagle3TrainConfig) -> dict:
    """Per domain, on validation windows, against the target's full distributions: per-step loss, accuracy and
    sampling acceptance, and the implied greedy and sampled tau of a chain as deep as the unroll."""
    m.eval()
    res = {}
    for d in DOMAINS:
        ids = lm.val_windows(data, d, cfg.eval_windows, cfg.seq_len)
        _, losses, accs, tau, alphas = train_step(m, embed, target, ids, replace(cfg, loss_topk=0, loss_tv=0.0))
        res[d] = {"loss": losses, "acc": accs, "tau": tau, "alpha": alphas, "tau_sampled": implied_tau(alphas)}
    m.train()
    return res


@own_threads
def train_eagle3(cfg: Eagle3TrainConfig, log=print) -> dict:
    _, data, target, rng = lm.frozen_target_setup(cfg)
    embed = target.get_input_embeddings()
    counts = None
    if cfg.draft_vocab_size:  # the draft vocabulary: the training data's most frequent tokens
        counts = sum(np.bincount(data[d]["train"], minlength=target.config.vocab_size) for d in DOMAINS)
    if cfg.init_from:
        m = load_eagle3(cfg.init_from).float()
        if cfg.draft_vocab_size and cfg.draft_vocab_size < m.config.draft_vocab_size:
            m = shrink_vocab(m, frequent_tokens(counts * m.t2d.numpy(), cfg.draft_vocab_size))
        m.requires_grad_(True)
    else:
        m = new_drafter(target, cfg, counts)
    m.train()
    tokens_per_step = cfg.batch_size * cfg.seq_len

    def step(_):
        ids = lm.sample_windows(data, cfg.domain_weights, cfg, rng)  # [B, seq_len + 1]
        loss, losses, accs, tau, _ = train_step(m, embed, target, ids, cfg)
        return lm.Step(loss, tokens_per_step, {"step_loss": losses, "step_acc": accs, "tau": tau},
                       {"acc": "/".join(f"{a:.2f}" for a in accs)})

    return lm.online_loop(
        "eagle3", m, cfg, step, lambda: evaluate(m, embed, target, data, cfg),
        lambda val: "val tau greedy/sampled " + " ".join(f"{d}={v['tau']:.2f}/{v['tau_sampled']:.2f}"
                                                         for d, v in val.items()),
        log, f", layers (hidden_states) {m.config.layer_ids}, {cfg.ttt_steps} TTT steps")


def val_table(val: dict) -> str:
    """Markdown: per domain, the implied greedy tau of a chain as deep as the unroll, the validation accuracy
    (draft argmax = target argmax) at every TTT step and the step-0 loss."""
    steps = len(next(iter(val.values()))["acc"])
    rows = ["| domain | tau (chain of " + str(steps) + ") | " + " | ".join(f"acc step {s}" for s in range(steps))
            + " | loss step 0 |", "|---|---|" + "---|" * (steps + 1)]
    for d, v in val.items():
        rows.append(f"| {d} | {v.get('tau', float('nan')):.2f} | " + " | ".join(f"{a:.3f}" for a in v["acc"])
                    + f" | {v['loss'][0]:.3f} |")
    return "\n".join(rows)


def curve_table(records: list[dict]) -> str:
    """Markdown: tokens seen, minutes, and per domain the implied tau (where logged) and the validation accuracy
    at TTT steps 0 and last, at each validation of a (joined) training log."""
    return lm.val_curve(records, lambda d: f"{d} tau; acc step 0 / last",
                        lambda v: (f"{v['tau']:.2f}; " if "tau" in v else "")
                        + f"{v['acc'][0]:.3f} / {v['acc'][-1]:.3f}")
