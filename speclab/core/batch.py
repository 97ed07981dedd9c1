"""The batched decode loop: many requests at once, ONE target forward per step (continuous batching).

Read `Batch.step` top to bottom: admit the requests that arrived (their prompts prefilled together, in one
forward), ask the policy how many draft tokens each request gets, draft, verify every request's rows in one target
forward (`Target.forward_many`: the weights are read once for the whole batch, attention runs per request over its
own KV cache), then commit each request on its own and retire the finished ones. A request that finishes frees its
slot for the next (`submit` any time: the load generators in `speclab.serve` do).

Each request is the single-stream decode (`speclab.core.engine`) step for step: the same round segment, verdict and
commit (`round_segment`, `settle`, `cut`, `commit_rows`), its own drafters (a fresh set per request, from the
method's builder), its own KV cache and its own random generator seeded as a single-stream decode seeds it
(`Request.seed`). So a request's output is its single-stream output: token for token at T = 0 in fp32 and in exact
mode (bf16 fast: equal or a near-tie, the matrix products' row count differs). Under sampling it makes the same
draws from distributions equal to float rounding, so a draw that lands within that rounding of a token's edge in the
inverse CDF (`speclab.core.sampling.sample`) can pick the neighbouring token: the sampling near-tie; the
distribution is the target's either way (tests/test_batch.py: chi-square with power).

Requests are independent: a bad prompt is refused at `submit` (its result says why) and touches no other request; a
cancelled one (`cancel`) leaves the batch at the next step with what it committed, marked cancelled.

Only the deferred mode, and drafters without round hooks (`speclab.core.protocol.RoundHooks`), batch here; a
routed method decodes one request at a time.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from speclab.core.engine import (
    PHASES,
    RoundEvent,
    check_request,
    commit_rows,
    cut,
    observe,
    round_event,
    round_segment,
    round_tokens,
    settle,
)
from speclab.core.lean import Segment
from speclab.core.pool import Committed, DrafterPool
from speclab.core.protocol import Drafter
from speclab.core.sampling import Sampling
from speclab.core.target import Target, forward_clock
from speclab.core.tree import DraftTree
from speclab.errors import InvalidInput

__all__ = ["Request", "Stream", "Done", "StepEvent", "Policy", "Recorder", "Batch"]


@dataclass
class Request:
    rid: int
    prompt_ids: torch.Tensor
    max_new_tokens: int
    arrival_s: float = 0.0  # when it arrived, in seconds on the batch's clock (`Batch.now`)
    seed: int | None = None  # its sampling seed (None: the batch's); a single-stream decode with it draws the same


@dataclass
class Stream:
    """One admitted request: its committed sequence, KV cache, drafters, generator and times (seconds on the
    batch's clock)."""
    req: Request
    seq: Committed
    cache: Any
    pool: DrafterPool
    name: str | None  # its drafter (None: the target steps alone)
    gen: torch.Generator | None
    admitted_s: float
    first_s: float = float("nan")  # when its first token was committed
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    round_s: list[float] = field(default_factory=list)  # when each of its rounds committed
    round_tokens: list[int] = field(default_factory=list)  # tokens each of its rounds committed
    accept_ema: float = float("nan")  # moving average of its acceptance rate (policies read it)
    stopped: str | None = None  # set at the commit that ends it: "eos" or "max_new_tokens"

    @property
    def new_tokens(self) -> int:
        return self.seq.n - self.req.prompt_ids.numel()

    @property
    def room(self) -> int:
        """Draft tokens that still fit (the target's token always does)."""
        return self.req.max_new_tokens - self.new_tokens - 1


@dataclass
class Done:
    """A request's outcome: its tokens, why it stopped ("eos", "max_new_tokens", "cancelled", or "refused: ..."),
    its times in seconds on the batch's clock and its counts."""
    rid: int
    new_ids: torch.Tensor
    stopped: str
    arrival_s: float
    admitted_s: float = float("nan")
    first_s: float = float("nan")
    done_s: float = float("nan")
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    round_s: list[float] = field(default_factory=list)
    round_tokens: list[int] = field(default_factory=list)


@dataclass
class StepEvent:
    """One batched step: the requests in it, their draft lengths and rows, what each accepted, the calls made and
    the time of each phase (ms)."""
    step: int
    t_s: float  # when it started, on the batch's clock
    rids: list[int]
    drafted: list[int]  # draft tokens per request (tree nodes)
    accepted: list[int]
    rows: int  # rows of the verification forward: each request's pending root and its draft
    target_calls: int
    drafter_calls: int  # model forwards while drafting (every drafter model, all requests)
    admitted: int  # requests prefilled before this step
    ms: dict[str, float]  # prefill, policy, draft, verify, commit


class Recorder(Protocol):
    """What a batch tells a trace (`speclab.serve.record.ServeRecorder`): each admitted request, each of its rounds
    (a RoundEvent as a single-stream decode makes it, with its `step` and commit time `t_s`), each finished one and
    each step. With no recorder no RoundEvent is built."""

    def admitted(self, s: Stream) -> None: ...

    def round(self, s: Stream, ev: RoundEvent) -> None: ...

    def finished(self, s: Stream, done: Done) -> None: ...

    def step(self, ev: StepEvent) -> None: ...


class Policy(Protocol):
    """How many draft tokens each request gets this step (`speclab.serve.policies`: none, fixed, table, goodput,
    dspark). A policy may also define `trim(streams, trees) -> lengths`, called after drafting and before verification
    to cut each chain to a prefix (the decision sees the drafts, never the verdict: non-anticipating),
    `observe(StepEvent)`, called after every step, and `plain(n) -> bool`: whether it will draft for none of a
    batch of n requests from now on (DSpark, where its profile says drafting cannot pay at that load). Where it says
    so the batch releases every request's drafters (they no longer digest, nor are the target's features kept for
    them) and admits new requests without any, so a step costs what plain decoding's does; a released request
    decodes plainly to its end, and requests admitted later, at a load where drafting may pay, get drafters again."""
    name: str

    def lengths(self, streams: list[Stream]) -> list[int]:
        ...


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


class Batch:
    """Continuous batching over one loaded target: `submit` requests, `step` until `idle`; each finished request's
    `Done` is in `done`. `make_drafters()` builds one request's drafters ({} for plain decoding); `layers`: the
    target layers they draft from come back with every forward."""

    def __init__(self, target: Target, make_drafters: Callable[[], dict[str, Drafter]], policy: Policy,
                 sampling: Sampling | None = None, max_batch: int = 64, stop_on_eos: bool = True,
                 listeners: tuple[Callable[[StepEvent], None], ...] = (), recorder: Recorder | None = None):
        self.target, self.make_drafters, self.policy, self.recorder = target, make_drafters, policy, recorder
        self.sampling = sampling or Sampling()
        self.max_batch, self.stop_on_eos, self.listeners = max_batch, stop_on_eos, listeners
        probe = make_drafters()
        for d in probe.values():
            if any(hasattr(d, h) for h in ("before_catch_up", "extra_rows", "after_verify")):
                raise InvalidInput(f"{d.name} has round hooks (target work of its own): it decodes one request at a "
                                   "time, not in a batch")
        if len(probe) > 1:
            raise InvalidInput("a routed method decodes one request at a time, not in a batch")
        self.layers = DrafterPool(probe, target).layers
        self.eos = torch.tensor(target.eos_ids or [-1])
        self.waiting: list[Request] = []
        self.active: list[Stream] = []
        self.done: dict[int, Done] = {}
        self.cancelled: set[int] = set()
        self.steps = 0
        self.t0 = time.perf_counter()

    def now(self) -> float:
        """Seconds since the batch started."""
        return time.perf_counter() - self.t0

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.active

    def submit(self, req: Request) -> bool:
        """Queue a request (admitted at the next step with a free slot). A bad one is refused here, alone: its
        `Done` says why, and False is returned."""
        try:
            check_request(self.target, req.prompt_ids.flatten(), req.max_new_tokens)
        except InvalidInput as e:
            self.done[req.rid] = Done(req.rid, req.prompt_ids.new_zeros(0), f"refused: {e}", req.arrival_s)
            return False
        self.waiting.append(req)
        return True

    def cancel(self, rid: int) -> None:
        """The request leaves at the next step (waiting: at once), keeping what it committed, marked cancelled."""
        self.cancelled.add(rid)

    def close(self) -> None:
        """Every request still waiting or active leaves now, cancelled (a client gone: the app's closed page)."""
        self.cancelled.update(r.rid for r in self.waiting)
        self.cancelled.update(s.req.rid for s in self.active)
        self._drop_cancelled()

    @torch.inference_mode()
    def step(self) -> StepEvent | None:
        """One batched step: admit, choose draft lengths, draft, verify (ONE target forward), commit, retire.
        None when nothing is active."""
        t_step, ms = self.now(), {}
        t = time.perf_counter()
        self._drop_cancelled()
        admitted = self._admit()  # their prompts in one forward
        ms["prefill"] = _ms(t)
        streams = list(self.active)  # this step's requests (retiring changes self.active)
        if not streams:
            return None

        t = time.perf_counter()
        plain = getattr(self.policy, "plain", None)
        if plain is not None and plain(len(streams)):
            for s in streams:
                self._release(s)
        drafting = any(s.name is not None for s in streams)  # else no policy is asked, no features are made
        ks = ([min(k, s.room) if s.name is not None else 0 for k, s in zip(self.policy.lengths(streams), streams)]
              if drafting else [0] * len(streams))
        ms["policy"] = _ms(t)

        t, calls0 = time.perf_counter(), forward_clock.calls
        trees = self._draft(streams, ks)  # every request's drafter: one call per step where the drafter batches
        drafter_calls = forward_clock.calls - calls0
        ms["draft"] = _ms(t)

        t = time.perf_counter()
        trim = getattr(self.policy, "trim", None)  # a policy that cuts the drafts it has seen (DSpark's scheduler)
        if trim is not None:
            trees = [tree.head(k) for tree, k in zip(trees, trim(streams, trees))]
        ms["policy"] += _ms(t)

        t, tcalls0 = time.perf_counter(), self.target.calls
        segs = [round_segment(self.target, s.cache, s.seq, tree, True) for s, tree in zip(streams, trees)]
        pasts = [s.cache.get_seq_length() for s in streams]
        outs = self.target.forward_many(segs, self.layers if drafting else ())  # every request's rows: ONE forward
        verified = [settle(tree, out, None, past, self.sampling, s.gen)
                    for s, tree, out, past in zip(streams, trees, outs, pasts)]
        ms["verify"] = _ms(t)

        t = time.perf_counter()
        now = self.now()
        kept = [self._commit(s, tree, v, now) for s, tree, v in zip(streams, trees, verified)]
        ms["commit"] = _ms(t)

        ev = StepEvent(self.steps, t_step, [s.req.rid for s in streams], [len(tr) for tr in trees],
                       [acc.numel() for acc, _, _ in kept], sum(seg.ids.numel() for seg in segs),
                       self.target.calls - tcalls0, drafter_calls, admitted, ms)
        if self.recorder is not None:  # each request's round as a single-stream decode records it
            for s, tree, v, (acc, new, pos0) in zip(streams, trees, verified, kept):
                rev = round_event(s.rounds - 1, s.name, tree, acc, new, v.logits, v.bonus,
                                  {**dict.fromkeys(PHASES, 0.0), "draft": ms["policy"] + ms["draft"],
                                   "verify": ms["verify"], "commit": ms["commit"]}, 1, 0, pos0, None, v.probs)
                rev.step, rev.t_s = self.steps, now
                self.recorder.round(s, rev)
            self.recorder.step(ev)
        self._retire(now)
        self.steps += 1
        observe = getattr(self.policy, "observe", None)  # a policy that learns from the steps (draft costs)
        if observe is not None:
            observe(ev)
        for fn in self.listeners:
            fn(ev)
        return ev

    # ---- the steps, in the order they run ----

    def _drop_cancelled(self) -> None:
        if not self.cancelled:
            return
        now = self.now()
        for req in [r for r in self.waiting if r.rid in self.cancelled]:
            self.waiting.remove(req)
            self.done[req.rid] = Done(req.rid, req.prompt_ids.new_zeros(0), "cancelled", req.arrival_s)
        for s in [s for s in self.active if s.req.rid in self.cancelled]:
            self.active.remove(s)
            self._finish(s, "cancelled", now)
        self.cancelled.clear()

    def _admit(self) -> int:
        """The waiting requests that fit (up to `max_batch` active), prefilled together: every prompt but its last
        token (the pending root, which leads the request's first verification) in one forward."""
        now = self.now()
        room = self.max_batch - len(self.active)
        new = [r for r in self.waiting if r.arrival_s <= now][:room]
        if not new:
            return 0
        plain = getattr(self.policy, "plain", None)
        bare = plain is not None and plain(len(self.active) + len(new))  # admitted without drafters
        streams = []
        for req in new:
            self.waiting.remove(req)
            ids = req.prompt_ids.detach().cpu().long().flatten()
            drafters = {} if bare else self.make_drafters()
            if getattr(self.policy, "confidence", False):  # a scheduler that reads each row's confidence asks for it
                for d in drafters.values():
                    d.confidence = True  # type: ignore[attr-defined]
            pool = DrafterPool(drafters, self.target)
            n = ids.numel()
            seq = Committed(ids, n + req.max_new_tokens, 0 if bare else len(self.layers) * self.target.hidden_size,
                            self.target.device, self.target.dtype)
            seed = req.seed if req.seed is not None else self.sampling.seed
            gen = torch.Generator().manual_seed(seed) if seed is not None else None
            streams.append(Stream(req, seq, self.target.new_cache(n + req.max_new_tokens), pool,
                                  next(iter(drafters), None), gen, now))
        long = [s for s in streams if s.seq.n > 1]  # a one-token prompt is its pending root alone
        if long:
            outs = self.target.forward_many([Segment(s.seq.ids[: s.seq.n - 1], s.cache) for s in long],
                                            () if bare else self.layers)
            for s, out in zip(long, outs):
                if out.features is not None:
                    s.seq.set_features(0, out.features)
        for s in streams:
            s.pool.reset(s.seq)
            if self.recorder is not None:
                self.recorder.admitted(s)
        self.active += streams
        return len(streams)

    def _draft(self, streams: list[Stream], ks: list[int]) -> list[DraftTree]:
        """Each request's drafter catches up (lazily, everything since it last looked) and proposes at most its k
        tokens (no drafter, or k = 0: an empty tree, the target steps alone). Drafters of one kind go together: a
        drafter class with `catch_up_many` / `propose_many` (`speclab.core.protocol.BatchDrafting`) does each for all
        of them in one model call; any other is called once per request."""
        trees = [DraftTree.empty(self.target.device) for _ in streams]
        kinds: dict[type, list[tuple[int, str]]] = {}
        for j, (s, k) in enumerate(zip(streams, ks)):
            if s.name is not None and k > 0:
                kinds.setdefault(type(s.pool.drafters[s.name]), []).append((j, s.name))
        for kind, named in kinds.items():
            idx = [j for j, _ in named]
            ds = [streams[j].pool.drafters[name] for j, name in named]
            handed = [streams[j].pool.hand(name, streams[j].seq) for j, name in named]
            many = getattr(kind, "catch_up_many", None)
            if many is not None:
                many(ds, [h[0] for h in handed], [h[1] for h in handed])
            else:
                for d, h in zip(ds, handed):
                    d.catch_up(h[0], h[1])
            gens = [streams[j].gen for j in idx]
            many = getattr(kind, "propose_many", None)
            got = (many(ds, [ks[j] for j in idx], self.sampling, gens) if many is not None else
                   [d.propose(ks[j], self.sampling, g) for d, j, g in zip(ds, idx, gens)])
            for j, tree in zip(idx, got):
                trees[j] = tree.to(self.target.device)
        return trees

    def _release(self, s: Stream) -> None:
        """The request's drafters go (their caches freed); it decodes on plainly, keeping no target features."""
        if s.name is not None:
            s.name, s.pool = None, DrafterPool({}, self.target)
            s.seq.drop_features()

    def _commit(self, s: Stream, tree: DraftTree, v, now: float) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The request's accepted path and the target's token: its KV cache, features and drafter, as a
        single-stream round commits them. Returns (the accepted nodes, the tokens committed, the index of the first
        of them among its new tokens)."""
        pos0 = s.new_tokens
        acc = v.accepted.to(self.target.device)
        new, acc, at_eos = cut(round_tokens(tree, acc, v.bonus), acc, s.req.max_new_tokens - s.new_tokens, self.eos,
                               self.stop_on_eos)
        done = at_eos or s.new_tokens + new.numel() >= s.req.max_new_tokens
        commit_rows(s.cache, s.seq, v, acc, done)
        s.seq.append(new)
        if s.name is not None and len(tree):
            s.pool.drafters[s.name].commit(tree, acc)
            rate = acc.numel() / len(tree)
            s.accept_ema = rate if s.accept_ema != s.accept_ema else 0.8 * s.accept_ema + 0.2 * rate
        if s.name is not None:
            observe(s.pool.drafters[s.name], v)
        if s.rounds == 0:
            s.first_s = now
        s.rounds, s.drafted, s.accepted = s.rounds + 1, s.drafted + len(tree), s.accepted + acc.numel()
        s.round_s.append(now)
        s.round_tokens.append(new.numel())
        if done:
            s.stopped = "eos" if at_eos else "max_new_tokens"
        return acc, new, pos0

    def _retire(self, now: float) -> None:
        for s in [s for s in self.active if s.stopped is not None]:
            self.active.remove(s)
            self._finish(s, str(s.stopped), now)

    def _finish(self, s: Stream, stopped: str, now: float) -> None:
        self.done[s.req.rid] = self._done(s, stopped, now)
        if self.recorder is not None:
            self.recorder.finished(s, self.done[s.req.rid])

    def _done(self, s: Stream, stopped: str, now: float) -> Done:
        n = s.req.prompt_ids.numel()
        return Done(s.req.rid, s.seq.ids[n : s.seq.n].clone(), stopped, s.req.arrival_s, s.admitted_s, s.first_s,
                    now, s.rounds, s.drafted, s.accepted, s.round_s, s.round_tokens)
