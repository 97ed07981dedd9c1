"""The decode loop: route, catch up, draft, verify (one target forward), commit, record.

Read `decode_rounds` top to bottom: it is the whole algorithm, one screen (gpt-fast's speculative loop is the
model); the steps it calls follow it in the order they run. AR decoding is the same loop with no drafter.

The engine owns the committed sequence (`Committed`: preallocated token ids and, when a drafter asks for target
layers, the target's features of those tokens) and the target's KV cache, both sized once for the whole decode.
The drafters and what each has been handed of the sequence live in a `DrafterPool` (speclab/core/pool.py, where
`Committed` is defined too), which also does the lazy catch-up. Each round one index of kept verification rows
(the root and the accepted path) updates the KV cache, the feature buffer and the router's signals together
(`commit_rows`). A drafter's optional round hooks (`speclab.core.protocol.RoundHooks`: target work before its
catch-up, extra rows in the verification call, their state at commit) go through `Hooks`, the same way for every
drafter: the engine knows none by name.

Deferred (the default): the target's bonus token is not forwarded on its own; it is the root of the next round
and leads that round's verification batch (one target call per round). So at round start the committed tokens
x_0..x_{n-1} all exist but features only for x_0..x_{n-2}: the pending root x_{n-1} has none yet.
Not deferred: the bonus token is forwarded alone at the end of its round (`forward_root`: two target calls per
round), so at round start every committed token x_0..x_{n-1} has its feature and the root's own row (its
next-token distribution) is known. Only `prefill` and `forward_root` know the mode; `verify_batch` sees whether
the root's row is already there. Either way a drafter gets token x_t paired with f_{t-1} (EAGLE's pairing),
which both modes always have.

Router signals (`speclab.core.protocol.Signals`) describe the position that produced the last committed token: the
entropy of the target distribution it was drawn from and that row's final-norm hidden state; both come from the
verification row of the last kept node (the prefill's last row in the first round), kept as one `Row`. They are
computed only when the router asks for them.

Timing: `with clock.phase(name)` times each step as a contiguous lap of one clock. With nobody listening (no
trace, no callback) no RoundEvent is built and phases are not synchronised on CUDA (once, at the end).
"""
from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from speclab.core import native
from speclab.core.lean import ConRows, Segment
from speclab.core.pool import Committed, DrafterPool, feature_columns, feature_layers
from speclab.core.protocol import Decision, Drafter, ExtraRows, FixedRouter, RoundView, Router, Signals
from speclab.core.sampling import Sampling
from speclab.core.target import ForwardOut, Target, crop_cache, forward_clock, keep_cache
from speclab.core.tree import DraftTree, tree_attention_mask, tree_position_ids, tree_rows
from speclab.core.verify import verify
from speclab.errors import InvalidInput
from speclab.metrics import tokens_per_s

__all__ = ["PHASES", "HISTORY", "RoundEvent", "DecodeResult", "Committed", "Row", "PhaseClock", "Verified", "Hooks",
           "decode", "decode_rounds", "prefill", "signals", "verify_batch", "round_segment", "settle", "cut",
           "round_tokens", "commit_rows", "observe", "forward_root",
           "round_event", "entropy", "check_request", "feature_layers", "feature_columns"]

PHASES = ("route", "catchup", "draft", "verify", "commit", "record")
HISTORY = 32  # rounds of accept-length history a router sees


