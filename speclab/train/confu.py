"""Train a ConFu drafter online from the frozen target (ConFu, ../shared/papers/confu.txt, section 3.3).

Every batch of windows goes through the frozen target once (no grad): its three feature layers, its next-token
distributions and its keys and values in every layer (what the lean cache holds at inference). Then:

1. **Anchors** (the paper's anchor-token sampling). Row i of a window is the drafter's pair (x_{i+1}, h_i), as in
   EAGLE-3's training. Anchors sit every `replicate` + 1 rows from a random phase (or, with `anchors` K set, at K
   rows drawn at random). One contemplate row after each anchor a goes through the frozen target
   (`speclab.drafters.contemplate.contemplate_lean`, the function decoding uses): it sees the soft prompts and tokens
   0..a, sits at position a + 1, its embedding is [con] = MoE(h_a), and its final-norm state is f_a. Gradients reach
   the soft prompts and the MoE through the frozen target.
2. **Replication** (future-prediction replication): rows a..a + `replicate` reuse f_a, and with it [f] = MoE(fc(h_a)).
   Rows no anchor covers (before the first one, or between random anchors) are not in the loss.
3. **The drafter** is unrolled for `ttt_steps` as EAGLE-3's training does (`speclab.train.eagle3.ttt_forward`),
   with the future slot of its row as one more key every step sees, at position i + 1 (where decoding puts it:
   right after the newest pair).
4. **The loss** is the KL to the target's distribution only (EAGLE-3's cross-entropy against it, weighted 0.8^s):
   it trains the soft prompts, both MoEs and the drafter together. The target stays frozen.

The drafter starts from a trained EAGLE-3 (`--init-from`, as the paper starts from the EAGLE-3 checkpoint) or
resumes a ConFu run. New ConFu parts start at the target's scale: the soft prompts are the target's own keys and
values of `soft_prompts` tokens of the data, the experts are the target's input embeddings of random tokens plus
noise, the routers at zero (uniform gates).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from speclab.core.lean import LeanDecoder
from speclab.drafters.confu import ConFuConfig, ConFuModel, load_confu
from speclab.drafters.contemplate import contemplate_lean
from speclab.drafters.eagle3 import load_eagle3
from speclab.metrics import implied_tau
from speclab.train import lm
from speclab.train.corpus import DOMAINS
from speclab.train.eagle3 import ttt_forward, ttt_loss, val_table  # noqa: F401 (the CLI prints it)
from speclab.train.threads import own_threads


@dataclass
class ConFuTrainConfig(lm.OnlineSchedule):
    target_dir: str
    corpus_dir: str
    out_dir: str
    lr: float = field(default=1e-3, kw_only=True)  # the zoo recipe's peak
    soft_prompts: int = lm.option(16, "s, soft-prompt key/value entries per target layer (0: none)", lo=0, hi=4096)
    experts: int = lm.option(8, "experts of each MoE (1: a static embedding, the paper's ablation without MoE)",
                             lo=1, hi=4096)
    expert_topk: int = lm.option(2, "experts mixed per row", lo=1, hi=4096)
    replicate: int = lm.option(3, "l, rows after an anchor that reuse its future vector (0: none, the ablation)",
                               lo=0, hi=4096)
    anchors: int = lm.option(0, "K_train anchors per window, drawn at random (0: one every l + 1 rows)",
                             lo=0, hi=1 << 20)
    ttt_steps: int = lm.option(3, "training-time-test steps (unrolled on its own outputs)", lo=1)
    loss_topk: int = lm.option(32, "the loss against the target's k most likely tokens, renormalised (0: all)", lo=0)
    loss_tv: float = lm.loss_tv_option()
    step_weight: float = 0.8


def target_pass(target, ids: torch.Tensor, layer_ids, topk: int):
    """(features [B, T, F] fp32, the target's distributions as `eagle3.target_features`, keys, values: per layer
    [B, kv, T, D]) of windows ids [B, T], no grad."""
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True, use_cache=True)
        feats = torch.cat([out.hidden_states[j] for j in layer_ids], -1).float()
        dist = lm.target_dist(out.logits, topk)
        cache = out.past_key_values
        return feats, dist, [x.keys for x in cache.layers], [x.values for x in cache.layers]


def pick_anchors(B: int, R: int, cfg: ConFuTrainConfig, rng: np.random.Generator) -> torch.Tensor:
    """[B, K] anchor rows, ascending per window: every replicate + 1 rows from a random phase, or `anchors` rows
    drawn without replacement."""
    if cfg.anchors:
        k = min(cfg.anchors, R)
        return torch.from_numpy(np.sort(np.stack([rng.choice(R, k, replace=False) for _ in range(B)]), 1))
    step = cfg.replicate + 1
    phase = rng.integers(0, step, size=B)
    k = (R - step + 1) // step + 1  # the same count for every phase
    return torch.from_numpy(phase[:, None] + step * np.arange(k)[None]).clamp(max=R - 1)


def row_anchor(anchors: torch.Tensor, R: int, replicate: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(index into the anchors [B, R], covered [B, R] bool) of every row: the latest anchor a <= i with
    i - a <= replicate."""
    rows = torch.arange(R)
    j = torch.searchsorted(anchors, rows.expand(anchors.shape[0], R).contiguous(), right=True) - 1
    a = anchors.gather(1, j.clamp(min=0))
    return j.clamp(min=0), (j >= 0) & (rows - a <= replicate)


