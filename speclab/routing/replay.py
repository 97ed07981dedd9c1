"""Counterfactual acceptance profiles, exact replay of routing policies, oracles and the round-cost model.

Under greedy decoding the output is the AR sequence whatever the drafters do. So each drafter can be run once at
every position g of that sequence (g generated tokens committed, a round starting there): how many of its draft
tokens the target would accept (`accepted`, before any cut at the end), its tree's size (`width`: the verification
takes width + 1 rows) and its drafting time. That is a *profile*. From profiles any routing policy replays
exactly without a model: a round at g by drafter d commits min(a_d(g) + 1, N - g) tokens, the next round starts
there. The accept lengths and committed tokens of a live routed run equal the replay (tests/test_routing.py);
signals (the target's entropy and final hidden state of the row that produced the last committed token) come
from one target forward of the whole sequence.

Throughput comes from a `CostModel` fitted by least squares to the measured phases of live rounds (a bench's
runs): drafting per drafter, verification by width, catch-up by drafter and digested tokens, the rest per
drafter, the prefill by prompt length. `model_error_table` reports its error against live runs
(`speclab.metrics.model_error`: modeled / measured tokens/s - 1).

Oracles (WhiFlash section 4): Oracle-Task (the best single drafter per category), Oracle-Prompt (per prompt) and
Oracle-Token (the best drafter every round): `oracle_max_tau` by dynamic programming over positions (fewest
rounds = highest tau over the sequence; it never loses to a coarser oracle), `min_time` by dynamic programming over
(position, previous drafter) on the cost model with the switch cost at the mean switch backlog.

Greedy only: under sampling the committed sequence depends on the drafts, so there is no single sequence to
profile; `check_greedy` says so.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from speclab.core.engine import entropy, feature_columns, feature_layers
from speclab.core.sampling import Sampling
from speclab.core.target import Target
from speclab.core.tree import merge
from speclab.core.verify import verify_tokens
from speclab.errors import InvalidInput
from speclab.metrics import model_error, tau, tokens_per_s
from speclab.routing.routers import DFLASH, EAGLE3, NONE, pick

DRAFTERS = (EAGLE3, DFLASH)  # the order of drafter indices in choice arrays: 0 = EAGLE-3, 1 = DFlash


@dataclass
class Profile:
    """One prompt's counterfactual profile: per position g (0..N-1) of the AR output and per drafter."""
    prompt_id: str
    category: str | None
    prompt_tokens: int
    tokens: np.ndarray  # [N] the AR output
    max_new_tokens: int
    accepted: np.ndarray  # [D, N] draft tokens the target accepts if drafter d drafts at g (uncut)
    width: np.ndarray  # [D, N] draft tree nodes
    draft_ms: np.ndarray  # [D, N] drafting time measured while profiling
    entropy: np.ndarray  # [N] nats: the entropy signal a round at g sees (nan: none, a one-token prompt's first)
    hidden: torch.Tensor | None = None  # [N, d] the final-norm hidden state signal (what the neural router reads)
    arms: tuple[str, ...] = DRAFTERS  # what the rows of accepted / width / draft_ms are (routing v2: any arms)
    probe: dict[str, np.ndarray] = field(default_factory=dict)  # [N] per probing drafter's signal (`Signals.probe`)

    @property
    def n(self) -> int:
        return len(self.tokens)


def check_greedy(temperature: float) -> None:
    if temperature and temperature > 0:
        raise InvalidInput(f"replay and oracles are greedy-only (temperature {temperature:g} > 0): under sampling the "
                           "committed sequence depends on the drafts, so no single sequence can be profiled; run the "
                           "routers live instead (they stay lossless under sampling)")


