"""Routers: which drafter drafts the next round. Consulted once per round with the round's `Signals`; every
`Decision` (policy, signal, threshold, choice) is written to the trace's `router_decisions`. The protocol they
implement (`Router`, `Signals`, `Decision`) and `FixedRouter` live in `speclab.core.protocol`.

Policies (WhiFlash, ../shared/papers/whiflash.txt, section 3.3):
- `fixed`: one drafter, always (every single-drafter method; `speclab.core.protocol.FixedRouter`).
- `entropy` (WhiFlash-Entropy): H_t, the entropy of the target distribution that produced the last committed
  token; the autoregressive drafter (EAGLE-3) when H_t > tau_entropy, else the parallel one (DFlash).
- `neural` (WhiFlash-Neural): an MLP on the target's final-norm hidden state h_t predicts
  Delta AL_t = AL_eagle3 - AL_dflash; EAGLE-3 when the prediction > tau_neural.
- `schedule`: a given drafter per round (what an oracle chose, replayed live: `speclab.routing.replay`).

Thresholds come from `data/zoo/calibration.json` (`speclab calibrate`) when none is given: the category's when
the run's category is known and calibrated, the global one otherwise; a neural router falls back to its own
hardware-aware threshold (derived from measured latencies when it was trained), an entropy router to
`ENTROPY_FALLBACK`.

`eager` (the naive scheme WhiFlash compares lazy catch-up with): the engine brings every drafter up to date every
round, not only the chosen one.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from speclab.core.protocol import Decision, Signals
from speclab.errors import InvalidInput, ModelNotFound
from speclab.files import write_atomic

EAGLE3, DFLASH = "eagle3", "dflash"  # WhiFlash's m_a (autoregressive) and m_d (diffusion / parallel) drafters
ENTROPY_FALLBACK = 1.0  # nats: the entropy threshold when nothing is calibrated for the target


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


def load_router(path: str | Path, target=None) -> RouterMLP:
    """A trained router (config.json + model.safetensors), checked against the target's hidden size."""
    from speclab.drafters.checkpoint import load_strict, read_checkpoint
    where, cfg, state = read_checkpoint(path, "neural router")
    known = {k: cfg[k] for k in RouterConfig.__dataclass_fields__ if k in cfg}
    if "hidden_size" not in known or "width" not in known:
        raise ModelNotFound(f"{path}: config.json is not a speclab neural router's (no hidden_size / width)")
    m = RouterMLP(RouterConfig(**known))
    load_strict(m, {k: v.float() for k, v in state.items()}, where, "neural router")
    if target is not None:
        if m.config.target and m.config.target != target.fingerprint:
            raise InvalidInput(f"the neural router at {path} was trained for another target (fingerprint "
                               f"{m.config.target}, this one's is {target.fingerprint}): train one for this target "
                               "(speclab train router)")
        if target.hidden_size != m.config.hidden_size:
            raise InvalidInput(f"the neural router at {path} reads hidden states of size {m.config.hidden_size}, "
                               f"the target's are {target.hidden_size}: train one for this target "
                               "(speclab train router)")
        m.to(target.device)
    m.name = str(path)
    return m.eval().requires_grad_(False)


class NeuralRouter:
    """WhiFlash-Neural: EAGLE-3 when the MLP's predicted Delta AL on h_t > threshold, else DFlash."""
    policy = "neural"
    needs = frozenset({"hidden"})

    def __init__(self, mlp: RouterMLP, threshold: float, eager: bool = False):
        self.mlp, self.threshold, self.eager = mlp, float(threshold), bool(eager)

    @torch.inference_mode()
    def choose(self, s: Signals) -> Decision:
        pred = float(self.mlp(s.hidden)) if s.hidden is not None else math.nan
        return Decision(pick(pred, self.threshold), self.policy, pred, self.threshold)


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
    tokens has more); a predicted Delta AL within +-NEURAL_RANGE tokens a round."""
    from speclab.checks import Bound
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
    (`calibration_path`), else in the zoo's, else the neural router's hardware-aware one, else ENTROPY_FALLBACK."""
    for path in dict.fromkeys([calibration_path(), zoo_calibration_path()]):
        v = load_calibration(path).threshold(policy, category, target) if path.exists() else None
        if v is not None:
            return v
    return mlp.config.hardware_threshold if policy == "neural" and mlp is not None else ENTROPY_FALLBACK
