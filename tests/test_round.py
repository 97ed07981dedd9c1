"""The steps of a decode round on their own: the cut at EOS / max tokens, the drafter pool's lazy and eager
catch-up, and the phase clock's contiguous laps."""
from types import SimpleNamespace

import pytest
import torch

from speclab.core import engine
from speclab.core.engine import PHASES, Committed, PhaseClock, cut
from speclab.core.pool import DrafterPool

T = torch.tensor


# ---- cut: the round's tokens (accepted drafts, then the target's token) at EOS and at max tokens ----

def test_cut_keeps_everything_without_eos_and_with_room():
    new, acc, at_eos = cut(T([5, 7, 8, 4]), T([0, 1, 2]), room=10, eos=T([9]))
    assert new.tolist() == [5, 7, 8, 4] and acc.tolist() == [0, 1, 2] and not at_eos


def test_cut_at_an_eos_inside_the_accepted_drafts_cuts_tokens_and_nodes():
    new, acc, at_eos = cut(T([5, 9, 7, 3]), T([0, 2, 5]), room=10, eos=T([9]))  # tree nodes: not a prefix
    assert new.tolist() == [5, 9] and acc.tolist() == [0, 2] and at_eos


def test_cut_at_the_first_of_several_eos_ids():
    new, acc, at_eos = cut(T([5, 7, 9, 3]), T([0, 1, 2]), room=10, eos=T([9, 7]))
    assert new.tolist() == [5, 7] and acc.tolist() == [0, 1] and at_eos


def test_cut_with_eos_as_the_bonus_token_keeps_all_and_stops():
    new, acc, at_eos = cut(T([5, 7, 9]), T([0, 1]), room=10, eos=T([9]))
    assert new.tolist() == [5, 7, 9] and acc.tolist() == [0, 1] and at_eos
    new, acc, at_eos = cut(T([9]), T([], dtype=torch.long), room=3, eos=T([9]))  # nothing accepted: the bonus alone
    assert new.tolist() == [9] and acc.numel() == 0 and at_eos


def test_cut_to_the_room_left_drops_the_rest_and_an_eos_beyond_it():
    new, acc, at_eos = cut(T([5, 7, 8, 4]), T([0, 1, 2]), room=2, eos=T([9]))
    assert new.tolist() == [5, 7] and acc.tolist() == [0, 1] and not at_eos
    new, acc, at_eos = cut(T([5, 7, 9]), T([0, 1]), room=2, eos=T([9]))
    assert new.tolist() == [5, 7] and acc.tolist() == [0, 1] and not at_eos
    new, acc, at_eos = cut(T([5, 9, 8]), T([0, 1]), room=2, eos=T([9]))  # an EOS within the room still stops
    assert new.tolist() == [5, 9] and acc.tolist() == [0, 1] and at_eos


def test_cut_ignores_eos_when_not_stopping_on_it():
    new, acc, at_eos = cut(T([5, 9, 7, 9]), T([0, 1, 2]), room=10, eos=T([9]), stop_on_eos=False)
    assert new.tolist() == [5, 9, 7, 9] and acc.tolist() == [0, 1, 2] and not at_eos
    new, acc, at_eos = cut(T([5, 9, 7, 9]), T([0, 1, 2]), room=3, eos=T([9]), stop_on_eos=False)
    assert new.tolist() == [5, 9, 7] and acc.tolist() == [0, 1, 2] and not at_eos


# ---- DrafterPool: reset at prefill, lazy (or eager) catch-up, each drafter's feature columns ----

class Seen:
    """Test-only drafter: keeps what it is handed."""

    def __init__(self, layers=()):
        self.layers, self.calls = tuple(layers), []

    def reset(self, ids, feats, capacity=None):
        self.calls.append(("reset", ids.tolist(), None if feats is None else feats.clone()))

    def catch_up(self, ids, feats):
        self.calls.append(("catch_up", ids.tolist(), None if feats is None else feats.clone()))


D = 2  # the fake target's hidden size


def pool_and_seq(drafters, n_prompt=4):
    target = SimpleNamespace(num_layers=3, hidden_size=D, device=torch.device("cpu"))
    pool = DrafterPool(drafters, target)
    seq = Committed(torch.arange(100, 100 + n_prompt), 32, len(pool.layers) * D, "cpu", torch.float32)
    if seq.feats is not None:
        seq.set_features(0, feats_of(0, n_prompt - 1, seq.feats.shape[1]))
    pool.reset(seq)
    return pool, seq