@dataclass
class RoundEvent:
    """Everything one round did; the trace writer and every live view consume this (per-token columns come
    from `speclab.trace.token_columns`, vectorised over rounds)."""
    round: int
    drafter: str | None
    tree: DraftTree
    accepted: torch.Tensor  # node indices of the accepted path that was committed (cut at EOS / max tokens)
    committed: torch.Tensor  # token ids committed this round (accepted drafts, then the target's token)
    node_logp: torch.Tensor  # [n] log target prob (softmax, T=1) of each node's token at its parent's row
    row_entropy: torch.Tensor  # [n + 1] target entropy (nats) of every verification row; row 0 = the root
    bonus_logp: torch.Tensor  # [n + 1] log target prob of the target's own token (correction / bonus) at every row
    timings_ms: dict[str, float]  # per phase (PHASES); "record" is complete once the event is yielded
    target_calls: int
    backlog: int  # tokens the round's drafter digested in its catch-up (the prompt too, on its first turn)
    pos0: int  # index (in generated tokens) of the first token committed this round
    decision: Decision | None = None  # the router's decision (None when the method has no drafter)
    elapsed_ms: float = 0.0  # the run's decode time so far: prefill + every phase of every round up to this one
    run_calls: int = 0  # the run's target calls so far, prefill included (what its run row counts at the end)
    logits: torch.Tensor | None = None  # [n + 1, V] the verification logits, kept only with keep_logits (inspection)
    # under sampling (None at T = 0), per node: p(x), the target's probability of its token at its parent's row under
    # the decode's sampling (temperature, top-k, top-p), and q(x), the drafter's as it drew it (1 for a point mass:
    # a deterministic draft); its first test accepts it with min(1, p(x) / q(x)) (`speclab.core.verify`)
    node_p: torch.Tensor | None = None
    node_q: torch.Tensor | None = None
    step: int | None = None  # in a batch (`speclab.core.batch`): the batched step the round was part of
    t_s: float | None = None  # and when it committed, on the batch's clock

    @property
    def n_accepted(self) -> int:
        return self.accepted.numel()


@dataclass
class DecodeResult:
    prompt_ids: torch.Tensor
    new_ids: torch.Tensor
    rounds: int
    target_calls: int
    stopped: str  # "eos" | "max_new_tokens"
    prefill_ms: float = 0.0
    timings_ms: dict[str, float] = field(default_factory=dict)  # per phase, summed over rounds
    model_s: float = 0.0  # time inside model forwards (target and drafters), prefill included (CPU: exact)
    wall_s: float = 0.0  # first to last instruction, including the time a consumer held the generator

    @property
    def elapsed_s(self) -> float:
        """Decode time: the prefill and the run's own phases, never the time a consumer holds the generator."""
        return (self.prefill_ms + sum(self.timings_ms.values())) / 1e3

    @property
    def tokens_per_s(self) -> float:
        return tokens_per_s(self.new_ids.numel(), self.elapsed_s)


class Row(NamedTuple):
    """One position's target output: the next-token logits [1, V] and the final-norm hidden state [1, d] (None
    unless the router asks for it). The row that drew the last committed token is the router's signal source; the
    root's own row (not deferred) is row 0 of the next verification."""
    logits: torch.Tensor
    hidden: torch.Tensor | None

    @classmethod
    def of(cls, logits: torch.Tensor, hidden: torch.Tensor | None, i: torch.Tensor | slice) -> Row:
        """Row `i` (a one-element index or slice) of a forward's logits and hidden states (None stays None)."""
        return cls(logits[i], None if hidden is None else hidden[i])


class PhaseClock:
    """Contiguous laps of one round, in ms: `with clock.phase(name):` times a step from the end of the previous
    lap. Synchronises CUDA at each lap only when asked (traced runs); the untraced path synchronises once, at
    the end of the decode (the last commit's phase sets `.sync`)."""

    def __init__(self, device: torch.device, sync: bool):
        self.cuda = device.type == "cuda"
        self.sync = sync and self.cuda

    def _now(self, sync: bool = False) -> float:
        if self.sync or (sync and self.cuda):
            torch.cuda.synchronize()
        return time.perf_counter()

    def start(self) -> None:
        self.t, self.ms = self._now(), dict.fromkeys(PHASES, 0.0)

    def lap(self, phase: str, sync: bool = False) -> None:
        t = self._now(sync)
        self.ms[phase] = self.ms.get(phase, 0.0) + (t - self.t) * 1e3
        self.t = t

    def phase(self, name: str) -> _Phase:
        return _Phase(self, name)


class _Phase:
    """`with clock.phase(name) as p:` laps `name` when the block ends (not on an exception); `p.sync = True`
    synchronises CUDA first."""

    def __init__(self, clock: PhaseClock, name: str):
        self.clock, self.name, self.sync = clock, name, False

    def __enter__(self) -> _Phase:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.clock.lap(self.name, self.sync)