@torch.inference_mode()
def profile_sequence(target: Target, drafters: dict, prompt_ids: torch.Tensor, tokens: torch.Tensor,
                     max_new_tokens: int, prompt_id: str = "", category: str | None = None,
                     positions=None, arms: tuple[str, ...] = DRAFTERS) -> Profile:
    """Run every arm (by default EAGLE-3 and DFlash, built by a whiflash method; any names of `drafters`, merged arms
    (`speclab.routing.arms.Merged`) and "none" among them) at every position of the AR output `tokens` of
    `prompt_ids`, exactly as a round starting there would (catch-up, propose with the room left). Each drafter
    proposes once a position; a merged arm verifies the merge of its members' proposals there (its accept length is
    the best member's, its width the merged tree's); "none" accepts nothing. With `positions`, only there (a run's
    round starts, for its router view): the drafters catch up on the rest in one go, as lazily as a live run;
    `accepted` and `width` are -1 elsewhere (not for replay)."""
    prompt_ids, tokens = prompt_ids.cpu().long().flatten(), tokens.cpu().long().flatten()
    P, N = prompt_ids.numel(), tokens.numel()
    ids = torch.cat([prompt_ids, tokens])
    own = list(dict.fromkeys(m for a in arms if a != NONE
                             for m in getattr(drafters[a], "members", (a,))))  # the drafters that propose
    layers = feature_layers(target, {m: drafters[m] for m in own})
    out = target.forward(ids[: P + N - 1].to(target.device), target.new_cache(), layers=layers, hidden=True)
    rows = torch.arange(P - 2, P + N - 2)  # row r drew token r + 1: a round at g sees the row that drew x_{P+g-1}
    ent = entropy(out.logits)[rows.clamp(min=0)].cpu().numpy().astype(np.float64)
    hid = out.hidden[rows.clamp(min=0)].float().cpu()
    if P == 1:
        ent[0] = math.nan
    truth = torch.full((max_new_tokens + 1,), -1, dtype=torch.long)
    truth[:N] = tokens  # the target's token at the row of depth j from a root at g: tokens[g + j] (-1 past the end)
    fill = 0 if positions is None else -1
    acc = np.full((len(arms), N), fill, np.int64)
    width = np.full((len(arms), N), fill, np.int64)
    todo = np.ones(N, bool) if positions is None else np.isin(np.arange(N), np.asarray(list(positions), np.int64))
    ms = np.zeros((len(arms), N))
    greedy = Sampling()
    cols = {m: _columns(drafters[m], layers, target.hidden_size, out.features) for m in own}
    for m in own:
        drafters[m].reset(ids[:P], cols[m][: P - 1], capacity=ids.numel())
    seen = P
    probe: dict[str, np.ndarray] = {}

    def verdict(tree):
        depth = g + torch.cat([tree.depth.new_zeros(1), tree.depth]).cpu()
        return verify_tokens(tree, truth[depth].to(tree.tokens.device)).accepted

    for g in np.flatnonzero(todo).tolist():
        n = P + g
        room = max_new_tokens - g - 1
        trees, took = {}, {}
        for m in own:
            d = drafters[m]
            d.catch_up(ids[seen:n], cols[m][seen - 1 : n - 1])
            if hasattr(d, "probe"):  # a router's view of it there (`Signals.probe`)
                for k, v in d.probe().items():
                    probe.setdefault(k, np.full(N, np.nan))[g] = v
            if room <= 0:
                continue
            t0 = time.perf_counter()
            trees[m] = d.propose(room, greedy, None)
            took[m] = (time.perf_counter() - t0) * 1e3
            drafters[m].commit(trees[m], verdict(trees[m]))
        seen = n
        for i, a in enumerate(arms):
            members = getattr(drafters.get(a), "members", (a,)) if a != NONE else ()
            if room <= 0 or not members:  # no room to draft, or none: a round there is the target's step alone
                acc[i, g] = width[i, g] = 0
                continue
            tree = merge([trees[m] for m in members])[0] if len(members) > 1 else trees[members[0]]
            acc[i, g], width[i, g] = verdict(tree).numel(), len(tree)
            ms[i, g] = sum(took[m] for m in members)
    return Profile(prompt_id, category, P, tokens.numpy(), max_new_tokens, acc, width, ms, ent, hid, tuple(arms),
                   probe)


def _columns(drafter, layers: tuple[int, ...], d: int, feats: torch.Tensor) -> torch.Tensor:
    """The drafter's own layers' columns of the features, as the engine hands them (`engine.feature_columns`)."""
    idx = feature_columns(tuple(getattr(drafter, "layers", ())), layers, d, feats.device)
    return feats if idx is None else feats.index_select(1, idx)