def confu_forward(m: ConFuModel, dec: LeanDecoder, embed, ids: torch.Tensor, feats, keys, values, anchors,
                  cfg: ConFuTrainConfig):
    """The drafter's unrolled logits (`ttt_forward` with each row's future slot) and the rows the loss covers."""
    B, T = ids.shape
    R = T - 1
    c = m.confu.contemplation
    ai = anchors
    emb = c.con(feats.gather(1, ai[..., None].expand(-1, -1, feats.shape[-1])))  # [B, K, d]: [con] = MoE(h_a)
    visible = torch.arange(T)[None, None] <= ai[..., None]  # tokens 0..a
    f = contemplate_lean(dec, keys, values, emb, ai + 1, visible, c.soft_k, c.soft_v).float()  # [B, K, d]
    j, covered = row_anchor(ai, R, cfg.replicate)
    h_a = m.fc(feats.gather(1, ai[..., None].expand(-1, -1, feats.shape[-1])))  # fc(h_a) [B, K, H]
    f_emb = m.confu.future(h_a)
    pick = j[..., None].expand(-1, -1, f.shape[-1])
    future = (f_emb.gather(1, pick), f.gather(1, pick), covered)
    return ttt_forward(m, embed, ids, feats, cfg.ttt_steps, future), covered


def train_step(m: ConFuModel, dec, embed, target, ids: torch.Tensor, cfg: ConFuTrainConfig, rng):
    """One step's forward and loss (the caller runs the backward): `ttt_loss`'s tuple, over the covered rows."""
    feats, dist, keys, values = target_pass(target, ids, m.config.layer_ids, cfg.loss_topk)
    anchors = pick_anchors(ids.shape[0], ids.shape[1] - 1, cfg, rng)
    with lm.autocast(cfg.precision):
        logits, covered = confu_forward(m, dec, embed, ids, feats, keys, values, anchors, cfg)
    return ttt_loss(logits, dist, m, cfg.step_weight, rows=covered, tv=cfg.loss_tv)


@torch.no_grad()
def evaluate(m, dec, embed, target, data, cfg: ConFuTrainConfig) -> dict:
    """Per domain, on validation windows (fixed anchors), against the target's full distributions: per-step loss,
    accuracy and sampling acceptance, and the implied greedy and sampled tau of a chain as deep as the unroll."""
    m.eval()
    res = {}
    for d in DOMAINS:
        ids = lm.val_windows(data, d, cfg.eval_windows, cfg.seq_len)
        _, losses, accs, tau, alphas = train_step(m, dec, embed, target, ids, replace(cfg, loss_topk=0, loss_tv=0.0),
                                                  np.random.default_rng(0))
        res[d] = {"loss": losses, "acc": accs, "tau": tau, "alpha": alphas, "tau_sampled": implied_tau(alphas)}
    m.train()
    return res