def decode(target: Target, prompt_ids: torch.Tensor, drafters: dict[str, Drafter] | None = None,
           router: Router | None = None, max_new_tokens: int = 128, sampling: Sampling | None = None,
           deferred: bool = True, stop_on_eos: bool = True,
           listeners: tuple[Callable[[RoundEvent], None], ...] = ()) -> DecodeResult:
    """Decode to the end, handing every RoundEvent to the listeners (trace writer, streamers); with no listener
    no RoundEvent is built (the fast path)."""
    rounds = decode_rounds(target, prompt_ids, drafters, router, max_new_tokens, sampling, deferred, stop_on_eos,
                           listeners, record=bool(listeners))
    while True:
        try:
            next(rounds)
        except StopIteration as end:
            return end.value


@torch.inference_mode()
def decode_rounds(target: Target, prompt_ids: torch.Tensor, drafters: dict[str, Drafter] | None = None,
                  router: Router | None = None, max_new_tokens: int = 128, sampling: Sampling | None = None,
                  deferred: bool = True, stop_on_eos: bool = True,
                  listeners: tuple[Callable[[RoundEvent], None], ...] = (),
                  record: bool = True,
                  keep_logits: bool = False) -> Generator[RoundEvent | None, None, DecodeResult]:
    """The decode loop as a generator: one item per round (its RoundEvent, or None when not `record`ing), and
    the DecodeResult as its return value. Listeners are called inside the round (timed as "record"). Several
    decodes can be interleaved round by round (the app's side-by-side view); their time counts only the
    rounds' own phases, never the time the consumer holds a round. `keep_logits` leaves each round's
    verification logits on its RoundEvent (for inspecting a round: the anatomy notebook), off by default
    (a traced run holds its events until they are written)."""
    drafters = drafters or {}
    sampling = sampling or Sampling()
    router = router or FixedRouter(next(iter(drafters), None))
    prompt_ids = prompt_ids.detach().cpu().long().flatten()
    check_request(target, prompt_ids, max_new_tokens)
    pool = DrafterPool(drafters, target)  # checks the layers the drafters ask for
    layers, dev, n_prompt = pool.layers, target.device, prompt_ids.numel()
    gen = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
    eos = torch.tensor(target.eos_ids or [-1])
    want_hidden, eager = "hidden" in router.needs, getattr(router, "eager", False)
    record = record or bool(listeners)
    clock = PhaseClock(dev, sync=record)
    wall0 = time.perf_counter()

    # prefill: the KV cache (sized once, for the whole decode), the prompt's features, the first round's signals
    clock.start()
    calls0, model0 = target.calls, forward_clock.seconds
    with clock.phase("prefill"):
        seq = Committed(prompt_ids, n_prompt + max_new_tokens, len(layers) * target.hidden_size, dev, target.dtype)
        cache = target.new_cache(n_prompt + max_new_tokens)
        last, root = prefill(target, cache, seq, layers, want_hidden, deferred)  # rows: see `prefill`
        pool.reset(seq)
    prefill_ms = clock.ms["prefill"]
    n_calls, model_s = target.calls - calls0, forward_clock.seconds - model0
    totals = dict.fromkeys(PHASES, 0.0)
    history: deque[tuple[int, str | None]] = deque(maxlen=HISTORY)  # (accept length, drafter) of recent rounds
    rnd, done, at_eos = 0, False, False

    while not done:
        clock.start()
        calls0, model0 = target.calls, forward_clock.seconds
        with clock.phase("route"):  # the router picks this round's drafter from the row that drew the last token
            decision = router.choose(signals(rnd, last, router.needs, history, lambda: pool.probe(seq),
                                             seq.n - n_prompt)) if drafters else None
            name = decision.choice if decision is not None else None
        with clock.phase("catchup"):  # lazily: only the chosen drafter, everything since it last looked
            hooks = Hooks.of(target, cache, seq, pool, name)  # the chosen drafter's optional round hooks
            hooks.before_catch_up()
            backlog = pool.catch_up(name, seq, eager)
        with clock.phase("draft"):
            room = max_new_tokens - (seq.n - n_prompt) - 1  # the bonus token always fits
            drafter = pool.drafters[name] if name is not None and room > 0 else None
            tree = drafter.propose(room, sampling, gen).to(dev) if drafter is not None else DraftTree.empty(dev)
        with clock.phase("verify"):  # ONE target forward over the pending root (deferred) and the flattened tree
            v = verify_batch(target, cache, seq, tree, root, layers, want_hidden, sampling, gen, hooks.extra_rows())
        with clock.phase("commit") as commit:  # kept rows (root + accepted path): KV cache, features, signals
            accepted = v.accepted.to(dev)
            new, accepted, at_eos = cut(round_tokens(tree, accepted, v.bonus), accepted,
                                        max_new_tokens - (seq.n - n_prompt), eos, stop_on_eos)
            done = at_eos or seq.n + new.numel() - n_prompt >= max_new_tokens
            commit.sync = done  # the decode's end: synchronise CUDA (once, on the untraced path)
            last = commit_rows(cache, seq, v, accepted, done)
            pos0 = seq.n - n_prompt
            seq.append(new)
            if drafter is not None:  # it keeps what was accepted (its draft KV), and may learn from the root's row
                drafter.commit(tree, accepted)
                observe(drafter, v)
            if not done:
                hooks.after_verify(v, accepted, seq.n - 1)  # its extra row beside the row that drew the last token
                root = forward_root(target, cache, seq, layers, want_hidden, deferred)
            history.append((accepted.numel(), name))
        calls = target.calls - calls0
        n_calls, model_s = n_calls + calls, model_s + forward_clock.seconds - model0

        ev = None
        if record:  # the RoundEvent for the listeners (only when someone listens)
            with clock.phase("record"):
                ev = round_event(rnd, name, tree, accepted, new, v.logits, v.bonus, clock.ms, calls, backlog, pos0,
                                 decision, v.probs)
                ev.logits = v.logits if keep_logits else None
                for fn in listeners:
                    fn(ev)
        totals = {k: totals[k] + clock.ms[k] for k in PHASES}
        if ev is not None:
            ev.elapsed_ms, ev.run_calls = prefill_ms + sum(totals.values()), n_calls
        yield ev
        rnd += 1

    return DecodeResult(prompt_ids, seq.ids[n_prompt : seq.n].clone(), rnd, n_calls,
                        "eos" if at_eos else "max_new_tokens", prefill_ms, totals, model_s, time.perf_counter() - wall0)


