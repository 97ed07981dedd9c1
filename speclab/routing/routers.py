"""Routers: which drafter drafts the next round. Consulted once per round with the round's `Signals`; every
`Decision` (policy, signal, threshold, choice) is written to the trace's `router_decisions`. The protocol they
implement (`Router`, `Signals`, `Decision`) and `FixedRouter` live in `speclab.core.protocol`.

Policies (WhiFlash, ../shared/papers/whiflash.txt, section 3.3):
- `fixed`: one drafter, always (every single-drafter method; `speclab.core.protocol.FixedRouter`).
- `entropy` (WhiFlash-Entropy): H_t, the entropy of the target distribution that produced the last committed
  token; the autoregressive drafter (EAGLE-3) when H_t > tau_entropy, else the parallel one (DFlash).
- `neural` (WhiFlash-Neural): an MLP on the target's final-norm hidden state h_t predicts
  Delta AL_t = AL_eagle3 - AL_dflash; EAGLE-3 when the prediction > tau_neural.
- `rule` (routing v2's baseline, `speclab.routing.arms`): prompt lookup's arm while its match is at least
  `min_match` tokens, else another arm.
- `schedule`: a given drafter per round (what an oracle chose, replayed live: `speclab.routing.replay`).

Thresholds (the rule's `min_match` too) come from `data/zoo/calibration.json` (`speclab calibrate`) when none is
given: the category's when the run's category is known and calibrated, the global one otherwise; a neural router
falls back to its own hardware-aware threshold (derived from measured latencies when it was trained), the others to
`FALLBACKS`.

`eager` (the naive scheme WhiFlash compares lazy catch-up with): the engine brings every drafter up to date every
round, not only the chosen one.
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from speclab.core.protocol import Decision, Signals
from speclab.errors import InvalidInput, ModelNotFound
from speclab.files import write_atomic

EAGLE3, DFLASH = "eagle3", "dflash"  # WhiFlash's m_a (autoregressive) and m_d (diffusion / parallel) drafters
NONE = "none"  # routing v2's arm without a drafter: the target steps alone (`speclab.routing.arms`)
JOIN = "."  # joins a merged arm's members (shell-safe, and free of the spec's '+', ':', '=', ',', '@')
LOOKUP = "pld"  # prompt lookup: the drafter whose probed match the routers read (`Signals.probe`)
ENTROPY_FALLBACK = 1.0  # nats: the entropy threshold when nothing is calibrated for the target
MIN_MATCH = 3  # tokens: the rule router's prompt lookup match when nothing is calibrated (session 24's sweep)
MIN_MATCH_RANGE = (1, 32)  # the rule's thresholds: a match longer than 32 tokens is past prompt lookup's lookup
# the uncalibrated threshold of each policy (a neural router has its own hardware-aware one: this is without it)
FALLBACKS = {"entropy": ENTROPY_FALLBACK, "neural": 0.0, "rule": MIN_MATCH}


def pick(signal: float, threshold: float) -> str:
    """WhiFlash's decision rule, shared by both policies and by replay: EAGLE-3 when signal > threshold, DFlash
    otherwise (also when there is no signal: the first round of a one-token prompt)."""
    return EAGLE3 if signal > threshold else DFLASH


class EntropyRouter:
    """WhiFlash-Entropy: EAGLE-3 when the target's last entropy H_t > threshold, else DFlash."""
    policy = "entropy"
    needs = frozenset({"entropy"})

    def __init__(self, threshold: float, eager: bool = False):
        self.threshold, self.eager = float(threshold), bool(eager)

    def choose(self, s: Signals) -> Decision:
        return Decision(pick(s.entropy, self.threshold), self.policy, s.entropy, self.threshold)


@dataclass
class RouterConfig:
    hidden_size: int  # d of the target's final hidden state
    width: int  # d / 8 (WhiFlash Appendix A)
    dropout: float = 0.1
    target: str = ""  # the fingerprint of the target it was trained for (Target.fingerprint)
    hardware_threshold: float = 0.0  # tau_neural derived from measured latencies
    # (speclab.routing.replay.hardware_threshold)
    derivation: dict = field(default_factory=dict)  # the numbers that threshold came from


