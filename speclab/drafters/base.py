"""The drafter protocol: one small interface every drafter implements.

A drafter keeps its own state (KV cache, n-gram index, ...) and sees the committed sequence only
through `reset` and `catch_up`, so a router can leave it idle for a few rounds and it catches up lazily.
"""
from __future__ import annotations

from typing import Protocol

import torch

from speclab.sampling import Sampling
from speclab.tree import DraftTree


class Drafter(Protocol):
    name: str

    def reset(self, prompt_ids: torch.Tensor) -> None:
        """Start a new sequence whose committed tokens are `prompt_ids` (the last one is the pending root)."""

    def catch_up(self, backlog: torch.Tensor) -> None:
        """Tokens committed since this drafter last saw the sequence (its own accepted tokens included)."""

    def propose(self, max_depth: int, sampling: Sampling, generator: torch.Generator | None) -> DraftTree:
        """A draft tree rooted at the last committed token, no deeper than `max_depth`."""

    def commit(self, tree: DraftTree, accepted: torch.Tensor) -> None:
        """Which nodes of the last proposal were accepted; drop speculative state."""