# ---- the steps of a round, in the order they run ----

def prefill(target: Target, cache, seq: Committed, layers: tuple[int, ...], hidden: bool,
            deferred: bool) -> tuple[Row | None, Row | None]:
    """The prompt into the KV cache and its features into `seq`. Returns the row that drew the prompt's last token
    (the first round's signals; None for a one-token prompt) and the root's own row: None when deferred (the
    last prompt token is the pending root, forwarded first in the first verification), else its row (forwarded
    here, with the rest of the prompt)."""
    n = seq.n
    if deferred:
        if n == 1:
            return None, None
        out = target.prefill(seq.ids[: n - 1], cache, layers, hidden=hidden)
        last: Row | None = Row.of(out.logits, out.hidden, slice(-1, None))
        root = None
    else:  # the logits (and hidden states) of the prompt's last two rows
        out = target.prefill(seq.ids[:n], cache, layers, last=min(2, n), hidden=hidden)
        root = Row.of(out.logits, out.hidden, slice(-1, None))
        last = Row.of(out.logits, out.hidden, slice(-2, -1)) if n > 1 else None
    if out.features is not None:  # the drafters draft from target layers
        seq.set_features(0, out.features)
    return last, root


class Hooks:
    """The round's chosen drafter's optional round hooks (`speclab.core.protocol.RoundHooks`), each a no-op where it
    defines none (and for the target stepping alone), with the `RoundView` they see: the loop calls every hook the
    same way and names no drafter. `NONE`: a round without hooks."""
    NONE: Hooks

    def __init__(self, drafter: object = None, view: RoundView | None = None):
        self.drafter, self.view = drafter, view

    @classmethod
    def of(cls, target: Target, cache, seq: Committed, pool: DrafterPool, name: str | None) -> Hooks:
        d = pool.drafters.get(name) if name is not None else None
        if name is None or not any(hasattr(d, h) for h in ("before_catch_up", "extra_rows", "after_verify")):
            return cls.NONE
        rows_ride = target.lean is not None and not target.lean.exact
        return cls(d, RoundView(target, cache, seq.n, seq.n_feats, lambda a, b: pool.features(name, seq, a, b),
                                rows_ride))

    def before_catch_up(self) -> None:
        """Work of the drafter's own on the target before its catch-up (timed as catch-up)."""
        hook = getattr(self.drafter, "before_catch_up", None)
        if hook is not None:
            hook(self.view)

    def extra_rows(self) -> ExtraRows | None:
        """The rows the drafter asks to ride in this round's verification call (None: none)."""
        hook = getattr(self.drafter, "extra_rows", None)
        return None if hook is None else hook(self.view)

    def after_verify(self, v: Verified, accepted: torch.Tensor, tokens: int) -> None:
        """The final-norm state of the drafter's extra row after the row that drew the round's last token (the
        root's when no node was accepted): it follows the first `tokens` committed tokens. Nothing when none rode."""
        hook = getattr(self.drafter, "after_verify", None)
        if hook is not None and v.extra is not None:
            hook(v.extra[accepted[-1:] + 1 if accepted.numel() else 0], tokens)