class RouterMLP(nn.Module):
    """d -> d/8 -> GELU -> dropout -> 1: the predicted Delta AL = AL_eagle3 - AL_dflash at a position."""

    def __init__(self, config: RouterConfig):
        super().__init__()
        self.config = config
        self.net = nn.Sequential(nn.Linear(config.hidden_size, config.width), nn.GELU(), nn.Dropout(config.dropout),
                                 nn.Linear(config.width, 1))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.net(h.float())[..., 0]

    def save(self, path: str | Path, extra: dict | None = None) -> None:
        from speclab.drafters.checkpoint import save_checkpoint
        save_checkpoint(self, {**self.config.__dict__, **(extra or {})}, path, dtype=torch.float32)


def load_router(path: str | Path, target=None):
    """A trained router (config.json + model.safetensors), checked against the target's hidden size."""
    from speclab.drafters.checkpoint import load_strict, read_checkpoint
    where, cfg, state = read_checkpoint(path, "neural router")
    known = {k: cfg[k] for k in RouterConfig.__dataclass_fields__ if k in cfg}
    if "hidden_size" not in known or "width" not in known:
        raise ModelNotFound(f"{path}: config.json is not a speclab neural router's (no hidden_size / width)")
    m = RouterMLP(RouterConfig(**known))
    load_strict(m, {k: v.float() for k, v in state.items()}, where, "neural router")
    return _for_target(m, path, target, "neural router", "speclab train router")


def _for_target(m: nn.Module, path, target, noun: str, command: str) -> nn.Module:
    """A loaded router checked against the target it will route for (the fingerprint it was trained for, the size of
    the hidden states it reads; InvalidInput naming `command` to train another), on its device, frozen."""
    if target is not None:
        if m.config.target and m.config.target != target.fingerprint:
            raise InvalidInput(f"the {noun} at {path} was trained for another target (fingerprint {m.config.target}, "
                               f"this one's is {target.fingerprint}): train one for this target ({command})")
        if target.hidden_size != m.config.hidden_size:
            raise InvalidInput(f"the {noun} at {path} reads hidden states of size {m.config.hidden_size}, the "
                               f"target's are {target.hidden_size}: train one for this target ({command})")
        m.to(target.device)
    m.name = str(path)
    return m.eval().requires_grad_(False)


class NeuralRouter:
    """WhiFlash-Neural: EAGLE-3 when the MLP's predicted Delta AL on h_t > threshold, else DFlash."""
    policy = "neural"
    needs = frozenset({"hidden"})

    def __init__(self, mlp: RouterMLP, threshold: float, eager: bool = False):
        self.mlp, self.threshold, self.eager = mlp, float(threshold), bool(eager)
        self.device = next(mlp.parameters()).device

    @torch.inference_mode()
    def choose(self, s: Signals) -> Decision:  # (a replayed profile's row is on the CPU: moved to the MLP)
        pred = float(self.mlp(s.hidden.to(self.device))) if s.hidden is not None else math.nan
        return Decision(pick(pred, self.threshold), self.policy, pred, self.threshold)


class RuleRouter:
    """Routing v2's hand-written baseline: prompt lookup's arm while its current match (`Signals.probe`'s
    `pld_match`: tokens before the root that agree with those before the continuation it would propose) is at least
    `min_match` tokens, else the other arm (`speclab.routing.arms`)."""
    policy = "rule"
    needs = frozenset({"probe"})
    eager = False

    def __init__(self, lookup: str, other: str | None, min_match: int):
        self.lookup, self.other, self.min_match = lookup, other, int(min_match)

    def choose(self, s: Signals) -> Decision:
        match = s.probe.get("pld_match", 0.0)
        return Decision(self.lookup if match >= self.min_match else self.other, self.policy, match, self.min_match)


class ScheduleRouter:
    """A given drafter per round (an oracle's choices, replayed live); the last one repeats past the end."""
    needs: frozenset[str] = frozenset()

    def __init__(self, choices: list[str], policy: str = "schedule", eager: bool = False):
        if not choices:
            raise InvalidInput("a schedule router needs at least one choice")
        self.choices, self.policy, self.eager = list(choices), policy, eager

    def choose(self, s: Signals) -> Decision:
        return Decision(self.choices[min(s.round, len(self.choices) - 1)], self.policy)