# -- replay ------------------------------------------------------------------------------------------------------
@dataclass
class Walk:
    """Rounds of K policies replayed on one profile: [rounds, K] arrays, -1 where a policy had already finished."""
    start: np.ndarray  # g at round start
    drafter: np.ndarray  # index into DRAFTERS
    accepted: np.ndarray  # accepted draft tokens (cut at the end of the sequence)
    committed: np.ndarray
    width: np.ndarray
    backlog: np.ndarray  # tokens the drafter digested in its catch-up (the prompt too, on its first turn)
    eager_backlog: np.ndarray  # tokens the other drafter digested too (eager scheme; 0 when lazy)

    def rounds(self) -> np.ndarray:
        return (self.start >= 0).sum(0)

    def one(self, k: int = 0) -> pd.DataFrame:
        """Policy k's rounds as a table (what a live run's `rounds` rows say)."""
        live = self.start[:, k] >= 0
        return pd.DataFrame({"round": np.arange(live.sum()), "pos": self.start[live, k],
                             "drafter": np.array(DRAFTERS)[self.drafter[live, k]],
                             "n_accepted": self.accepted[live, k], "committed": self.committed[live, k],
                             "width": self.width[live, k], "backlog": self.backlog[live, k]})


def walk(p: Profile, choice: np.ndarray, eager: bool = False) -> Walk:
    """Replay K policies at once. `choice` [K, N] (a drafter index per position: an index into `p.arms`) or
    [K, N, D + 1] (per position and previous drafter, D = none yet)."""
    K, N, D = choice.shape[0], p.n, p.accepted.shape[0]
    assert not eager or D == 2, "the eager scheme catches up the other of two drafters"
    if choice.ndim == 2:
        choice = np.repeat(choice[:, :, None], D + 1, 2)
    g = np.zeros(K, np.int64)
    prev = np.full(K, D)
    seen = np.zeros((K, D), np.int64)
    fresh = np.ones((K, D), bool)
    ks = np.arange(K)
    cols = {f: [] for f in Walk.__dataclass_fields__}
    while True:
        live = g < N
        if not live.any():
            break
        gi = np.minimum(g, N - 1)
        c = choice[ks, gi, prev]
        a = p.accepted[c, gi]
        acc = np.minimum(a, N - gi)
        com = np.minimum(a + 1, N - gi)
        back = gi - seen[ks, c] + fresh[ks, c] * (p.prompt_tokens - 1)
        other = 1 - c
        eback = np.where(eager, gi - seen[ks, other] + fresh[ks, other] * (p.prompt_tokens - 1), 0)
        for f, v in zip(cols, (gi, c, acc, com, p.width[c, gi], back, eback)):
            cols[f].append(np.where(live, v, -1))
        seen[ks, c], fresh[ks, c] = np.where(live, gi, seen[ks, c]), fresh[ks, c] & ~live
        if eager:
            seen[ks, other], fresh[ks, other] = np.where(live, gi, seen[ks, other]), fresh[ks, other] & ~live
        prev = np.where(live, c, prev)
        g = np.where(live, g + com, g)
    return Walk(*(np.array(cols[f]).reshape(-1, K) for f in cols))


def entropy_choice(p: Profile, thresholds) -> np.ndarray:
    """WhiFlash-Entropy's choices [K, N] for K thresholds (speclab.routing.routers.pick, vectorised)."""
    t = np.asarray(thresholds, np.float64)[:, None]
    return np.where(p.entropy[None, :] > t, DRAFTERS.index(pick(1.0, 0.0)), DRAFTERS.index(pick(0.0, 1.0)))


def signal_choice(signal: np.ndarray, thresholds) -> np.ndarray:
    """Choices [K, N] of a threshold policy on a per-position signal (nan: no signal: DFlash)."""
    t = np.asarray(thresholds, np.float64)[:, None]
    return np.where(np.asarray(signal)[None, :] > t, DRAFTERS.index(EAGLE3), DRAFTERS.index(DFLASH))