Hooks.NONE = Hooks()


def signals(rnd: int, last: Row | None, needs: frozenset[str], history: deque[tuple[int, str | None]],
            probe: Callable[[], dict[str, float]] | None = None, generated: int = 0) -> Signals:
    """What the router asks for (`needs`), of the row that drew the last committed token (no row: nan / None),
    the recent rounds' accept lengths and drafters, and (`probe`) the drafters' own round-start signals."""
    ent = float(entropy(last.logits)[0]) if "entropy" in needs and last is not None else math.nan
    hidden = last.hidden[0] if "hidden" in needs and last is not None and last.hidden is not None else None
    probed = probe() if "probe" in needs and probe is not None else {}
    return Signals(rnd, ent, hidden, [a for a, _ in history], [d for _, d in history], probed, generated)


@dataclass
class Verified:
    """A verified batch: what commit needs."""
    accepted: torch.Tensor  # [a] node indices of the accepted path, root side first (the verdict)
    bonus: int  # the target's token after the accepted path (correction or bonus)
    logits: torch.Tensor  # [n + 1, V]: row 0 = the root's next-token distribution, row i + 1 = node i's
    hidden: torch.Tensor | None  # [n + 1, d]: the final-norm hidden states of those rows (when the router asks)
    features: torch.Tensor | None  # the target's features of the forwarded rows (None: no layers or no forward)
    past: int  # KV cache length before the batch
    lead: int  # forwarded rows before the tree's: 1 = the pending root (deferred), 0 = none
    extra: torch.Tensor | None = None  # [n + 1, d]: final-norm states of the extra rows (one after each row)
    probs: torch.Tensor | None = None  # [n + 1, V] under sampling: the distributions verification tested against


def verify_batch(target: Target, cache, seq: Committed, tree: DraftTree, root: Row | None, layers: tuple[int, ...],
                 hidden: bool, sampling: Sampling, gen: torch.Generator | None,
                 extra: ExtraRows | None = None) -> Verified:
    """ONE target forward over the round's new rows, the pending root (when `root` is None: deferred) and the
    flattened tree, under the tree's mask and positions (a chain: the forward's causal defaults); then the verdict
    over the logits of every row, the root's first (`speclab.core.verify.verify`). With the root's row known and
    no tree there is nothing to forward. `extra` (a drafter's `RoundHooks.extra_rows`): one extra row after each
    row of the batch (the root's included), each seeing its row's path and the extra keys and values, forwarded in
    the same call (`Verified.extra`; `speclab.core.tree.tree_rows` places them)."""
    past = cache.get_seq_length()
    seg = round_segment(target, cache, seq, tree, root is None)
    rows = None
    if extra is not None and (root is None or len(tree)):  # one extra row per batch row (and the cached root's)
        c_pos, visible = tree_rows(tree.ancestors, tree.depth, past, root is None)
        rows = ConRows(extra.emb.expand(c_pos.numel(), -1), c_pos, visible, extra.keys, extra.values)
    out = None
    if root is None or len(tree):  # with the root's row known and no tree there is nothing to forward
        out = target.forward(seg.ids, cache, seg.pos, seg.mask, layers=layers, hidden=hidden, con=rows)
    return settle(tree, out, root, past, sampling, gen)