# -- calibration -----------------------------------------------------------------------------------------------
@dataclass
class Calibration:
    """Thresholds per policy: {policy: {category: threshold, "*": global}} for one target (its `Target.fingerprint`;
    `speclab calibrate`)."""
    thresholds: dict = field(default_factory=dict)
    target: str = ""
    info: dict = field(default_factory=dict)  # how it was made (bench, grid, cost model, command)
    profiles: dict = field(default_factory=dict)  # {hardware profile: thresholds like `thresholds`}, for that machine

    def for_profile(self, profile: str) -> Calibration:
        """The thresholds calibrated under a hardware cost profile (`speclab calibrate --costs`), as a Calibration."""
        return Calibration(self.profiles.get(profile, {}), self.target, self.info)

    def threshold(self, policy: str, category: str | None, target: str | None = None) -> float | None:
        if target is not None and self.target and target != self.target:
            return None  # calibrated for another target
        per = self.thresholds.get(policy, {})
        v = per.get(category) if category is not None else None
        return per.get("*") if v is None else v  # (target: the fingerprint of the target asking)

    def save(self, path: str | Path) -> None:
        d = {"target": self.target, "thresholds": self.thresholds, "info": self.info}
        if self.profiles:
            d["profiles"] = self.profiles
        write_atomic(path, json.dumps(d, indent=1) + "\n")


CALIBRATION_ENV = "SPECLAB_CALIBRATION"  # another calibration file for every router of the process (tests, the app)


def calibration_path() -> Path:
    """The calibration file `speclab calibrate` and the app write and routers read first: $SPECLAB_CALIBRATION (a
    user's file: the app sets it to its --calibration, or to calibration.json beside its trace), else the zoo's."""
    import os
    if os.environ.get(CALIBRATION_ENV):
        return Path(os.environ[CALIBRATION_ENV])
    return zoo_calibration_path()


def zoo_calibration_path() -> Path:
    """The zoo's shipped calibration (`make whiflash` makes it): the fallback of a user's file, never written by
    the app."""
    from speclab.zoo import zoo_dir
    return zoo_dir() / "calibration.json"


def threshold_bound(policy: str, vocab_size: int):
    """The thresholds that can split a policy's signals: entropy in nats from 0 to ln V (no distribution over V
    tokens has more); a predicted Delta AL within +-NEURAL_RANGE tokens a round; the rule's prompt lookup match in
    MIN_MATCH_RANGE tokens."""
    from speclab.checks import Bound
    if policy == "rule":
        return Bound(*MIN_MATCH_RANGE)
    return Bound(0.0, round(math.log(vocab_size), 3)) if policy == "entropy" else Bound(-NEURAL_RANGE, NEURAL_RANGE)


NEURAL_RANGE = 32.0  # a Delta AL beyond this many tokens a round is past any draft shape speclab verifies cheaply


def load_calibration(path: str | Path | None = None) -> Calibration:
    """The calibration file (the zoo's by default); an empty Calibration when there is none."""
    p = Path(path) if path is not None else calibration_path()
    if not p.exists():
        if path is not None:
            raise ModelNotFound(f"no calibration file at {p} (make one with `speclab calibrate`)")
        return Calibration()
    try:
        d = json.loads(p.read_text())
        def per_policy(t):
            return {k: {c: float(v) for c, v in per.items()} for k, per in t.items()}
        return Calibration(per_policy(d["thresholds"]), d.get("target", ""), d.get("info", {}),
                           {name: per_policy(t) for name, t in d.get("profiles", {}).items()})
    except (ValueError, KeyError, AttributeError, TypeError) as e:
        raise InvalidInput(f"{p} is not a speclab calibration file ({type(e).__name__}: {e})") from e


