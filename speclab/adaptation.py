"""Cost-aware serving-time adaptation of a SpecBlock drafter (paper §3.4, Algorithm 1, Appendix A.3).

A stream of prompts is decoded one after another. Verification already computes the target's distribution at
every rejected position: where the target's token differs from the draft below the last accepted node. Each
query's signal is s = sum over its rejected positions of (1 - r), where r is the drafter's probability of the
target's token there (eq. 8).

Per query a bandit picks one of three actions (eq. 9-10):
- **skip**;
- **head**: update the LM head and the rank head;
- **full**: update the whole drafter.

It predicts each update's net throughput gain as s * v_action and skips when neither prediction is positive. The
values v are EWMAs (alpha 0.1) of the realised gain per unit of signal. The realised gain is the tokens/s of the
`interval` queries after an update (the update's own time charged to them) minus the tokens/s before it.
Rules:
- the EWMA is not revised when the triggering signal is below `s_min`;
- the first `warmup` queries only measure;
- the first `cold_events` updates explore epsilon-greedily (0.3 -> 0.1);
- the `block_after` queries after an update trigger nothing.

A chosen action's samples go to its buffer. A full buffer trains theta_train on:
- the target's distribution at the buffered rejected positions (forward KL, `lm.topk_soft_ce`);
- the rank head's bucket at them;
- lambda KL(p_theta || p_theta0) against the pre-deployment drafter (lambda = 0.01).

Then theta_train is copied into theta_inf, the weights the drafter drafts with. On this CPU there is no second
stream: the update runs between queries, and its time counts against the queries measured after it.

Drift control: if accepted length falls in three consecutive intervals, theta_inf and theta_train revert to the
last good checkpoint and the values reset. `policy="osd"` is the always-update baseline (Online Speculative
Decoding): the same machinery without the bandit, a full update every `osd_every` queries. `policy="static"`
never updates. Every query's decision is a row of the trace's `adaptation` table.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from speclab.drafters.specblock import SpecBlockModel, bucket_of_rank, rank_of

ACTIONS = ("skip", "head", "full")
POLICIES = ("bandit", "osd", "static")


@dataclass
class AdaptConfig:
    policy: str = "bandit"
    lr: float = 1e-4
    kl_weight: float = 0.01  # lambda
    alpha: float = 0.10  # EWMA decay
    s_min: float = 5.0
    interval: int = 4  # queries measured after an update
    buffer: int = 4  # queries' samples a buffer holds before it trains
    osd_every: int = 8
    warmup: int = 10
    cold_events: int = 8
    eps: tuple[float, float] = (0.30, 0.10)
    block_after: int = 2
    revert_windows: int = 3
    seed: int = 0


@dataclass
class Rejection:
    """One rejected position of a query: the round's root row r (its first block's anchor), the rejected depth d
    (the first block's row d), the target's token there, the drafter's probability of it, and the target's
    distribution there by its top tokens (probabilities, ids)."""
    anchor: int
    depth: int
    token: int
    r: float
    p_top: torch.Tensor
    idx: torch.Tensor


@dataclass
class Query:
    """What one decoded query leaves for adaptation: its sequence (ids [n], features [n-1, F]), its rejections,
    its tokens/s and accepted length."""
    ids: torch.Tensor
    feats: torch.Tensor
    rejections: list[Rejection]
    tokens_per_s: float
    tau: float

    @property
    def signal(self) -> float:
        return float(sum(1.0 - x.r for x in self.rejections))


def rejections(events, drafter, n_prompt: int, topk: int = 32) -> list[Rejection]:
    """The rejected positions of a decode's RoundEvents (kept with their verification logits). A round rejects
    where the drafter had drafted below the last accepted node and the target's token (the round's last
    committed token) is another. Only rejections within the first block (depth <= K) are kept: that block's
    row at the depth is what training's forward reproduces."""
    out = []
    K = drafter.m.config.block_size
    for ev, rows in events:
        if ev.logits is None or len(ev.tree) == 0:
            continue
        last = int(ev.accepted[-1]) if ev.n_accepted else -1
        d = ev.n_accepted + 1
        if not (ev.tree.parents == last).any() or ev.committed.numel() != d or d > K or last not in rows:
            continue
        token = int(ev.committed[-1])
        p, i = torch.softmax(ev.logits[last + 1].float(), -1).topk(topk)
        root = n_prompt + ev.pos0 - 1  # the round's root token; its prefix row is root - 1
        out.append(Rejection(root - 1, d, token, float(rows[last][token]), p.cpu(), i.cpu()))
    return out


