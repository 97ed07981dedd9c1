"""A draft length that follows how the last proposals fared: Hugging Face's heuristic schedule
(`num_assistant_tokens_schedule="heuristic"` of its assisted generation): two tokens more after a proposal accepted
whole, one fewer (down to 1) after a rejection, never more than the drafter's own length. Under sampling most long
proposals are cut early (a drafted token is accepted with min(1, p/q), a looked-up one with p), and every drafted
token costs a drafter call or a verification row, so the default adapts under sampling only (`adaptive`: "sampled").
The length depends on past rounds only, so the decode stays lossless. Used by prompt lookup and by EAGLE-3's chains
(a drafter's `Param("adaptive", ...)`: `adaptive_param`).

`PaysRouter` goes one step further, to no draft at all: a drafted round costs about `pays` plain target steps on
this machine (its drafter calls and its wider verification), so it pays only while it brings at least `pays` tokens
(its accepted drafts and the target's own). The router keeps a moving average of what the drafter's rounds brought
and lets the target step alone (`Decision(None)`) while that average is below `pays`: one plain round, then a probe,
and after each probe that still does not pay a stand-down fourfold longer (at most `MOST_WAIT` rounds, or `probe`).
`probe` plain rounds open the decode, before its first probe: 0 (draft from the first round) unless the drafter is
measured not to pay at T > 0 at all (SpecBlock's and ConFu's cards), where a probe costs 5-10 plain steps with its
catch-up, so that probing at round 0, 2, 7, 24 and 89 as before cost 15-20% of a 128-token decode. Every
decision reads past rounds only (non-anticipating), so the decode stays lossless, greedy or sampled; the same rounds
give the same decisions, so a seeded decode and its replay repeat. A model drafter's method takes it as its `pays`
parameter (`pays_params`, with `probe`), measured per drafter at T > 0 (the model cards), 0 (off) at T = 0."""
from __future__ import annotations

import math

from speclab.checks import Bound
from speclab.core.protocol import Decision, Signals
from speclab.core.sampling import Sampling
from speclab.drafters.registry import Param

ADAPTIVE = ("off", "sampled", "always")  # where the proposal length adapts: never, at T > 0, always


class LengthSchedule:
    """The next proposal's length, at most `most`, adapted where `adaptive` says (`ADAPTIVE`)."""

    def __init__(self, most: int, adaptive: str = "off"):
        if adaptive not in ADAPTIVE:
            raise ValueError(f"adaptive must be one of {', '.join(ADAPTIVE)} (got {adaptive!r})")
        self.most, self.adaptive, self.now = most, adaptive, most

    def reset(self) -> None:
        self.now = self.most

    def length(self, sampling: Sampling) -> int:
        """The next proposal's length under `sampling`: the adapted one where the schedule applies, else `most`."""
        adapt = self.adaptive == "always" or (self.adaptive == "sampled" and not sampling.greedy)
        return self.now if adapt else self.most

    def update(self, drafted: int, accepted: int) -> None:
        """After a proposal of `drafted` tokens of which `accepted` were accepted (none drafted: no change)."""
        if self.adaptive != "off" and drafted:
            self.now = min(self.most, self.now + 2) if accepted == drafted else max(1, self.now - 1)


def adaptive_param(default: str, what: str) -> Param:
    return Param("adaptive", default, choices=ADAPTIVE,
                 help=f"where {what} follows how the last proposals fared (+2 after one accepted whole, -1 after a "
                 "rejection, down to 1; Hugging Face's heuristic schedule): off, sampled (T > 0), always")


PAYS_EMA = 0.25  # the weight of the newest drafted round in the moving average of the tokens drafted rounds brought
WAIT_GROWTH = 4  # each probe that still does not pay makes the next stand-down this many times longer
MOST_WAIT = 128  # the longest stand-down between two probes, in rounds (a probe costs up to 6 plain steps here)


class PaysRouter:
    """Drafter `name` while its drafted rounds bring at least `pays` tokens on average, else the target alone: one
    plain round after the average falls below `pays`, then a probe, and after each probe that does not pay a stand-down
    `WAIT_GROWTH` times longer (at most `MOST_WAIT`), until one pays. The state is the decode's: it starts afresh at
    round 0."""
    policy = "pays"
    needs: frozenset[str] = frozenset()
    eager = False

    def __init__(self, name: str, pays: float, probe: int = 0):
        if not pays > 0 or probe < 0:
            raise ValueError(f"pays must be > 0 (got {pays}; 0 is a FixedRouter) and probe >= 0 (got {probe})")
        self.name, self.pays, self.probe = name, float(pays), int(probe)
        self.most = max(MOST_WAIT, self.probe)  # the longest stand-down between two probes
        self.ema: float | None = None
        self.wait = self.idle = 0  # wait: plain rounds before the next probe (0: drafting pays)

    def choose(self, s: Signals) -> Decision:
        if s.round == 0:  # a new decode: `probe` plain rounds before the first probe
            self.ema, self.wait, self.idle = None, self.probe, 0
        elif s.drafters and s.drafters[-1] is not None:  # the last round drafted: what it brought
            got = s.accepted[-1] + 1
            self.ema = got if self.ema is None else (1 - PAYS_EMA) * self.ema + PAYS_EMA * got
            # paying: no wait; else 1 round after paying rounds, then WAIT_GROWTH times the last wait
            self.wait = 0 if self.ema >= self.pays else min(WAIT_GROWTH * self.wait, self.most) or 1
            self.idle = 0
        else:
            self.idle += 1
        draft = self.wait == 0 or self.idle >= self.wait
        return Decision(self.name if draft else None, self.policy,
                        math.nan if self.ema is None else self.ema, self.pays)


def pays_params(sampled: float, probe: int = 0) -> tuple[Param, Param]:
    """A model drafter's `pays` and `probe` (`PaysRouter`): `pays` off (0) greedy, `sampled` at T > 0 (0: off there
    too), measured by `speclab grid --method NAME --grid "pays=0,2,3,4" --temperature T`; `probe`, the plain rounds
    before the first probe, `probe` at T > 0 (the drafter module says what it measured; no default grid: they matter
    at T > 0 only, and would multiply every greedy grid)."""
    return (Param("pays", 0.0, lambda t: Bound(0.0, 64.0), sampled=sampled or None,
                  help="stand down (the target steps alone) while the drafter's rounds bring fewer tokens than this on "
                  "average: what a drafted round costs in plain steps (0 = always draft; default 0 at T = 0 and the "
                  "drafter's measured one at T > 0, on its model card)"),
            Param("probe", 0, lambda t: Bound(0, 4096), sampled=probe or None,
                  help="with pays > 0: plain rounds before the first probe of the drafter (and the longest stand-down "
                  f"between two probes, if above {MOST_WAIT}); default 0 (draft from the first round), at T > 0 the "
                  "drafter's measured one"))