def default_threshold(policy: str, category: str | None, target: str | None = None,
                      mlp: RouterMLP | None = None) -> float:
    """The threshold a router uses when none is given: calibrated (category, then global) in the user's file
    (`calibration_path`), else in the zoo's, else the neural router's hardware-aware one, else `FALLBACKS`'."""
    for path in dict.fromkeys([calibration_path(), zoo_calibration_path()]):
        v = load_calibration(path).threshold(policy, category, target) if path.exists() else None
        if v is not None:
            return v
    return mlp.config.hardware_threshold if policy == "neural" and mlp is not None else FALLBACKS[policy]


# -- routing v2's learned router (`speclab.routing.arms`, `speclab train route`) -----------------------------------
N_RECENT = 2  # recent rounds' accept lengths among its features
LOOKUP_K = 8.0  # prompt lookup's default proposal length: scales its `pld_tokens` signal
MATCH_STEPS = (1, 2, 3, 4, 6, 8, 12, 16)  # prompt lookup's match length as indicators (match >= k)
EXTRA_SCALES = (5.0, 32.0, LOOKUP_K)  # the entropy's, the match's and the proposal length's scales


def arm_extras(entropy, match, tokens, recent: list, last, generated, n_arms: int) -> torch.Tensor:
    """The learned router's features beside the hidden state, for n positions at once (every argument an array of
    n; `recent` N_RECENT arrays, the latest first, -1 where there was no such round; `last` the last round's arm
    index, -1 before the first round): `extras_row` of each. One definition for training (`speclab.train.route`)
    and routing (`ArmRouter`)."""
    rows = [extras_row(e, m, t, [r[i] for r in recent], int(a), g, n_arms)
            for i, (e, m, t, a, g) in enumerate(zip(entropy, match, tokens, last, generated))]
    return torch.tensor(rows, dtype=torch.float32).reshape(len(rows), n_extras(n_arms))


def extras_row(entropy: float, match: float, tokens: float, recent: list, last: int, generated: float,
               n_arms: int) -> list[float]:
    """One position's features (`arm_extras`), in Python floats (a router computes one row every round, right after
    a verification has streamed the weights through the caches, where each numpy call costs several times its warm
    time): entropy, prompt lookup's match and proposal length (each over its scale), the match as steps (match >=
    k: a rule is one of them), the recent accept lengths (-1: none) over prompt lookup's k, the position (log),
    the last arm one-hot (one slot more: none yet). nan counts as 0."""
    e, m, t, g = (_finite(v) for v in (entropy, match, tokens, generated))
    row = [e / EXTRA_SCALES[0], m / EXTRA_SCALES[1], t / EXTRA_SCALES[2], *[float(m >= k) for k in MATCH_STEPS],
           *[max(_finite(r), -1.0) / LOOKUP_K for r in recent], math.log1p(g) / 5.0]
    hot = [0.0] * (n_arms + 1)
    hot[last if last >= 0 else n_arms] = 1.0
    return row + hot


def _finite(v) -> float:
    """v as a float, nan as 0 and an infinity as the largest float (as `np.nan_to_num`)."""
    v = float(v)
    return 0.0 if v != v else max(min(v, sys.float_info.max), -sys.float_info.max)


def n_extras(n_arms: int) -> int:
    return 3 + len(MATCH_STEPS) + N_RECENT + 1 + n_arms + 1


