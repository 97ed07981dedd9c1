"""`DrafterPool`: the drafters of one decode and what each of them has been handed of the committed sequence.

A drafter sees the committed sequence only through `reset` (at prefill: the prompt) and `catch_up` (the tokens
committed since it last looked), token x_t paired with the target's feature f_{t-1}, in the columns of its own
layers. Catch-up is lazy: only the drafter the router chose digests its backlog, in one call, when it is chosen;
the others' backlog grows as views into the engine's buffers. An eager router brings every drafter up to date
every round instead (the naive scheme WhiFlash measures lazy catch-up against).

`Committed` (the engine's committed sequence: token ids and features) is defined here, beside the pool that reads
it, so the pool needs nothing from the engine (the engine imports the pool, never the reverse).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from speclab.core.protocol import Drafter
from speclab.errors import InvalidInput

if TYPE_CHECKING:
    from speclab.core.target import Target


class Committed:
    """The committed sequence, preallocated once per decode: token ids (CPU) and, when drafters ask for target
    layers, the target's features of those tokens (target device). `n` tokens; features for the first `n_feats`."""

    def __init__(self, prompt_ids: torch.Tensor, capacity: int, feat_dim: int, device, dtype):
        self.ids = torch.zeros(capacity, dtype=torch.long)
        self.capacity = capacity  # the most tokens the decode commits: prompt + max_new_tokens
        self.n = prompt_ids.numel()
        self.ids[: self.n] = prompt_ids
        self.feats = torch.zeros(capacity, feat_dim, dtype=dtype, device=device) if feat_dim else None
        self.n_feats = 0

    def append(self, new: torch.Tensor) -> None:
        self.ids[self.n : self.n + new.numel()] = new
        self.n += new.numel()

    def set_features(self, start: int, feats: torch.Tensor) -> None:
        """Features of the tokens from `start` on (contiguous with those already there)."""
        assert self.feats is not None, "no drafter asked for target layers"
        self.feats[start : start + feats.shape[0]] = feats
        self.n_feats = start + feats.shape[0]

    def drop_features(self) -> None:
        """Keep no features from now on (a batched request whose drafters were released)."""
        self.feats, self.n_feats = None, 0


def feature_layers(target: Target, drafters: dict[str, Drafter]) -> tuple[int, ...]:
    """The union of the target layers the drafters draft from, checked against the target."""
    layers = sorted({i for d in drafters.values() for i in getattr(d, "layers", ())})
    bad = [i for i in layers if not 0 <= i < target.num_layers]
    if bad:
        raise InvalidInput(f"a drafter asks for target layer(s) {bad}, but the target has {target.num_layers} layers "
                           f"(0..{target.num_layers - 1})")
    return tuple(layers)


def feature_columns(wanted: tuple[int, ...], layers: tuple[int, ...], d: int, device) -> torch.Tensor | None:
    """Column index of a drafter's layers in the concatenated features (None: it wants them all, in order, or none)."""
    if not wanted or tuple(wanted) == layers:
        return None
    return torch.cat([torch.arange(layers.index(i) * d, (layers.index(i) + 1) * d) for i in wanted]).to(device)


class DrafterPool:
    """The drafters by name; `layers`: the union of the target layers they draft from (what every target forward
    returns as features); per drafter, `seen`: committed tokens it has been handed, and `unread`: prompt tokens
    `reset` handed it that it has not digested yet (until its first catch-up)."""

    def __init__(self, drafters: dict[str, Drafter], target: Target):
        self.drafters = drafters
        self.layers = feature_layers(target, drafters)
        d, dev = target.hidden_size, target.device
        self.cols = {name: feature_columns(getattr(dr, "layers", ()), self.layers, d, dev)
                     for name, dr in drafters.items()}
        self.seen: dict[str, int] = {}
        self.unread: dict[str, int] = {}

    def features(self, name: str, seq: Committed, a: int, b: int) -> torch.Tensor | None:
        """The target's features of tokens a..b-1, in the columns of drafter `name`'s layers (None: it has none)."""
        if not getattr(self.drafters[name], "layers", ()) or seq.feats is None:
            return None
        cols = self.cols[name]
        return seq.feats[a:b] if cols is None else seq.feats[a:b].index_select(1, cols)

    def reset(self, seq: Committed) -> None:
        """A new sequence (at prefill): every drafter is handed the prompt, cheaply (it digests it in its first
        catch-up), with the features of all prompt tokens but the last, and the decode's capacity (`seq`'s:
        prompt + max_new_tokens), so its caches are sized once."""
        n = seq.n
        for name, d in self.drafters.items():
            d.reset(seq.ids[:n], self.features(name, seq, 0, n - 1), capacity=seq.capacity)
            self.seen[name], self.unread[name] = n, n - 1

    def catch_up(self, name: str | None, seq: Committed, eager: bool = False) -> int:
        """Drafter `name` (None: the target steps alone) digests, in one call, every token committed since it last
        looked, x_t with f_{t-1}; `eager`: every drafter does, every round. Returns the chosen drafter's backlog:
        the tokens it was handed, and on its first turn the prompt `reset` handed it."""
        backlog = 0
        for nm in [n for n in self.drafters if not self.members(n)] if eager else [name]:
            if nm is None:
                continue
            for own in self.members(nm) or (nm,):
                ids, feats, handed = self.hand(own, seq)
                self.drafters[own].catch_up(ids, feats)
                if nm == name:
                    backlog += handed
        return backlog

    def members(self, name: str) -> tuple[str, ...]:
        """The drafters a composite drafter is made of (`speclab.core.protocol.Composite`); () for any other."""
        return tuple(getattr(self.drafters[name], "members", ()))

    def probe(self, seq: Committed) -> dict[str, float]:
        """Every probing drafter's round-start signals (`speclab.core.protocol.Probing`), each caught up first."""
        out: dict[str, float] = {}
        for name, d in self.drafters.items():
            if hasattr(d, "probe"):
                ids, feats, _ = self.hand(name, seq)
                d.catch_up(ids, feats)
                out.update(d.probe())
        return out

    def hand(self, name: str, seq: Committed) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """What drafter `name` has not been handed yet, marked handed: (tokens, their features, the backlog count:
        those tokens and, on its first turn, the prompt `reset` handed it). The caller makes it `catch_up` on them
        (a batch of requests: several drafters in one call, `speclab.core.batch`)."""
        s = self.seen[name]
        handed = seq.n - s + self.unread.pop(name, 0)
        self.seen[name] = seq.n
        return seq.ids[s : seq.n], self.features(name, seq, s - 1, seq.n - 1), handed