def round_segment(target: Target, cache, seq: Committed, tree: DraftTree, with_root: bool) -> Segment:
    """A round's rows as one sequence of a forward: the pending root (`with_root`: deferred) and the flattened tree,
    under the tree's mask and positions (a chain: the forward's causal defaults)."""
    past = cache.get_seq_length()
    chain = tree.is_chain
    mask = None if chain else tree_attention_mask(tree.ancestors, past, target.dtype, with_root=with_root)
    pos = None if chain else tree_position_ids(tree.depth, past, with_root)
    ids = torch.cat([seq.ids[seq.n - 1 : seq.n].to(target.device), tree.tokens]) if with_root else tree.tokens
    return Segment(ids, cache, pos, mask)


def settle(tree: DraftTree, out: ForwardOut | None, root: Row | None, past: int, sampling: Sampling,
           gen: torch.Generator | None) -> Verified:
    """The verdict over a round's rows: the forward's `out` (None: nothing was forwarded), after the root's own row
    when it was known (`root`; None: the pending root led the forward)."""
    states = None
    if root is None:
        assert out is not None
        logits, hid, feats, states = out.logits, out.hidden, out.features, out.future
    elif out is not None:  # the tree alone, after the root's known row
        logits, feats, states = torch.cat([root.logits, out.logits]), out.features, out.future
        hid = None if root.hidden is None or out.hidden is None else torch.cat([root.hidden, out.hidden])
    else:
        logits, hid, feats = root.logits, root.hidden, None
    verdict = verify(tree, logits, sampling, gen)
    return Verified(verdict.accepted, verdict.bonus, logits, hid, feats, past, int(root is None), states, verdict.probs)


def first_nodes(accepted: torch.Tensor) -> bool:
    """Whether an accepted path (ascending node indices) is the tree's first nodes, 0..a-1: a chain's path, or none.
    Such a path is kept by slices and a crop, not by gathers."""
    a = accepted.numel()
    return a == 0 or int(accepted[-1]) == a - 1


def round_tokens(tree: DraftTree, accepted: torch.Tensor, bonus: int) -> torch.Tensor:
    """A round's new tokens on the CPU: the accepted drafts (root side first), then the target's token."""
    if accepted.numel() == 0:
        return torch.tensor([bonus])
    drafts = tree.tokens[: accepted.numel()] if first_nodes(accepted) else tree.tokens[accepted]
    return torch.cat([drafts.cpu(), torch.tensor([bonus])])


def cut(new: torch.Tensor, accepted: torch.Tensor, room: int, eos: torch.Tensor,
        stop_on_eos: bool = True) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """A round's tokens `new` (the accepted drafts, then the target's token) and its accepted nodes, cut to the
    `room` left and, when stopping on EOS, after the first of the `eos` ids among them (an EOS inside the
    accepted drafts cuts both); and whether an EOS ended them."""
    m = min(new.numel(), room)
    hit = torch.isin(new[:m], torch.as_tensor(eos)).nonzero() if stop_on_eos else new[:0]
    if hit.numel():
        m = int(hit[0]) + 1
    return new[:m], accepted[:m], bool(hit.numel())