@dataclass
class ArmCosts:
    """Routing v2's round-cost model (`fit_arm_costs`), per arm a: ms = draft[a] + catch-up + verify0 + verify1 x
    (width + 1) + other[a] (+ router_ms in a routed run), the catch-up catchup0[a] + catchup1[a] x backlog where the
    arm's drafters had a backlog. `width[a]`: its mean draft nodes a round (what the router expects; prompt lookup
    alone: its proposal, known at round start)."""
    arms: list
    draft: list
    catchup0: list
    catchup1: list
    other: list
    width: list
    verify0: float
    verify1: float
    router_ms: float = 0.0
    rounds_fitted: int = 0

    def __post_init__(self) -> None:  # the per-arm terms as arrays once: a router reads them every round
        self._terms = {k: np.asarray(getattr(self, k), np.float64)
                       for k in ("draft", "catchup0", "catchup1", "other", "width")}
        self._lookup = np.array([a == LOOKUP for a in self.arms])
        self._lookup_list = [a == LOOKUP for a in self.arms]

    def of(self, arms: list) -> ArmCosts:
        """The same model over some of its arms, in that order (a route's arms among those it was fitted to)."""
        at = [self.arms.index(a) for a in arms]

        def pick(terms: list) -> list:
            return [terms[i] for i in at]
        return ArmCosts(list(arms), pick(self.draft), pick(self.catchup0), pick(self.catchup1), pick(self.other),
                        pick(self.width), self.verify0, self.verify1, self.router_ms, self.rounds_fitted)

    def round_ms(self, a, width, backlog, routed: bool = False) -> np.ndarray:
        """Modeled ms of rounds by arm index `a`, draft nodes `width` and catch-up backlog (arrays alike)."""
        t, a = self._terms, np.asarray(a)
        width, backlog = np.asarray(width, np.float64), np.asarray(backlog, np.float64)
        return self._ms(t["draft"][a], t["catchup0"][a], t["catchup1"][a], t["other"][a], width, backlog) \
            + (self.router_ms if routed else 0.0)

    def _ms(self, draft, catchup0, catchup1, other, width, backlog):
        """The model's one formula, on numpy arrays or on Python floats alike (`round_ms`, `expected_row`)."""
        return draft + (catchup0 + catchup1 * backlog) * (backlog > 0) + self.verify0 + self.verify1 * (width + 1) \
            + other

    def expected_ms(self, pld_tokens, backlogs) -> np.ndarray:
        """What a router expects every arm's round to cost at round starts ([n, A], or [A] for one): its mean draft
        width (prompt lookup alone: its proposal now, `pld_tokens` [n]) and its drafters' backlogs [n, A]."""
        width = np.where(self._lookup, np.asarray(pld_tokens, np.float64)[..., None], self._terms["width"])
        return self.round_ms(np.arange(len(self.arms)), width, backlogs)

    def expected_row(self, pld_tokens: float, backlogs: list) -> list[float]:
        """`expected_ms` of one round start in Python floats: a router calls it every round, right after a
        verification has streamed the weights through the caches, where each numpy call costs several times its
        warm time (ad hoc: 15 us warm, 55-63 after streaming 40 MB, 126 inside a decode)."""
        return [self._ms(self.draft[i], self.catchup0[i], self.catchup1[i], self.other[i],
                         float(pld_tokens) if lookup else self.width[i], float(b))
                for i, (lookup, b) in enumerate(zip(self._lookup_list, backlogs))]


def fit_arm_costs(rounds, arms: list) -> ArmCosts:
    """`ArmCosts` by least squares on live rounds (a DataFrame: arm, width, backlog, draft_ms, catchup_ms, verify_ms,
    other_ms): verification by rows over every round, each arm's drafting and other time as means, its catch-up as a
    line in the backlog over its rounds with one (`robust_line`; a mean where all backlogs are alike)."""
    v = np.linalg.lstsq(np.c_[np.ones(len(rounds)), rounds.width + 1], rounds.verify_ms, rcond=None)[0]
    draft, c0, c1, other, width = [], [], [], [], []
    for a in arms:
        r = rounds[rounds.arm == a]
        draft.append(float(r.draft_ms.mean()) if len(r) else 0.0)
        other.append(float(r.other_ms.mean()) if len(r) else 0.0)
        width.append(float(r.width.mean()) if len(r) else 0.0)
        b = r[r.backlog > 0]
        x, y = b.backlog.to_numpy(float), b.catchup_ms.to_numpy(float)
        line = robust_line(x, y) if len(np.unique(x)) > 1 else (float(y.mean()) if len(y) else 0.0, 0.0)
        c0.append(float(max(line[0], 0.0)))
        c1.append(float(max(line[1], 0.0)))
    return ArmCosts(list(arms), draft, c0, c1, other, width, float(v[0]), float(v[1]), rounds_fitted=len(rounds))