@torch.inference_mode()
def neural_signal(p: Profile, mlp) -> np.ndarray:
    """The neural router's predicted Delta AL at every position (nan where the signal is missing)."""
    dev = next(mlp.parameters()).device
    pred = mlp(p.hidden.to(dev)).cpu().numpy().astype(np.float64)
    if p.prompt_tokens == 1:
        pred[0] = math.nan
    return pred


def fixed_choice(p: Profile, name: str) -> np.ndarray:
    return np.full((1, p.n), DRAFTERS.index(name))


# -- costs -------------------------------------------------------------------------------------------------------
@dataclass
class CostModel:
    """ms per round = draft[d] + verify0 + verify1 * (width + 1) + catchup0[d] + catchup1[d] * backlog + other[d];
    a decode = prefill0 + prefill1 * prompt tokens + its rounds. Fitted by least squares to live rounds."""
    draft: list[float]
    verify0: float
    verify1: float
    catchup0: list[float]
    catchup1: list[float]
    other: list[float]
    prefill0: float
    prefill1: float
    rounds_fitted: int = 0
    runs_fitted: int = 0
    label: str = ""  # where the costs come from: a bench fitted here, or a hardware profile (`routing.hardware`)
    here: bool = True  # the costs are this machine's (False: another machine's profile: no live figure compares)

    def ar_token_ms(self) -> float:
        """An AR step under this model: one target forward of one row (modeled; prefill aside)."""
        return self.verify0 + self.verify1

    def round_ms(self, d: np.ndarray, width: np.ndarray, backlog: np.ndarray, eager_backlog=None) -> np.ndarray:
        d = np.asarray(d)
        ms = (np.take(self.draft, d) + self.verify0 + self.verify1 * (np.asarray(width) + 1)
              + np.where(np.asarray(backlog) > 0, np.take(self.catchup0, d) + np.take(self.catchup1, d) * backlog, 0)
              + np.take(self.other, d))
        if eager_backlog is not None:
            o = 1 - d
            ms = ms + np.where(eager_backlog > 0,
                               np.take(self.catchup0, o) + np.take(self.catchup1, o) * eager_backlog, 0)
        return ms

    def walk_ms(self, p: Profile, w: Walk) -> np.ndarray:
        """Modeled decode ms [K] of every replayed policy (prefill included)."""
        live = w.start >= 0
        ms = np.where(live, self.round_ms(np.maximum(w.drafter, 0), np.maximum(w.width, 0), np.maximum(w.backlog, 0),
                                          np.maximum(w.eager_backlog, 0)), 0.0)
        return ms.sum(0) + self.prefill0 + self.prefill1 * p.prompt_tokens

    def switch_ms(self, d: int, backlog: float) -> float:
        """Catch-up time of drafter d over `backlog` tokens."""
        return self.catchup0[d] + self.catchup1[d] * backlog

    def to_dict(self) -> dict:
        """The terms, as a cost profile keeps them (`speclab.routing.hardware`)."""
        return {k: v for k, v in self.__dict__.items() if k not in ("label", "here")}

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    def table(self) -> pd.DataFrame:
        return pd.DataFrame({"drafter": DRAFTERS, "draft_ms": self.draft, "catchup_ms": self.catchup0,
                             "catchup_ms_per_token": self.catchup1, "other_ms": self.other,
                             "verify_ms_at_width_1": [self.verify0 + self.verify1 * 2] * 2,
                             "verify_ms_per_row": [self.verify1] * 2})


def live_rounds(store, bench_id: str) -> pd.DataFrame:
    """Every traced round of the bench's runs whose drafter is EAGLE-3 or DFlash (any run but eager ones, whose
    catch-up phase also holds the idle drafter's work: `runs.eager`), with its run."""
    return store.query(f"""
        SELECT x.run_id, u.method, u.prompt_id, u.category, u.prompt_tokens, u.new_tokens, u.elapsed_s, u.prefill_ms,
               x.round, x.drafter, x.n_drafted, x.committed, x.n_accepted, x.backlog, x.t_draft_ms, x.t_verify_ms,
               x.t_catchup_ms, x.t_route_ms + x.t_commit_ms + coalesce(x.t_record_ms, 0) AS t_other_ms
        FROM rounds x JOIN runs u USING (run_id)
        WHERE u.bench_id = ? AND u.status = 'done' AND x.drafter IN ('{EAGLE3}', '{DFLASH}')
              AND NOT coalesce(u.eager, false)
        ORDER BY x.run_id, x.round""", [bench_id])