def init_confu(m: ConFuModel, target, data, cfg: ConFuTrainConfig, rng: np.random.Generator) -> None:
    """New ConFu parts at the target's scale: soft prompts = the target's keys and values of `soft_prompts` tokens
    of a training window; experts = target input embeddings of random tokens plus noise; routers zero."""
    s = cfg.soft_prompts
    emb = target.get_input_embeddings().weight
    c = m.confu
    with torch.no_grad():
        if s:  # s = 0: no soft prompts (the contemplate row sees the context and itself)
            ids = lm.sample_windows(data, cfg.domain_weights, replace(cfg, batch_size=1, seq_len=s), rng)[:, :s]
            _, _, keys, values = target_pass(target, ids, m.config.layer_ids, 0)
            c.contemplation.soft_k.copy_(torch.stack([k[0] for k in keys]).float())
            c.contemplation.soft_v.copy_(torch.stack([v[0] for v in values]).float())
        for mix in (c.contemplation.con, c.future):
            rows = emb[torch.from_numpy(rng.integers(0, emb.shape[0], size=mix.experts.shape[0]))].float()
            mix.experts.copy_(rows + 0.1 * rows.std() * torch.randn_like(rows))
            mix.router.weight.zero_()


def new_or_resumed(cfg: ConFuTrainConfig, target, data, rng) -> ConFuModel:
    """The drafter to train: a ConFu run resumed (`init_from` holds a `confu` config), or a new ConFu part on a
    trained EAGLE-3 (`init_from` an EAGLE-3 drafter, the paper's start)."""
    if not cfg.init_from:
        raise ValueError("train confu starts from a trained EAGLE-3 drafter: give --init-from (e.g. data/zoo/eagle3)")
    raw = json.loads((Path(cfg.init_from) / "config.json").read_text())
    if "confu" in raw:
        return load_confu(cfg.init_from).float()
    c = ConFuConfig.for_target(_Shape(target), soft_prompts=cfg.soft_prompts, experts=cfg.experts,
                               expert_topk=cfg.expert_topk)
    m = ConFuModel.from_eagle3(load_eagle3(cfg.init_from).float(), c)
    init_confu(m, target, data, cfg, rng)
    return m


SHAPE_OPTIONS = {"soft_prompts": "--soft-prompts", "experts": "--experts", "expert_topk": "--expert-topk"}


def check_resume(init_from: str, given: dict) -> None:
    """A ConFu run resumed from `init_from` keeps its own shape (s, experts, top-k): an option given (`given`:
    field -> value) that asks for another is refused rather than ignored (ValueError). An EAGLE-3 start takes any."""
    raw = json.loads((Path(init_from) / "config.json").read_text())
    for key, flag in SHAPE_OPTIONS.items():
        asked, has = given.get(key), raw.get("confu", {}).get(key)
        if has is not None and asked is not None and asked != has:
            raise ValueError(f"{flag} {asked}: the ConFu run at {init_from} has {has} (a resumed run keeps its "
                             f"shape; leave {flag} out)")


class _Shape:
    """What `ConFuConfig.for_target` reads of a speclab Target, from a transformers model."""

    def __init__(self, model):
        self.config, self.num_layers = model.config, model.config.num_hidden_layers


@own_threads
def train_confu(cfg: ConFuTrainConfig, log=print) -> dict:
    _, data, target, rng = lm.frozen_target_setup(cfg)
    embed = target.get_input_embeddings()
    dec = LeanDecoder(target)  # the frozen target's contemplate rows, differentiable in their inputs
    m = new_or_resumed(cfg, target, data, rng)
    m.requires_grad_(True)
    for b in ("d2t", "t2d"):
        getattr(m, b).requires_grad_(False)
    m.train()
    tokens_per_step = cfg.batch_size * cfg.seq_len

    def step(_):
        ids = lm.sample_windows(data, cfg.domain_weights, cfg, rng)
        loss, losses, accs, tau, _ = train_step(m, dec, embed, target, ids, cfg, rng)
        return lm.Step(loss, tokens_per_step, {"step_loss": losses, "step_acc": accs, "tau": tau},
                       {"acc": "/".join(f"{a:.2f}" for a in accs)})

    about = (f", s {m.confu_config.soft_prompts}, experts {m.confu_config.experts} (top {m.confu_config.expert_topk})"
             f", replicate {cfg.replicate}, anchors {cfg.anchors or 'every ' + str(cfg.replicate + 1)}, "
             f"{cfg.ttt_steps} TTT steps; ConFu config {json.dumps(asdict(m.confu_config))}")
    return lm.online_loop(
        "confu", m, cfg, step, lambda: evaluate(m, dec, embed, target, data, cfg),
        lambda val: "val tau greedy/sampled " + " ".join(f"{d}={v['tau']:.2f}/{v['tau_sampled']:.2f}"
                                                         for d, v in val.items()),
        log, about)
