"""The protocols of a decode round and the types it passes: the drafter protocol (v2) every drafter implements,
and the router protocol (`Router`, the `Signals` it sees, the `Decision` it returns) with `FixedRouter`, the
engine's default. They live in core so the engine imports nothing above it: drafters (`speclab.drafters`) and
routers (`speclab.routing.routers`) implement them.

Drafters: one small interface every drafter implements.

A drafter keeps its own state (KV cache, n-gram index, ...) and sees the committed sequence only through
`reset` and `catch_up`, so a router can leave it idle for a few rounds and it catches up lazily.

Features: a drafter lists the target layers it drafts from in `layers` (the engine asks the target for the
union and hands each drafter its own columns, [rows, len(layers) * d]). Tokens and features come paired as
EAGLE pairs them: token x_t with f_{t-1}, the target's feature of the token *before* it (the state that
predicted x_t). So at any round start a drafter can know every committed token and the feature of every
token but the last (the pending root), in deferred and non-deferred mode alike.

Timing: the work of digesting tokens (a draft model's KV for the backlog, say) belongs in `catch_up`, which
the engine times as the round's "catchup" phase (the switch cost of a router is measured there), not in the
first `propose`.

Round hooks (optional, `RoundHooks`): a drafter that needs more of the target than features (ConFu's contemplate
rows) defines any of `before_catch_up` (target work of its own, timed as catch-up), `extra_rows` (rows riding in
the verification call) and `after_verify` (their final-norm state at commit); the engine calls them for the round's
drafter and knows no drafter by name.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from speclab.core.sampling import Sampling
from speclab.core.tree import DraftTree


class Drafter(Protocol):
    name: str
    layers: tuple[int, ...]  # target decoder layers whose outputs it drafts from (empty: tokens only)

    def reset(self, prompt_ids: torch.Tensor, prompt_features: torch.Tensor | None,
              capacity: int | None = None) -> None:
        """Start a new sequence: committed tokens `prompt_ids` [n] (the last is the pending root) and
        `prompt_features` [n - 1, F] paired with prompt_ids[1:] (None when `layers` is empty). Cheap: the real
        work waits for the first `catch_up`, which the engine calls before the first `propose`. `capacity`: the
        most committed tokens the sequence will hold (the decode's prompt + max_new_tokens): a drafter with a cache
        sizes it once for that plus its largest draft, so nothing grows during the decode; None (a caller that
        drives a drafter by hand with no decode length) leaves the cache at its default size, growing on demand."""

    def catch_up(self, ids: torch.Tensor, features: torch.Tensor | None) -> None:
        """Tokens committed since this drafter last looked [m] (its own accepted drafts included, then the
        target's token, then whatever other drafters produced), with `features` [m, F]: row j is the target's
        feature of the token before ids[j]. Possibly empty (the first round)."""

    def propose(self, max_depth: int, sampling: Sampling, generator: torch.Generator | None) -> DraftTree:
        """A draft tree rooted at the last committed token, no deeper than `max_depth`."""

    def commit(self, tree: DraftTree, accepted: torch.Tensor) -> None:
        """Which nodes of the last proposal were accepted (path order; a prefix of it when the sequence ended
        inside it). Drop speculative state; keep what is valid (the accepted draft KV) so the next `catch_up`
        need not recompute it."""


@dataclass(frozen=True)
class RoundView:
    """What a drafter's round hooks (`RoundHooks`) see of the decode, from the catch-up phase to the verification:
    the target and its KV cache (every committed token, or every one but the pending root when deferred), the
    committed tokens (the last is the round's root), how many of them have target features (the first
    `featured`), the target's features of tokens a..b-1 in the drafter's own columns, and whether extra rows can
    ride in this target's verification call (the lean forward outside exact mode)."""
    target: Any
    cache: Any
    tokens: int
    featured: int
    features: Callable[[int, int], torch.Tensor | None]
    rows_ride: bool


@dataclass(frozen=True)
class ExtraRows:
    """Rows a drafter asks to ride in a round's verification call (`RoundHooks.extra_rows`): one after each
    verification row (the root's and each node's), given as an input embedding, not a token: it sits at the position
    after its row, sees what its row sees and that row, plus `keys` / `values` that no other row sees, and itself;
    it writes nothing to the cache and never changes the target's own rows (`speclab.core.lean.ConRows`)."""
    emb: torch.Tensor  # [1, d]: every row's input embedding (broadcast), or [rows, d]
    keys: torch.Tensor  # [target layers, kv heads, s, head dim]: post-RoPE keys only these rows see
    values: torch.Tensor  # the same, values


class RoundHooks(Protocol):
    """Optional per-round hooks of a drafter: the engine calls each one the round's chosen drafter defines (and no
    other drafter's), so a drafter may do target work of its own and have extra rows ride in the verification
    call without the engine knowing it by name (ConFu's contemplate rows, `speclab.drafters.confu`)."""

    def before_catch_up(self, view: RoundView) -> None:
        """In the catch-up phase, before its `catch_up`: work of its own on the target (each call counted)."""

    def extra_rows(self, view: RoundView) -> ExtraRows | None:
        """In the verification phase: rows to ride in the verification call (None: none; `view.rows_ride` False:
        the target cannot carry them, ask for none)."""

    def after_verify(self, state: torch.Tensor, tokens: int) -> None:
        """At commit, when its extra rows rode and the decode goes on: the final-norm state [1, d] of the extra
        row after the row that drew the round's last token, i.e. the row after the first `tokens` committed
        tokens."""


class Probing(Protocol):
    """Optional: a drafter that offers a router cheap signals of its own at round start (prompt lookup: how long
    its current match is). The pool catches it up first (`speclab.core.pool.DrafterPool.probe`)."""

    def probe(self) -> dict[str, float]:
        """Named signals of the sequence it has caught up on (names prefixed with the drafter's)."""


class Observing(Protocol):
    """Optional: a drafter that learns from the target's distribution at each of its rounds' root rows under sampling
    (prompt lookup's gate: the acceptance probability of the token it found, whether it proposed it or not). The engine
    hands it over at commit, for the round's drafter only; it reads past rounds only, so the decode stays lossless."""

    def observe(self, probs: torch.Tensor) -> None:
        """The target's distribution [V] at the round's root row (what the round's first draft token was, or would
        have been, tested against), under the decode's sampling."""


class Composite(Protocol):
    """Optional: a drafter made of other drafters of the same decode (a merged arm, `speclab.routing.arms`), named
    in `members`: the pool catches the members up, each as itself, and the composite's own `catch_up` does nothing."""
    members: tuple[str, ...]


class BatchDrafting(Protocol):
    """Optional: a drafter class that drafts for a batch of requests in one model call (`speclab.core.batch`), each
    request with its own drafter instance of one model. Both are static: they take the instances."""

    @staticmethod
    def catch_up_many(drafters: list, ids: list[torch.Tensor], features: list) -> None:
        """Each drafter's `catch_up(ids[j], features[j])`, in one call."""

    @staticmethod
    def propose_many(drafters: list, depths: list[int], sampling: Sampling,
                     generators: list) -> list[DraftTree]:
        """Each drafter's `propose(depths[j], sampling, generators[j])`, in one call."""


@dataclass
class Signals:
    """What a router sees at the start of a round (computed only when its `needs` ask for it)."""
    round: int
    entropy: float = math.nan  # nats: entropy of the target distribution (T = 1) that produced the last committed token
    hidden: torch.Tensor | None = None  # [d] final-norm hidden state of that position (what the LM head saw)
    accepted: list[int] = field(default_factory=list)  # accepted draft tokens of the recent rounds, oldest first
    drafters: list[str | None] = field(default_factory=list)  # which drafter drafted each of those rounds
    # (needs "probe") the drafters' own round-start signals, each caught up first (`Probing`; prompt lookup's
    # current match length and proposal length)
    probe: dict[str, float] = field(default_factory=dict)
    generated: int = 0  # tokens committed since the prompt


@dataclass
class Decision:
    choice: str | None  # drafter name; None = the target steps alone
    policy: str
    signal: float = math.nan  # the value the policy compared (nan for policies without one)
    threshold: float = math.nan


class Router(Protocol):
    policy: str
    needs: frozenset[str]  # of "entropy", "hidden", "probe": the signals the engine must compute for it
    eager: bool  # keep every drafter caught up every round (False: only the chosen one, lazily)

    def choose(self, signals: Signals) -> Decision:
        ...


class FixedRouter:
    """Always the same drafter."""
    policy = "fixed"
    needs: frozenset[str] = frozenset()
    eager = False

    def __init__(self, name: str | None):
        self.name = name

    def choose(self, signals: Signals) -> Decision:
        return Decision(self.name, self.policy)