def fit_costs(store, bench_id: str) -> CostModel:
    """Least-squares fit of every term of the CostModel to the bench's live rounds and prefills."""
    df = live_rounds(store, bench_id)
    if df.empty or not set(DRAFTERS) <= set(df.drafter):
        raise InvalidInput(f"bench {bench_id} has no traced rounds of both {EAGLE3} and {DFLASH}: run eagle3 and "
                           "dflash (or a whiflash method) in it to fit the cost model")
    di = df.drafter.map(DRAFTERS.index).to_numpy()
    draft = [float(df.t_draft_ms[(di == i) & (df.n_drafted > 0)].mean()) for i in range(len(DRAFTERS))]
    other = [float(df.t_other_ms[di == i].mean()) for i in range(len(DRAFTERS))]
    v = np.linalg.lstsq(np.c_[np.ones(len(df)), df.n_drafted + 1], df.t_verify_ms, rcond=None)[0]
    c0, c1 = [], []
    for i in range(len(DRAFTERS)):
        sel = (di == i) & (df.backlog > 0)
        x, y = df.backlog[sel].to_numpy(float), df.t_catchup_ms[sel].to_numpy(float)
        a, b = (np.linalg.lstsq(np.c_[np.ones(len(x)), x], y, rcond=None)[0] if len(np.unique(x)) > 1
                else (y.mean(), 0.0))
        c0.append(float(a))
        c1.append(float(max(b, 0.0)))
    runs = df.groupby("run_id").agg(prompt_tokens=("prompt_tokens", "first"), prefill_ms=("prefill_ms", "first"))
    pf = np.linalg.lstsq(np.c_[np.ones(len(runs)), runs.prompt_tokens], runs.prefill_ms, rcond=None)[0] \
        if runs.prompt_tokens.nunique() > 1 else (runs.prefill_ms.mean(), 0.0)
    return CostModel(draft, float(v[0]), float(v[1]), c0, c1, other, float(pf[0]), float(pf[1]), len(df), len(runs),
                     f"fitted to bench {bench_id}'s live rounds on this machine")


def model_error_table(cost: CostModel, store, bench_id: str) -> pd.DataFrame:
    """The cost model against the bench's live runs that used the two drafters, per method: the rounds a run really
    had (drafter, width, backlog) through the cost model give its modeled decode time. Columns: runs,
    tokens_per_s_live (measured), tokens_per_s_modeled, model_error (`speclab.metrics.model_error` of those two,
    pooled over the method's runs) and mean_abs_model_error (over its runs one by one)."""
    df = live_rounds(store, bench_id)
    df["di"] = df.drafter.map(DRAFTERS.index)
    df["ms"] = cost.round_ms(df.di.to_numpy(), df.n_drafted.to_numpy(), df.backlog.to_numpy())
    per = df.groupby("run_id").agg(method=("method", "first"), category=("category", "first"), ms=("ms", "sum"),
                                   prompt_tokens=("prompt_tokens", "first"), new_tokens=("new_tokens", "first"),
                                   elapsed_s=("elapsed_s", "first"))
    per["modeled_s"] = (per.ms + cost.prefill0 + cost.prefill1 * per.prompt_tokens) / 1e3
    per["error"] = model_error(per.new_tokens / per.modeled_s, per.new_tokens / per.elapsed_s)
    out = per.groupby("method").agg(runs=("error", "size"), tokens=("new_tokens", "sum"), live_s=("elapsed_s", "sum"),
                                    modeled_s=("modeled_s", "sum"),
                                    mean_abs_model_error=("error", lambda e: e.abs().mean())).reset_index()
    out["tokens_per_s_live"] = [tokens_per_s(t, s) for t, s in zip(out.tokens, out.live_s)]
    out["tokens_per_s_modeled"] = [tokens_per_s(t, s) for t, s in zip(out.tokens, out.modeled_s)]
    out["model_error"] = model_error(out.tokens_per_s_modeled, out.tokens_per_s_live)
    return out[["method", "runs", "tokens_per_s_live", "tokens_per_s_modeled", "model_error", "mean_abs_model_error"]]