def robust_line(x: np.ndarray, y: np.ndarray, most: int = 1500) -> tuple[float, float]:
    """(intercept, slope) by Theil-Sen: the median of the slopes between pairs of points with different x, then the
    median intercept (on at most `most` points, an even sample). A few slow rounds move it little: in one of two
    trainings least squares gave EAGLE-3's catch-up 0.26 ms a backlog token, where live rounds rise about 0.02."""
    if len(x) > most:
        keep = np.linspace(0, len(x) - 1, most).astype(int)
        x, y = x[keep], y[keep]
    i, j = np.triu_indices(len(x), 1)
    dx = x[j] - x[i]
    slope = float(np.median((y[j] - y[i])[dx != 0] / dx[dx != 0]))
    return float(np.median(y - slope * x)), slope


def arm_backlogs(arms: list, accepted: list, used: list) -> list[float]:
    """Each arm's catch-up backlog at a round start, from the recent rounds (accepted draft tokens and the arm of
    each, oldest first): over its drafters, the tokens committed since each last drafted (its own round included:
    a catch-up hands it that round's tokens too), every recent round where it never drafted."""
    out = [0.0] * len(arms)
    for i, a in enumerate(arms):
        for m in ([] if a == NONE else a.split(JOIN)):
            b = 0
            for acc, arm in zip(reversed(accepted), reversed(used)):
                b += acc + 1
                if arm is not None and m in arm.split(JOIN):
                    break
            out[i] += b
    return out


@dataclass
class ArmRouterConfig:
    hidden_size: int  # d of the target's final hidden state
    arms: list  # the arms it predicts accept lengths for, in order ("none" included: predicted 0)
    costs: dict  # the arms' `ArmCosts` (as a dict), fitted to live rounds when it was trained (`machine`)
    width: int = 64
    dropout: float = 0.1
    target: str = ""  # the fingerprint of the target it was trained for
    machine: str = ""  # where the costs were measured (CPU, dtype)
    derivation: dict = field(default_factory=dict)  # how they were measured


class ArmRouterMLP(nn.Module):
    """[h ; extras] -> width -> GELU -> dropout -> one predicted accept length per arm (draft tokens accepted)."""

    def __init__(self, config: ArmRouterConfig):
        super().__init__()
        self.config = config
        a, f = len(config.arms), config.hidden_size + n_extras(len(config.arms))
        self.register_buffer("shift", torch.zeros(f))  # the inputs standardised: (x - shift) / scale, from the
        self.register_buffer("scale", torch.ones(f))  # training rows (`standardise`)
        self.net = nn.Sequential(nn.Linear(f, config.width), nn.GELU(), nn.Dropout(config.dropout),
                                 nn.Linear(config.width, a))

    def standardise(self, h: torch.Tensor, extras: torch.Tensor) -> None:
        """Every input to mean 0 and standard deviation 1 over the training rows (a constant one left as it is)."""
        x = torch.cat([h.float(), extras.float()], -1)
        self.shift.copy_(x.mean(0))
        self.scale.copy_(x.std(0).clamp(min=1e-3))

    def forward(self, h: torch.Tensor, extras: torch.Tensor) -> torch.Tensor:
        return self.net((torch.cat([h.float(), extras.float()], -1) - self.shift) / self.scale)

    @torch.no_grad()
    def folded(self) -> tuple[torch.Tensor, ...]:
        """The eval-mode forward's weights with the standardisation folded into the first layer: (W1 / scale over the
        hidden state's inputs, the same over the extras', b1 - (W1 / scale) shift, W2, b2), fp32, on its device. One
        row is then two products and a GELU (`ArmRouter`: its own time is a router's cost every round)."""
        w1 = self.net[0].weight / self.scale
        b1 = self.net[0].bias - w1 @ self.shift
        d = self.config.hidden_size
        w2, b2 = self.net[-1].weight.clone(), self.net[-1].bias.clone()
        return w1[:, :d].contiguous(), w1[:, d:].contiguous(), b1, w2, b2

    def save(self, path: str | Path, extra: dict | None = None) -> None:
        from speclab.drafters.checkpoint import save_checkpoint
        save_checkpoint(self, {**self.config.__dict__, "kind": "speclab route router", **(extra or {})}, path,
                        dtype=torch.float32)