def feats_of(a, b, width):
    """Features of tokens a..b-1 whose every value names its token and column: 10 * token + column."""
    return torch.tensor([[10.0 * t + c for c in range(width)] for t in range(a, b)])


def commit(seq, k):
    """k new tokens, and the features of the k tokens before them (deferred: the last one has none yet)."""
    if seq.feats is not None:
        seq.set_features(seq.n - 1, feats_of(seq.n - 1, seq.n - 1 + k, seq.feats.shape[1]))
    seq.append(torch.arange(200 + seq.n, 200 + seq.n + k))


def test_pool_resets_every_drafter_with_the_prompt_and_its_columns():
    a, b, c = Seen((0, 2)), Seen((2,)), Seen()
    pool, seq = pool_and_seq({"a": a, "b": b, "c": c})
    assert pool.layers == (0, 2)
    assert a.calls[0][1] == [100, 101, 102, 103] and torch.equal(a.calls[0][2], feats_of(0, 3, 2 * D))
    assert torch.equal(b.calls[0][2], feats_of(0, 3, 2 * D)[:, D:])  # layer 2 only: its columns of the union
    assert c.calls[0][2] is None


def test_lazy_catch_up_hands_the_chosen_drafter_its_whole_backlog_in_one_call():
    a, b = Seen((0,)), Seen((0,))
    pool, seq = pool_and_seq({"a": a, "b": b})
    assert pool.catch_up("a", seq) == 3  # first turn: the unread prompt (all but the pending root)
    assert a.calls[-1][1] == [] and len(b.calls) == 1  # only the chosen one
    commit(seq, 2)
    commit(seq, 3)
    assert pool.catch_up("a", seq) == 5 and len(b.calls) == 1
    ids, feats = a.calls[-1][1:]
    assert ids == seq.ids[4:9].tolist()
    assert torch.equal(feats, feats_of(3, 8, D))  # x_t with f_{t-1}
    assert pool.catch_up("b", seq) == 5 + 3  # b's first turn: everything since the prompt, and the prompt
    assert b.calls[-1][1] == seq.ids[4:9].tolist() and len(b.calls) == 2
    assert pool.catch_up("b", seq) == 0 and b.calls[-1][1] == []
    assert pool.catch_up(None, seq) == 0 and len(a.calls) == 3 and len(b.calls) == 3  # the target alone


def test_eager_catch_up_brings_every_drafter_up_to_date_every_round():
    a, b = Seen(), Seen()
    pool, seq = pool_and_seq({"a": a, "b": b})
    assert pool.catch_up("a", seq, eager=True) == 3
    assert len(b.calls) == 2  # b too, though not chosen
    commit(seq, 2)
    assert pool.catch_up(None, seq, eager=True) == 0  # no drafter chosen: all still catch up
    assert a.calls[-1][1] == b.calls[-1][1] == seq.ids[4:6].tolist()
    commit(seq, 1)
    assert pool.catch_up("b", seq, eager=True) == 1  # its prompt was read in round one: only the new token
    assert pool.seen == {"a": seq.n, "b": seq.n} and pool.unread == {}


# ---- PhaseClock: contiguous laps ----

def test_phases_are_contiguous_laps_and_a_failed_step_is_not_timed(monkeypatch):
    now = iter(range(100))
    monkeypatch.setattr(engine, "time", SimpleNamespace(perf_counter=lambda: float(next(now))))
    clock = PhaseClock(torch.device("cpu"), sync=True)
    clock.start()  # t = 0
    next(now)  # time between phases (t = 1) goes to the next phase
    with clock.phase("route"):  # ends at t = 2
        pass
    with clock.phase("draft") as p:  # t = 3
        p.sync = True  # no CUDA here: no effect
    with pytest.raises(ValueError), clock.phase("verify"):
        raise ValueError
    with clock.phase("verify"):  # t = 4: the failed step's time is in this lap
        pass
    assert clock.ms == {**dict.fromkeys(PHASES, 0.0), "route": 2e3, "draft": 1e3, "verify": 1e3}
