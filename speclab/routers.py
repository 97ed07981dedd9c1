"""Routers: which drafter drafts the next round. Consulted once per round with the round's `Signals`; every
`Decision` (policy, signal, threshold, choice) is written to the trace's `router_decisions`.

`fixed` (one drafter, always) is the only policy so far; the entropy and neural policies of WhiFlash come next.
A method in `speclab.methods` builds its drafters and its router together.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class Signals:
    """What a router sees at the start of a round (computed only when its `needs` ask for it)."""
    round: int
    entropy: float = math.nan  # nats: entropy of the target distribution (T = 1) that produced the last committed token
    hidden: torch.Tensor | None = None  # [d] final-norm hidden state of that position (what the LM head saw)
    accepted: list[int] = field(default_factory=list)  # accepted draft tokens of the recent rounds, oldest first
    drafters: list[str | None] = field(default_factory=list)  # which drafter drafted each of those rounds


@dataclass
class Decision:
    choice: str | None  # drafter name; None = the target steps alone
    policy: str
    signal: float = math.nan  # the value the policy compared (nan for policies without one)
    threshold: float = math.nan


class Router(Protocol):
    policy: str
    needs: frozenset[str]  # of "entropy", "hidden": the signals the engine must compute for it

    def choose(self, signals: Signals) -> Decision:
        ...


class FixedRouter:
    """Always the same drafter."""
    policy = "fixed"
    needs: frozenset[str] = frozenset()

    def __init__(self, name: str | None):
        self.name = name

    def choose(self, signals: Signals) -> Decision:
        return Decision(self.name, self.policy)