def hardware_threshold(cost: CostModel, tau_dflash: float, switch_backlog: float, widths: tuple[float, float],
                       stay_backlog: tuple[float, float] = (2.0, 2.0)) -> dict:
    """tau_neural from measured latencies (WhiFlash 3.3.2: switch only when the predicted gain outweighs the
    cost). A round commits tau tokens; EAGLE-3's round pays off when (tau_dflash + Delta) / T_eagle3 > tau_dflash /
    T_dflash, i.e. Delta > tau_dflash * (T_eagle3 - T_dflash) / T_dflash, where a drafter's round time T is the
    cost model's at its mean tree width and usual catch-up (`stay_backlog`), and a switch adds EAGLE-3's catch-up
    of the mean switch backlog.
    Returns the threshold with the numbers it came from (the keys trained routers keep in their config.json)."""
    a, d = DRAFTERS.index(EAGLE3), DRAFTERS.index(DFLASH)
    t = [float(cost.round_ms(i, widths[i], stay_backlog[i])) for i in range(len(DRAFTERS))]
    switch = cost.switch_ms(a, switch_backlog) - cost.switch_ms(a, stay_backlog[a])
    return {"threshold": tau_dflash * (t[a] + switch - t[d]) / t[d], "al_dflash": tau_dflash, "t_eagle3_ms": t[a],
            "t_dflash_ms": t[d], "width_eagle3": widths[a], "width_dflash": widths[d],
            "switch_backlog": switch_backlog, "switch_ms": switch,
            "rule": "AL_dflash * (T_eagle3 + switch - T_dflash) / T_dflash"}


# -- oracles -----------------------------------------------------------------------------------------------------
def oracle_max_tau(p: Profile) -> np.ndarray:
    """Oracle-Token (max tau): the drafter every round that minimises the number of rounds to the end (DP over
    positions: R(g) = 1 + min_d R(g + committed_d(g))). Choices [1, N]; ties go to the larger accept length."""
    N = p.n
    R = np.zeros(N + 1)
    best = np.zeros(N, np.int64)
    for g in range(N - 1, -1, -1):
        nxt = np.minimum(g + np.minimum(p.accepted[:, g] + 1, N - g), N)
        r = 1 + R[nxt]
        best[g] = int(np.lexsort((-p.accepted[:, g], r))[0])
        R[g] = r[best[g]]
    return best[None, :]


def oracle_min_ms(p: Profile, ms: np.ndarray) -> np.ndarray:
    """Oracle-Token over N arms (routing v2) on modeled round times `ms` [A, N] (each arm's round at each position):
    the arm every round that minimises the modeled time to the end (DP over positions: T(g) = min_a ms[a, g] +
    T(g + committed_a(g))). Choices [1, N]."""
    N, ms = p.n, np.asarray(ms, np.float64)
    T = np.zeros(N + 1)
    best = np.zeros(N, np.int64)
    for g in range(N - 1, -1, -1):
        nxt = np.minimum(g + np.minimum(p.accepted[:, g] + 1, N - g), N)
        t = ms[:, g] + T[nxt]
        best[g] = int(t.argmin())
        T[g] = t[best[g]]
    return best[None, :]