def load_arm_router(path: str | Path, target=None):
    """A trained routing v2 router (config.json + model.safetensors), checked against the target."""
    from speclab.drafters.checkpoint import load_strict, read_checkpoint
    where, cfg, state = read_checkpoint(path, "route router")
    if cfg.get("kind") != "speclab route router":
        raise ModelNotFound(f"{path}: config.json is not a speclab route router's (train one: speclab train route)")
    m = ArmRouterMLP(ArmRouterConfig(**{k: cfg[k] for k in ArmRouterConfig.__dataclass_fields__ if k in cfg}))
    load_strict(m, {k: v.float() for k, v in state.items()}, where, "route router")
    return _for_target(m, path, target, "route router", "speclab train route")


class ArmRouter:
    """Routing v2's learned router: each round, every arm's predicted accept length (the MLP on the target's hidden
    state, its entropy, prompt lookup's match, the recent rounds and the position) over its modeled round cost, the
    best predicted tokens per ms wins. `arms`: the route's arms (a subset of those the model knows, in its order);
    `costs`: the round costs over the model's arms (None: those it shipped with)."""
    policy = "learned"
    needs = frozenset({"hidden", "entropy", "probe"})
    eager = False

    def __init__(self, mlp: ArmRouterMLP, arms: list[str], costs: ArmCosts | None = None):
        known = list(mlp.config.arms)
        self.mlp, self.known, self.arms = mlp, known, list(arms)
        self.idx = torch.tensor([known.index(a) for a in arms])
        self.names = [None if a == NONE else a for a in arms]
        # over the router's own arms: measured on this machine (`speclab.routing.local_costs`), else its shipped ones
        self.costs = (costs or ArmCosts(**mlp.config.costs)).of(self.arms)
        self.none = np.array([a == NONE for a in arms])
        w1h, w1x, b1, w2, b2 = mlp.folded()
        self.w1h, self.w1x, self.b1 = w1h, w1x, b1
        self.w2, self.b2 = w2[self.idx.to(w2.device)], b2[self.idx.to(b2.device)]  # the route's arms only

    def round_ms(self, s: Signals) -> list[float]:
        """Each arm's modeled round time now (`ArmCosts.expected_row`)."""
        return self.costs.expected_row(s.probe.get("pld_tokens", 0.0),
                                       arm_backlogs(self.arms, s.accepted, s.drafters))

    @torch.inference_mode()
    def choose(self, s: Signals) -> Decision:
        # a handful of ops a round (the features and costs in Python floats, the MLP in three products): each runs
        # right after a verification streamed the weights through the caches, at several times its warm cost
        ms = self.round_ms(s)
        if s.hidden is None:  # no row yet (a one-token prompt's first round): the cheapest drafting arm
            return Decision(self.names[min((m, i) for i, m in enumerate(ms) if not self.none[i])[1]], self.policy)
        last = self.known.index(s.drafters[-1] or NONE) if s.drafters and (s.drafters[-1] or NONE) in self.known \
            else -1
        recent = [s.accepted[-1 - i] if len(s.accepted) > i else -1 for i in range(N_RECENT)]
        x = extras_row(s.entropy, s.probe.get("pld_match", 0.0), s.probe.get("pld_tokens", 0.0), recent, last,
                       s.generated, len(self.known))
        h = s.hidden.to(self.b1.device, torch.float32)  # live: already there; replayed: a profile's CPU row
        z = torch.addmv(torch.addmv(self.b1, self.w1x, torch.tensor(x, device=self.b1.device)), self.w1h, h)
        pred = torch.addmv(self.b2, self.w2, F.gelu(z)).tolist()  # the MLP, folded
        i = max(range(len(ms)), key=lambda j: predicted_rates(pred[j], ms[j], self.none[j]))
        return Decision(self.names[i], self.policy, max(pred[i], 0.0))  # signal: its predicted accept length


def predicted_rates(pred, ms, none):
    """Each arm's predicted tokens per ms ([.., A]): its predicted accept length (at least 0; `none`'s is 0) plus
    the target's own token, over its expected round time. What `ArmRouter` maximises (one arm's numbers at a time,
    `none` a numpy bool) and what `speclab train route` trains it on (`objective="rate"`: torch tensors, with
    gradients, `none` a boolean mask of the arms), one definition for both."""
    return (pred * (pred > 0) * ~none + 1) / ms
