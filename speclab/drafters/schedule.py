"""A draft length that follows how the last proposals fared: Hugging Face's heuristic schedule
(`num_assistant_tokens_schedule="heuristic"` of its assisted generation): two tokens more after a proposal accepted
whole, one fewer (down to 1) after a rejection, never more than the drafter's own length. Under sampling most long
proposals are cut early (a drafted token is accepted with min(1, p/q), a looked-up one with p), and every drafted
token costs a drafter call or a verification row, so the default adapts under sampling only (`adaptive`: "sampled").
The length depends on past rounds only, so the decode stays lossless. Used by prompt lookup and by EAGLE-3's chains
(a drafter's `Param("adaptive", ...)`: `adaptive_param`)."""
from __future__ import annotations

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