def router_choice(p: Profile, router) -> np.ndarray:
    """A router replayed on an N-arm profile round by round, exactly as live under greedy decoding: at every round
    start it sees what it would see live (the row's hidden state and entropy, the probing drafters' signals there,
    the recent rounds, the position). Choices [1, N] (an arm index at each round start; the rest unused)."""
    from collections import deque

    from speclab.core.engine import HISTORY
    from speclab.core.protocol import Signals
    N = p.n
    choice = np.zeros((1, N), np.int64)
    history: deque = deque(maxlen=HISTORY)
    g, rnd = 0, 0
    while g < N:
        ent = float(p.entropy[g])
        hidden = p.hidden[g].float() if p.hidden is not None and not (p.prompt_tokens == 1 and g == 0) else None
        probe = {k: float(v[g]) for k, v in p.probe.items()}
        d = router.choose(Signals(rnd, ent, hidden, [a for a, _ in history], [n for _, n in history], probe, g))
        c = p.arms.index(d.choice if d.choice is not None else NONE)
        choice[0, g] = c
        acc = int(min(p.accepted[c, g], N - g))
        history.append((acc, d.choice))
        g, rnd = g + min(int(p.accepted[c, g]) + 1, N - g), rnd + 1
    return choice


def oracle_min_time(p: Profile, cost: CostModel, switch_backlog: float) -> np.ndarray:
    """Oracle-Token (min modeled time): DP over (position, previous drafter) on the cost model. Staying with a
    drafter digests what its last round committed; a switch digests `switch_backlog` tokens; a drafter's first
    turn digests the prompt and everything since. Choices [1, N, D + 1] (D = no previous drafter)."""
    N, D = p.n, len(DRAFTERS)
    com = np.minimum(p.accepted + 1, N - np.arange(N)[None, :])  # [D, N]
    T = np.zeros((N + 1, D + 1))
    best = np.zeros((N, D + 1), np.int64)
    for g in range(N - 1, -1, -1):
        for prev in range(D + 1):
            t = np.empty(D)
            for d in range(D):
                if prev == D:
                    back = p.prompt_tokens - 1 + g
                elif prev == d:
                    back = 2  # a typical round's commit (the cost of staying barely depends on it)
                else:
                    back = switch_backlog
                t[d] = float(cost.round_ms(d, p.width[d, g], back)) + T[g + com[d, g], d]
            best[g, prev] = int(np.argmin(t))
            T[g, prev] = t[best[g, prev]]
    return best[None, :, :]


# -- profiles in the trace -----------------------------------------------------------------------------------------
def save_profiles(store, bench_id: str, profiles: list[Profile], params: dict) -> None:
    """Profiles into the trace (`profiles`: one row per prompt, position and drafter; `profile_positions`: the
    signals per position; `profile_sets`: what they were made with), replacing the bench's earlier ones."""
    import pyarrow as pa
    store.execute("DELETE FROM profiles WHERE bench_id = ?", [bench_id])
    store.execute("DELETE FROM profile_positions WHERE bench_id = ?", [bench_id])
    store.execute("DELETE FROM profile_sets WHERE bench_id = ?", [bench_id])
    for p in profiles:
        N, D = p.n, len(DRAFTERS)
        d = p.hidden.shape[1]
        store.append({
            "profiles": pa.table({"bench_id": [bench_id] * N * D, "prompt_id": [p.prompt_id] * N * D,
                                  "category": [p.category] * N * D, "pos": np.tile(np.arange(N, dtype=np.int32), D),
                                  "drafter": np.repeat(DRAFTERS, N),
                                  "accepted": p.accepted.reshape(-1).astype(np.int32),
                                  "width": p.width.reshape(-1).astype(np.int32), "draft_ms": p.draft_ms.reshape(-1)}),
            "profile_positions": pa.table({
                "bench_id": [bench_id] * N, "prompt_id": [p.prompt_id] * N, "category": [p.category] * N,
                "pos": np.arange(N, dtype=np.int32), "token_id": p.tokens.astype(np.int32), "entropy": p.entropy,
                "prompt_tokens": np.full(N, p.prompt_tokens, np.int32),
                "max_new_tokens": np.full(N, p.max_new_tokens, np.int32),
                "hidden": pa.FixedSizeListArray.from_arrays(pa.array(p.hidden.numpy().reshape(-1)), d)})})
    store.append({"profile_sets": pa.table({"bench_id": [bench_id], "params_json": [json.dumps(params, sort_keys=True)],
                                            "prompts": [len(profiles)]})})
    store.drain()