def commit_rows(cache, seq: Committed, v: Verified, accepted: torch.Tensor, done: bool) -> Row:
    """Keep the batch's kept rows, the root (when it led the batch) and the accepted path: their KV and (unless the
    decode is done, or the sequence keeps no features: a batched request without drafters) their features, from the
    root's position on. Returns the row that drew the round's last token
    (the next round's signals)."""
    a = accepted.numel()
    if first_nodes(accepted):  # the root's row and the first nodes': a crop and slices
        n = v.lead + a
        crop_cache(cache, v.past + n)
        if v.features is not None and seq.feats is not None and not done:
            seq.set_features(seq.n - v.lead, v.features[:n])
        return Row.of(v.logits, v.hidden, slice(a, a + 1))
    kept = torch.cat([torch.arange(v.lead, device=accepted.device), accepted + v.lead])
    keep_cache(cache, v.past, kept)
    if v.features is not None and seq.feats is not None and not done:
        seq.set_features(seq.n - v.lead, v.features[kept])
    return Row.of(v.logits, v.hidden, accepted[-1:] + 1)


def observe(drafter: Drafter, v: Verified) -> None:
    """Under sampling, the target's distribution at the round's root row to a drafter that learns from it
    (`speclab.core.protocol.Observing`: prompt lookup's gate), whether it drafted this round or not."""
    hook = getattr(drafter, "observe", None)
    if hook is not None and v.probs is not None:
        hook(v.probs[0])


def forward_root(target: Target, cache, seq: Committed, layers: tuple[int, ...], hidden: bool,
                 deferred: bool) -> Row | None:
    """The next round's root (the round's last token): deferred, nothing now (it leads the next verification batch:
    None); not deferred, forwarded alone now for its features and its row (its next-token distribution)."""
    if deferred:
        return None
    out = target.forward(seq.ids[seq.n - 1 : seq.n].to(target.device), cache, layers=layers, hidden=hidden)
    if out.features is not None:
        seq.set_features(seq.n - 1, out.features)
    return Row(out.logits, out.hidden)


def round_event(rnd, name, tree, accepted, new, logits, bonus, timings, calls, backlog, pos0, decision,
                probs: torch.Tensor | None = None) -> RoundEvent:
    """What the listeners need, in five tensor ops over the verification logits (no host sync, no per-token
    work; under sampling one more over `probs`, the distributions verification tested against); `token_columns`
    derives the per-token figures from it, in batches."""
    rows = tree.parents + 1
    stats = native.round_stats(logits, rows, tree.tokens, bonus)  # the figures below in one call on a CPU
    if stats is None:
        lse, ent = native.softmax_entropy(logits)  # a Triton kernel on CUDA, native.cpp's two passes on a CPU
        stats = logits[rows, tree.tokens].float() - lse[rows], ent, logits[:, bonus].float() - lse
    if tree.cands is not None:  # FlashHead: was the target's token (its argmax at the parent) retrieved?
        tree.extra["in_cands"] = (tree.cands == logits[rows].argmax(-1)[:, None]).any(-1).long()
    node_logp, ent, bonus_logp = stats
    ev = RoundEvent(rnd, name, tree, accepted, new, node_logp, ent, bonus_logp, timings, calls, backlog, pos0, decision)
    if probs is not None:  # p(x) and q(x) as verification tested them
        ev.node_p = probs[rows, tree.tokens]
        ev.node_q = tree.tested_q.to(ev.node_p.device)
    return ev


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats, T = 1) of every row of logits [..., V] (`kernels.ops.softmax_entropy`, `native`'s on a CPU)."""
    return native.softmax_entropy(logits.reshape(-1, logits.shape[-1]))[1].reshape(logits.shape[:-1])


def check_request(target: Target, prompt_ids: torch.Tensor, max_new_tokens: int) -> None:
    if prompt_ids.numel() == 0:
        raise InvalidInput("the prompt is empty (it tokenizes to no tokens)")
    if max_new_tokens < 1:
        raise InvalidInput(f"max_new_tokens must be at least 1 (got {max_new_tokens})")
    if prompt_ids.numel() + max_new_tokens > target.max_context:
        raise InvalidInput(
            f"prompt has {prompt_ids.numel()} tokens; with max_new_tokens={max_new_tokens} that exceeds the "
            f"model's context of {target.max_context} tokens")
