"""Train DSpark's confidence head on a trained DFlash drafter (with its Markov head), and calibrate it.

The head (arXiv 2607.05147 §3.2.1) reads each block row's final-norm state and the Markov embedding of the token
before it: c_k = sigmoid(w . [h_k ; W1[x_{k-1}]] + b), the probability that row k's draft is accepted given the rows
before it were. So the cumulative product prod_{j<=k} c_j is the probability that the block's first k drafts survive
verification, which DSpark's scheduler ranks draft tokens by (`speclab.serve.policies`).

Training (the drafter frozen: the head learns what the trained drafter does; DSpark trains both together with loss
weights 0.1 cross-entropy, 0.9 L_tv, 1.0 confidence): every batch of corpus windows goes through the frozen target
(features, its top-32 next-token distributions), then DFlash's block forward (`speclab.train.dflash`); the head's
binary cross-entropy is taken against the soft label 1 - 1/2 ||p_draft - p_target||_1 = sum min(p, q) (over the
target's top tokens: `lm.topk_acceptance`, no gradient), weighted exp(-(k - 1) / gamma), the Markov readout's p_draft
with the true previous token (teacher forcing, as DFlash trains).

Calibration (`calibrate`): on held-out windows of the target's own greedy text, every block is drafted as a decode
drafts it (row k's token from row k's logits plus the Markov bias of the drafted token before it), and a prefix of
k drafts is accepted when all k equal the text (the target's greedy continuation). The sequential scaling fits per
row, left to right, a temperature and a bias, c_k = sigmoid(z_k / T_k + b_k), the pair that minimises the Brier
score of the cumulative product at that row given the rows before it (grid search), on half the windows; per-row
ECE, AUROC and Brier of the cumulative product are reported on the other half, before and after. They go into the
drafter's config (`dspark_config`). DSpark's paper fits temperatures alone, by ECE: a temperature rescales a row's
logits around 0 and cannot move their mean, which the zoo head's first row needed (ECE 0.055 after it). A bias per
row is Platt's scaling. It is fitted by the Brier score, a proper score that rewards ranking as well as calibration
(DSpark's admission ranks tokens by the products): by ECE the same grid shrank most rows' logits toward a constant.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from speclab.drafters.dflash import load_dflash
from speclab.metrics import auroc, brier, ece
from speclab.train import lm
from speclab.train.corpus import DOMAINS
from speclab.train.dflash import block_forward, pick_blocks, target_features, val_blocks
from speclab.train.threads import own_threads

TEMPERATURES = np.exp(np.linspace(math.log(0.05), math.log(20.0), 121))  # the grids of the sequential scaling
BIASES = np.linspace(-2.0, 2.0, 81)


@dataclass
class DSparkTrainConfig(lm.OnlineSchedule):
    lr: float = field(default=3e-3, kw_only=True)
    target_dir: str
    corpus_dir: str
    out_dir: str
    block_size: int = lm.option(16, "the largest block trained (each step draws its size from 2..this)", lo=2, hi=64)
    gamma: float = lm.option(4.0, "row k's loss weight exp(-(k - 1) / gamma)", lo=0.1)
    label: str = lm.option("greedy", "what c_k learns: greedy (1 when the row's draft is the target's argmax: a greedy "
                           "decode's acceptance) or soft (DSpark's 1 - TV(p_draft, p_target) = sum min(p, q): a "
                           "sampled decode's expected acceptance)")
    calibration_corpus: str = "data/regen/greedy"  # the target's own greedy text: a prefix of drafts that matches it
    # is the prefix a greedy decode accepts
    calibration_windows: int = lm.option(32, "held-out windows per domain for the temperature scaling (half fit, "
                                         "half evaluate)", lo=2)
    rows: int = 512  # block rows per window


def with_head(m) -> None:
    """The drafter with a confidence head (a new one, zero weights and a bias at sigmoid = 0.5, when it has none,
    on the drafter's device), everything else frozen."""
    m.requires_grad_(False)
    if not m.has_confidence:
        from speclab.core.layers import Linear
        c = m.config
        c.confidence, c.confidence_temperatures = True, ()
        m.confidence_head = Linear(c.hidden_size + c.markov_rank, 1, bias=True, device=m.fc.weight.device)
        torch.nn.init.zeros_(m.confidence_head.weight)
        torch.nn.init.zeros_(m.confidence_head.bias)
    m.confidence_head.requires_grad_(True)


LABELS = ("greedy", "soft")


def labels(m, logits, ids, top, anchors, kind: str = "soft"):
    """Per block row (of every window's blocks), the Markov readout with the true token before the row (teacher
    forced): its label, soft (sum min(p, q) against the target's top tokens: a sampled draft's acceptance, DSpark's)
    or greedy (1 when its argmax is the target's), and the tokens before the rows."""
    size = logits.shape[2] + 1
    prev_pos = anchors[:, None] + torch.arange(1, size)[None] - 1
    prev = ids[:, prev_pos]
    lg = logits + m.markov_bias(prev) if m.has_markov else logits
    if kind == "greedy":
        return (lg.argmax(-1) == top[1][:, prev_pos][..., 0]).float(), prev
    return lm.topk_acceptance(lg, top[0][:, prev_pos], top[1][:, prev_pos]), prev


def drafted_blocks(m, logits, ids, anchors):
    """Every block drafted as a greedy decode drafts it: row k's token is the argmax of its logits plus the Markov
    bias of the drafted token before it (the root: the anchor's token). -> (drafts, the tokens before them)."""
    prev = ids[:, anchors]
    drafts, prevs = [], []
    for k in range(logits.shape[2]):
        lg = logits[:, :, k] + m.markov_bias(prev) if m.has_markov else logits[:, :, k]
        prevs.append(prev)
        prev = lg.argmax(-1)
        drafts.append(prev)
    return torch.stack(drafts, 2), torch.stack(prevs, 2)


@torch.no_grad()
def block_outcomes(m, embed_w, head_w, target, windows: torch.Tensor, size: int, precision: str = "fp32",
                   stride: int = 2):
    """Blocks at every `stride`-th position of `windows` (the target's own greedy text; blocks never see each
    other): the confidence logits of their drafted rows z [blocks, size - 1] and whether each prefix of drafts was
    accepted [blocks, size - 1]."""
    feats, _ = target_features(target, windows, m.config.target_layer_ids)
    anchors = torch.arange(1, windows.shape[1] - size + 1, stride)
    with lm.autocast(precision):
        logits, h = block_forward(m, embed_w, head_w, windows, feats, anchors, size, states=True)
    drafts, prev = drafted_blocks(m, logits.float(), windows, anchors)
    truth = windows[:, anchors[:, None] + torch.arange(1, size)[None]]
    accepted = (drafts == truth).long().cumprod(-1).bool()
    z = m.confidence_logits(h.float(), prev).float()
    return z.flatten(0, 1), accepted.flatten(0, 1)


def survival(z: torch.Tensor, temps, biases=()) -> np.ndarray:
    """The cumulative product of sigmoid(z_k / T_k + b_k) along each block's rows (temps, biases: one per row, or
    none: 1 and 0)."""
    t = torch.tensor(list(temps) or [1.0] * z.shape[1], dtype=torch.float32)
    b = torch.tensor(list(biases) or [0.0] * z.shape[1], dtype=torch.float32)
    return torch.sigmoid(z / t[: z.shape[1]] + b[: z.shape[1]]).cumprod(-1).numpy()


def fit_scaling(z: torch.Tensor, accepted: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The sequential scaling: row by row, the temperature and bias (of `TEMPERATURES` x `BIASES`) whose cumulative
    product at that row, the earlier rows' fixed, has the least Brier score against the accepted prefixes.
    -> (temperatures, biases)."""
    temps: list[float] = []
    biases: list[float] = []
    acc = accepted.numpy().astype(np.float64)
    for k in range(z.shape[1]):
        before = survival(z[:, :k], temps, biases)[:, -1:] if k else np.ones((z.shape[0], 1))
        best = (math.inf, 1.0, 0.0)
        for t in TEMPERATURES:  # every bias at once: [n, biases]
            p = before / (1.0 + np.exp(-((z[:, k] / float(t)).numpy()[:, None] + BIASES[None])))
            err = brier(p, acc[:, k : k + 1], axis=0)
            j = int(err.argmin())
            if err[j] < best[0]:
                best = (float(err[j]), float(t), float(BIASES[j]))
        temps.append(best[1])
        biases.append(best[2])
    return tuple(temps), tuple(biases)


def calibration_table(z: torch.Tensor, accepted: torch.Tensor, temps, biases=()) -> list[dict]:
    """Per block row: ECE, AUROC and Brier of the cumulative product against the accepted prefixes, before and
    after the scaling, the acceptance rate and the row's temperature and bias."""
    raw, scaled, acc = survival(z, ()), survival(z, temps, biases), accepted.numpy()
    return [{"row": k + 1, "accepted": float(acc[:, k].mean()), "ece_before": ece(raw[:, k], acc[:, k]),
             "ece_after": ece(scaled[:, k], acc[:, k]), "auroc_before": auroc(raw[:, k], acc[:, k]),
             "auroc_after": auroc(scaled[:, k], acc[:, k]), "brier_before": brier(raw[:, k], acc[:, k]),
             "brier_after": brier(scaled[:, k], acc[:, k]), "temperature": temps[k] if temps else 1.0,
             "bias": biases[k] if biases else 0.0}
            for k in range(z.shape[1])]


def calibrate(m, embed_w, head_w, target, cfg: DSparkTrainConfig) -> list[dict]:
    """Fit the sequential scaling on half the held-out windows of every domain of the target's greedy text
    (`cfg.calibration_corpus`) and report the other half (`calibration_table`); the temperatures and biases are set
    in m's config."""
    from transformers import AutoTokenizer

    from speclab.train.regenerate import load_token_data
    data = load_token_data(cfg.calibration_corpus, AutoTokenizer.from_pretrained(cfg.target_dir))
    size = cfg.block_size
    fit, test = [], []
    for d in DOMAINS:
        w = lm.val_windows(data, d, cfg.calibration_windows, cfg.seq_len)
        half = max(1, w.shape[0] // 2)
        fit.append(block_outcomes(m, embed_w, head_w, target, w[:half], size, cfg.precision))
        test.append(block_outcomes(m, embed_w, head_w, target, w[half:], size, cfg.precision))
    zf, af = (torch.cat(x) for x in zip(*fit))
    zt, at = (torch.cat(x) for x in zip(*test))
    m.config.confidence_temperatures, m.config.confidence_biases = (), ()
    temps, biases = fit_scaling(zf, af)
    m.config.confidence_temperatures, m.config.confidence_biases = temps, biases
    return calibration_table(zt, at, temps, biases)


@torch.no_grad()
def evaluate(m, embed_w, head_w, target, data, cfg: DSparkTrainConfig) -> dict:
    """Per domain, on validation windows (full blocks): the head's loss against the soft labels and the mean label
    and prediction per row."""
    m.eval()
    res = {}
    for d, ids, top, anchors, (logits, h) in val_blocks(m, embed_w, head_w, target, data, cfg, states=True):
        label, prev = labels(m, logits.float(), ids, top, anchors, cfg.label)
        z = m.confidence_logits(h.float(), prev).float()
        res[d] = {"bce": float(F.binary_cross_entropy_with_logits(z, label)),
                  "label": label.mean((0, 1)).tolist(), "pred": torch.sigmoid(z).mean((0, 1)).tolist()}
    m.train()
    return res


@own_threads
def train_dspark(cfg: DSparkTrainConfig, log=print) -> dict:
    if cfg.label not in LABELS:
        raise ValueError(f"--label must be one of {', '.join(LABELS)} (got {cfg.label!r})")
    if not cfg.init_from:
        raise ValueError("DSpark's confidence head trains on a DFlash drafter: give --init-from (the zoo's: "
                         "data/zoo/dflash)")
    tok, data, target, rng = lm.frozen_target_setup(cfg)
    embed_w = target.get_input_embeddings().weight
    head_w = target.get_output_embeddings().weight
    m = load_dflash(cfg.init_from).float()
    with_head(m)
    m.train()
    k = torch.arange(1, cfg.block_size)

    def step(_):
        ids = lm.sample_windows(data, cfg.domain_weights, cfg, rng)
        feats, top = target_features(target, ids, m.config.target_layer_ids)
        size = int(rng.integers(2, cfg.block_size + 1))
        anchors = pick_blocks(ids.shape[1], size, cfg.rows, rng)
        with torch.no_grad(), lm.autocast(cfg.precision):
            logits, h = block_forward(m, embed_w, head_w, ids, feats, anchors, size, states=True)
            label, prev = labels(m, logits.float(), ids, top, anchors, cfg.label)
        z = m.confidence_logits(h.float(), prev).float()
        w = torch.exp(-(k[: size - 1] - 1).float() / cfg.gamma)
        loss = (F.binary_cross_entropy_with_logits(z, label, reduction="none") * w).sum(-1).mean() / w.sum()
        return lm.Step(loss, ids.numel(), {"block": size}, {"label": f"{float(label.mean()):.2f}"})

    summary = lm.online_loop(
        "dspark", m, cfg, step, lambda: evaluate(m, embed_w, head_w, target, data, cfg),
        lambda val: "val bce " + " ".join(f"{d}={v['bce']:.3f}" for d, v in val.items()), log,
        f" (the confidence head; DFlash frozen, blocks up to {cfg.block_size})")
    log("calibrating: the sequential scaling (a temperature and a bias per row) on held-out greedy text ...")
    m.eval()
    summary["calibration"] = calibrate(m, embed_w, head_w, target, cfg)
    from pathlib import Path
    card = (Path(cfg.out_dir) / "model" / "train_config.json").read_text()
    m.save(Path(cfg.out_dir) / "model", extra_files={"train_config.json": card})
    summary["val"] = {"calibration": summary["calibration"]}
    return summary


def val_table(val: dict) -> str:
    """Markdown: per block row, the acceptance rate and ECE / AUROC / Brier of the cumulative product, before and
    after the sequential scaling (with the fitted temperature and bias)."""
    rows = ["| row | accepted | ECE before | ECE after | AUROC before | AUROC after | Brier before | Brier after | T "
            "| b |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in val.get("calibration", []):
        rows.append(f"| {r['row']} | {r['accepted']:.3f} | {r['ece_before']:.3f} | {r['ece_after']:.3f} | "
                    f"{r['auroc_before']:.3f} | {r['auroc_after']:.3f} | {r['brier_before']:.3f} | "
                    f"{r['brier_after']:.3f} | {r['temperature']:.2f} | {r['bias']:+.2f} |")
    return "\n".join(rows)