def load_profiles(store, bench_id: str) -> tuple[list[Profile], dict]:
    """The bench's profiles (and the drafter parameters they were made with); InvalidInput when there are none."""
    sets = store.query("SELECT params_json FROM profile_sets WHERE bench_id = ?", [bench_id])
    if sets.empty:
        raise InvalidInput(f"no profiles for bench {bench_id}: make them with `speclab profile --bench {bench_id}`")
    pos = store.query("SELECT * EXCLUDE (hidden) FROM profile_positions WHERE bench_id = ? ORDER BY prompt_id, pos",
                      [bench_id])
    hid = store.query_arrow("SELECT prompt_id, hidden FROM profile_positions WHERE bench_id = ? "
                            "ORDER BY prompt_id, pos", [bench_id])
    h = hid.column("hidden").combine_chunks()
    hidden = torch.from_numpy(h.flatten().to_numpy().reshape(len(h), -1).copy())
    prof = store.query("SELECT prompt_id, drafter, pos, accepted, width, draft_ms FROM profiles WHERE bench_id = ? "
                       "ORDER BY prompt_id, drafter, pos", [bench_id])
    out, start = [], 0
    for pid, rows in pos.groupby("prompt_id", sort=False):
        N = len(rows)
        mats = {}
        for f in ("accepted", "width", "draft_ms"):
            sub = prof[prof.prompt_id == pid]
            mats[f] = np.stack([sub[sub.drafter == d].sort_values("pos")[f].to_numpy() for d in DRAFTERS])
        out.append(Profile(str(pid), rows.category.iloc[0], int(rows.prompt_tokens.iloc[0]), rows.token_id.to_numpy(),
                           int(rows.max_new_tokens.iloc[0]), mats["accepted"].astype(np.int64),
                           mats["width"].astype(np.int64), mats["draft_ms"], rows.entropy.to_numpy(np.float64),
                           hidden[start : start + N]))
        start += N
    return out, json.loads(sets.params_json.iloc[0])


def replay_table(profiles: list[Profile], policies: dict, cost: CostModel | None = None,
                 eager: bool = False) -> pd.DataFrame:
    """One row per (policy label, prompt): rounds, tokens, accepted, switches, EAGLE-3's share of rounds and
    the modeled decode time. `policies` maps a label to a function Profile -> choices [K, N(, D + 1)] and the K
    values it sweeps (label -> (fn, values)); a value of None means a policy without a parameter."""
    rows = []
    for p in profiles:
        for label, (fn, values) in policies.items():
            w = walk(p, fn(p), eager)
            ms = cost.walk_ms(p, w) if cost is not None else np.full(len(values), np.nan)
            live = w.start >= 0
            rounds = live.sum(0)
            sw = ((w.drafter[1:] != w.drafter[:-1]) & live[1:]).sum(0)
            ar_share = ((w.drafter == DRAFTERS.index(EAGLE3)) & live).sum(0) / rounds
            acc = np.where(live, w.accepted, 0).sum(0)
            for k, v in enumerate(values):
                rows.append({"policy": label, "value": v, "prompt_id": p.prompt_id, "category": p.category,
                             "tokens": p.n, "rounds": int(rounds[k]), "accepted": int(acc[k]), "switches": int(sw[k]),
                             "eagle3_share": float(ar_share[k]), "modeled_s": float(ms[k]) / 1e3})
    return pd.DataFrame(rows)


def summarize_walks(df: pd.DataFrame, by=("policy", "value", "category")) -> pd.DataFrame:
    """Rows of `replay_table` pooled per group: tau (tokens per round, speclab.metrics.tau) and modeled tokens/s
    (tokens / modeled time)."""
    g = df.groupby(list(by), dropna=False).agg(prompts=("prompt_id", "nunique"), tokens=("tokens", "sum"),
                                               rounds=("rounds", "sum"), switches=("switches", "sum"),
                                               eagle3_share=("eagle3_share", "mean"), modeled_s=("modeled_s", "sum"))
    g["tau"] = [tau(t, r) for t, r in zip(g.tokens, g.rounds)]
    g["tokens_per_s"] = [tokens_per_s(t, s) for t, s in zip(g.tokens, g.modeled_s)]
    return g.reset_index()