class Adapter:
    """theta_inf (the drafter's own model), theta_train and theta_0, the bandit, the buffers, drift control."""

    def __init__(self, model: SpecBlockModel, embed_w: torch.Tensor, cfg: AdaptConfig):
        if cfg.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}")
        self.inf, self.embed_w, self.cfg = model, embed_w, cfg
        self.train = copy.deepcopy(model).float().train().requires_grad_(True)
        self.theta0 = copy.deepcopy(model).float().eval().requires_grad_(False)
        heads = [p for n, p in self.train.named_parameters() if n.startswith(("lm_head.", "rank_head."))]
        self.opts = {"head": torch.optim.AdamW(heads, lr=cfg.lr),
                     "full": torch.optim.AdamW(self.train.parameters(), lr=cfg.lr)}
        self.v = {"head": 0.0, "full": 0.0}
        self.buffers: dict[str, list[Query]] = {"head": [], "full": []}
        self.rng = np.random.default_rng(cfg.seed)
        self.tps: list[float] = []  # tokens/s of every query (the update's time charged to the next ones)
        self.taus: list[float] = []
        self.events = 0  # updates so far
        self.blocked = 0  # queries still blocked after an update
        self.measuring: dict | None = None  # the open measurement interval: action, s_trig, baseline, queries left
        self.window_tau: list[float] = []  # accepted length per closed window (interval)
        self.good = copy.deepcopy(self.train.state_dict())  # the last good checkpoint
        self.charge_s = 0.0  # update time not yet charged to a query

    # -- per query (Algorithm 1) -------------------------------------------------------------------------------
    def observe(self, q: Query, decode_s: float, tokens: int) -> dict:
        """One query's decision and everything it did: the row of the trace's `adaptation` table."""
        c = self.cfg
        tps = tokens / (decode_s + self.charge_s) if decode_s + self.charge_s > 0 else float("nan")
        self.charge_s = 0.0
        self.tps.append(tps)
        self.taus.append(q.tau)
        s = q.signal
        pred = {a: s * self.v[a] for a in ("head", "full")}
        action = self._choose(s, pred)
        row = {"query": len(self.tps) - 1, "policy": c.policy, "action": action, "signal": s,
               "pred_head": pred["head"], "pred_full": pred["full"], "trained": None, "update_ms": 0.0,
               "observed_gain": None, "v_head": None, "v_full": None, "reverted": False, "tau": q.tau,
               "tokens_per_s": tps}
        row.update(self._close_interval())
        if action != "skip" and q.rejections:
            self.buffers[action].append(q)
            if len(self.buffers[action]) >= (1 if c.policy == "osd" else c.buffer):
                row["trained"], row["update_ms"] = action, self._update(action, s)
        row["reverted"] = self._drift()
        row["v_head"], row["v_full"] = self.v["head"], self.v["full"]
        return row

    def _choose(self, s: float, pred: dict) -> str:
        c, n = self.cfg, len(self.tps)
        if c.policy == "static":
            return "skip"
        if c.policy == "osd":
            return "full" if n % c.osd_every == 0 else "skip"
        if n <= c.warmup or self.blocked > 0 or self.measuring is not None:
            self.blocked = max(0, self.blocked - 1)
            return "skip"
        if self.events < c.cold_events:  # cold start: epsilon-greedy, epsilon from 0.3 down to 0.1
            eps = c.eps[0] + (c.eps[1] - c.eps[0]) * self.events / max(1, c.cold_events - 1)
            if self.rng.random() < eps:
                return str(self.rng.choice(["head", "full"]))
        if pred["head"] <= 0 and pred["full"] <= 0:
            return "skip" if self.events >= c.cold_events else ("head" if pred["head"] >= pred["full"] else "full")
        return "head" if pred["head"] >= pred["full"] else "full"

    def _close_interval(self) -> dict:
        """Count this query into the open measurement interval; at its end, revise the action's value."""
        m = self.measuring
        if m is None:
            return {}
        m["left"] -= 1
        if m["left"] > 0:
            return {}
        gain = float(np.mean(self.tps[-self.cfg.interval:])) - m["baseline"]
        self.measuring = None
        if m["s_trig"] >= self.cfg.s_min:
            a = m["action"]
            self.v[a] = (1 - self.cfg.alpha) * self.v[a] + self.cfg.alpha * gain / m["s_trig"]
        self.window_tau.append(float(np.mean(self.taus[-self.cfg.interval:])))
        return {"observed_gain": gain}

    # -- the update ------------------------------------------------------------------------------------------
    def _update(self, action: str, s_trig: float) -> float:
        t0 = time.perf_counter()
        batch, self.buffers[action] = self.buffers[action], []
        opt = self.opts[action]
        loss = self.loss(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
        opt.step()
        self.train.zero_grad(set_to_none=True)  # the trunk's gradients of a head-only step are dropped too
        self.sync()
        ms = (time.perf_counter() - t0) * 1e3
        self.charge_s += ms / 1e3
        self.events += 1
        self.blocked = self.cfg.block_after
        before = self.tps[-self.cfg.interval:]
        self.measuring = {"action": action, "s_trig": s_trig, "baseline": float(np.mean(before)),
                          "left": self.cfg.interval}
        return ms

    def loss(self, batch: list[Query]) -> torch.Tensor:
        """Forward KL to the target at the buffered rejected positions, the rank head's cross-entropy there, and
        lambda KL(p_theta || p_theta0)."""
        from speclab.train import lm
        from speclab.train.specblock import block_forward
        dev = self.embed_w.device  # the buffered rows are on the CPU (Rejection), the models on the target's device
        total = torch.zeros((), device=dev)
        for q in batch:
            ids = q.ids[None].long().to(dev)
            feats = torch.cat([q.feats.float(), q.feats.new_zeros(1, q.feats.shape[1]).float()])[None].to(dev)
            anchors = torch.tensor([[x.anchor for x in q.rejections]], device=dev)
            cuts = torch.ones_like(anchors)
            rows = torch.tensor([x.depth - 1 for x in q.rejections], device=dev)
            at = torch.arange(len(rows), device=dev)
            h, lg, *_ = block_forward(self.train, self.embed_w, ids, feats, anchors, cuts)
            lg, h = lg[0, at, rows].float(), h[0, at, rows]
            p_top = torch.stack([x.p_top for x in q.rejections]).to(dev)
            idx = torch.stack([x.idx for x in q.rejections]).to(dev)
            kl_target = lm.topk_soft_ce(lg, p_top, idx).mean()
            label = bucket_of_rank(rank_of(lg.detach(), torch.tensor([x.token for x in q.rejections], device=dev)))
            rank = F.cross_entropy(self.train.rank_logits(h, lg).float(), label)
            with torch.no_grad():
                _, lg0, *_ = block_forward(self.theta0, self.embed_w, ids, feats, anchors, cuts)
                lg0 = lg0[0, at, rows].float()
            logp = torch.log_softmax(lg, -1)
            drift = (logp.exp() * (logp - torch.log_softmax(lg0, -1))).sum(-1).mean()
            total = total + kl_target + rank + self.cfg.kl_weight * drift
        return total / max(1, len(batch))

    def sync(self) -> None:
        """theta_inf <- theta_train (in place, in the drafter's dtype)."""
        with torch.no_grad():
            for a, b in zip(self.inf.parameters(), self.train.parameters()):
                a.copy_(b.to(a.dtype))

    def _drift(self) -> bool:
        """Accepted length down in the last three windows: revert to the last good checkpoint, reset the values;
        a window that did not fall makes the current weights the good checkpoint."""
        w = self.window_tau
        n = self.cfg.revert_windows
        if len(w) >= n + 1 and all(w[-i - 1] > w[-i] for i in range(1, n + 1)):
            self.train.load_state_dict(self.good)
            self.sync()
            self.v = {"head": 0.0, "full": 0.0}
            self.window_tau = []
            return True
        if len(w) >= 2 and w[-1] >= w[-2]:
            self.good = copy.deepcopy(self.train.state_dict())
        return False


def run_query(target, models: dict, prompt: str, params: dict, max_new_tokens: int, trace=None, **kw) -> tuple:
    """Decode one query with SpecBlock, keeping what adaptation reads -> (Query, GenerationResult)."""
    from speclab.generate import Generation
    seen = []
    g = Generation(target, prompt, "specblock", models=models, max_new_tokens=max_new_tokens, trace=trace,
                   keep_logits=True, **params, **kw)
    drafter = g.drafters["specblock"]
    g.on_round = lambda ev: seen.append((ev, dict(drafter.row_probs)))
    for _ in g:
        pass
    res = g.result
    ids, feats = drafter.history()
    q = Query(ids, feats, rejections(seen, drafter, g.prompt_ids.numel()), res.tokens_per_s,
              len(res.token_ids) / max(1, res.decode.rounds))
    return q, res


def adapt_stream(target, model: SpecBlockModel, prompts: list[dict], cfg: AdaptConfig, params: dict,
                 max_new_tokens: int, store=None, stream: str = "", log=print) -> pd.DataFrame:
    """Serve `prompts` one after another with SpecBlock under `cfg.policy` (the drafter's weights are changed in
    place: pass a copy), each query traced (its run) and its decision written to the trace's `adaptation` table.
    Progress with ETA. -> the decisions, one row per query."""
    import pyarrow as pa

    from speclab.progress import Progress
    embed_w = target.model.get_input_embeddings().weight
    ad = Adapter(model, embed_w, cfg)
    rows, prog = [], Progress(len(prompts), f"adapt {cfg.policy} ({stream or 'stream'})")
    for i, p in enumerate(prompts):
        q, res = run_query(target, {"specblock": model}, p["prompt"], params, max_new_tokens, trace=store,
                           prompt_id=p.get("prompt_id"), category=p.get("category"))
        row = {"run_id": res.run_id, "stream": stream, "category": p.get("category"),
               **ad.observe(q, res.elapsed_s, len(res.token_ids))}
        rows.append(row)
        if store is not None:
            store.append({"adaptation": pa.Table.from_pylist([row])})
        prog.update(i + 1, tau=f"{q.tau:.2f}", action=row["action"])
    return pd.DataFrame(rows)
