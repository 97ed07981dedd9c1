"""Draft-length policies for batched serving: how many draft tokens each request gets in a step
(`speclab.core.batch.Policy`), each registered with its parameters.

- `none`: no speculation (every request one target row per step).
- `fixed:k=K`: K draft tokens for every request at every batch size.
- `table:1-4=4,5-16=2,17-64=0`: K by the number of active requests, as vLLM's
  `num_speculative_tokens_per_batch_size` (PR 32374); a size outside every range gets 0.
- `goodput:k=K,alpha0=A`: SmartSpec-style (arXiv 2406.14066): each request's moving-average acceptance rate
  alpha_r (A until it has drafted) makes its j-th draft token survive with probability alpha_r^j; tokens are admitted
  across the batch in descending survival while the expected goodput, expected tokens / modeled step time, rises
  (`admit`: DSpark's admission rule, arXiv 2607.05147 §3.2.2, with acceptance in place of its confidence head).
  The step time is a `StepCost` profiled at start on this machine.
- `dspark:k=K`: DSpark's confidence scheduler (arXiv 2607.05147 §3.2.2, Algorithm 1): every request drafts a block
  (one DFlash call for the batch) of at most K tokens, one more than its last step's admission kept (§5.2), its
  confidence head gives each row c_k and the survival of the first j drafts a[r, j] = prod_{k<=j} c_k; `admit` then
  keeps tokens in descending survival while the expected tokens per second rise, and each chain is cut to its kept
  prefix before verification (the drafting is paid already: only the verification rows count). It needs a DFlash
  drafter with the head (`speclab train dspark`). Cutting is lossless because c_k reads the token before row k,
  never row k's own: whether a token is verified never depends on its own value (a confidence of the drafted token
  itself, q(x_k), biases the output: tests/test_dspark.py catches it, and a rule that peeks at the target).
  `release=1` (the default): at a load where the profiled drafting cost says drafting cannot pay (`DSpark.plain`),
  the batch releases its requests' drafters, so those steps cost what `none`'s do (`release=0` keeps them).

A spec is `name` or `name:key=value,...`; `parse_policy` checks it before any model loads (one line).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from speclab.checks import Bound, check_number
from speclab.errors import InvalidInput

POLICIES = ("none", "fixed", "table", "goodput", "dspark")
MAX_K = 64
DEFAULT_TABLE = "1-2=4,3-8=3,9-16=2,17-64=1"


@dataclass
class StepCost:
    """Modeled ms of one batched step: verify0 + verify1 x rows + per_request x requests (the target forward over
    all requests' rows, `Target.forward_many`), plus draft_ms per draft token (learned online from the steps).

    A draft token costs its drafting and what drafting adds to the verification after it: on a machine whose caches
    other work shares, the target's call is slower the longer it waited (`speclab costs roofline`'s gaps), and the
    profile times it back to back. So `learn` counts a drafting step's verification beyond the model, less what the
    steps without drafts leave beyond it (`plain_excess`), as drafting's (once such a step has been seen: before,
    the excess cannot be told from the verification's own time beyond the profile)."""
    verify0: float
    verify1: float
    per_request: float
    draft_ms: float = 0.0
    plain_excess: float | None = None  # ms a step without drafts verifies beyond the model (a moving average)
    drafting: tuple[float, float, float] | None = None  # a drafting step's ms beyond `ms` (its drafter call and its
    # slower verification): intercept, per draft token, per request, profiled with the method's drafters (None: not)

    def ms(self, rows: int, requests: int, drafted: int = 0) -> float:
        return self.verify0 + self.verify1 * rows + self.per_request * requests + self.draft_ms * drafted

    def describe(self) -> str:
        """The model in words (serve-bench prints it and its report keeps it)."""
        text = (f"a batched step {self.verify0:.2f} ms + {self.verify1:.3f} a row + {self.per_request:.3f} a request")
        if self.drafting is not None:
            c0, per_token, per_request = self.drafting
            text += f"; drafting adds {c0:.2f} ms + {per_token:.3f} a draft token + {per_request:.3f} a request"
        return text

    def drafting_ms(self, requests: int, drafted: int) -> float:
        """The profiled ms a step of `requests` drafting `drafted` tokens in all takes beyond `ms` (0 unprofiled)."""
        if self.drafting is None:
            return 0.0
        c0, per_token, per_request = self.drafting
        return max(0.0, c0 + per_token * drafted + per_request * requests)

    def learn(self, ev) -> None:
        """From a step (`StepEvent`): without drafts, `plain_excess`; with drafts, `draft_ms` (its draft ms and its
        verification's excess over a plain step's, per draft token), moving averages over such steps."""
        n = sum(ev.drafted)
        excess = ev.ms["verify"] - self.ms(ev.rows, len(ev.rids))
        if not n:
            self.plain_excess = excess if self.plain_excess is None else 0.8 * self.plain_excess + 0.2 * excess
            return
        slower = max(0.0, excess - self.plain_excess) if self.plain_excess is not None else 0.0  # none seen: none
        per = (ev.ms["draft"] + slower) / n
        self.draft_ms = per if self.draft_ms == 0 else 0.8 * self.draft_ms + 0.2 * per

    @classmethod
    def profile(cls, target, context: int = 128, requests=(1, 4, 16), rows=(1, 4), reps: int = 5,
                make_drafters=None) -> StepCost:
        """Time the batched forward at a few (requests, rows per request) after `context` cached tokens each and fit
        the three terms (least squares, none below 0); with `make_drafters` (a request's drafters), what drafting adds
        to a step too (`profile_drafting`)."""
        import numpy as np

        from speclab.core.lean import Segment
        ids = torch.randint(0, target.vocab_size, (context + max(rows),), generator=torch.Generator().manual_seed(0))
        X, y = [], []
        for b in requests:
            caches = []
            for _ in range(b):
                c = target.new_cache(context + max(rows))
                target.forward(ids[:context], c)
                caches.append(c)
            for r in rows:
                segs = [Segment(ids[context : context + r], c) for c in caches]
                times = []
                for _ in range(reps):
                    t = time.perf_counter()
                    target.forward_many(segs)
                    times.append((time.perf_counter() - t) * 1e3)
                    for c in caches:
                        c.crop(context)
                X.append([1.0, b * r, b])
                y.append(float(np.median(times)))
        coef = np.linalg.lstsq(np.array(X), np.array(y), rcond=None)[0]
        cost = cls(*(float(max(c, 0.0)) for c in coef))
        if make_drafters is not None:
            cost.drafting = cost.profile_drafting(target, make_drafters, context)
        return cost

    def profile_drafting(self, target, make_drafters, context: int = 128, requests=(1, 4, 16), ks=(2, 8),
                         steps: int = 8) -> tuple[float, float, float]:
        """What drafting adds to a step: batches of each number of `requests` (prompts of `context` random tokens)
        drafting k tokens each (`Fixed`) for `steps` steps; each step's drafting and verification ms beyond `ms`
        (the medians of the steps after the first two, which catch up on the prompts), fitted by least squares on
        the draft tokens and the requests."""
        import numpy as np

        from speclab.core.batch import Batch, Request
        from speclab.core.sampling import Sampling
        ids = torch.randint(0, target.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
        X, y = [], []
        for b in requests:
            for k in ks:
                batch = Batch(target, make_drafters, Fixed(k), Sampling(), max_batch=b, stop_on_eos=False)
                for r in range(b):
                    batch.submit(Request(r, ids, steps * (k + 1)))
                evs = [batch.step() for _ in range(steps)][2:]
                X.append([1.0, sum(evs[-1].drafted), b])
                y.append(float(np.median([ev.ms["draft"] + ev.ms["verify"] - self.ms(ev.rows, b) for ev in evs])))
        c0, per_token, per_request = np.linalg.lstsq(np.array(X), np.array(y), rcond=None)[0]
        return float(c0), float(per_token), float(per_request)


def admit(survival: list[list[float]], cost: StepCost) -> list[int]:
    """Draft lengths by DSpark's rule: every request starts at 0 drafts (its root row: 1 token expected); candidate
    tokens (request r's j-th, surviving with probability survival[r][j - 1], non-increasing in j) are admitted in
    descending survival while Theta = expected tokens x steps per second rises, stopping at the first that does not
    raise it. The decision is made before verification (non-anticipating)."""
    n = len(survival)
    ks = [0] * n
    tokens, rows, drafted = float(n), n, 0
    best = tokens / cost.ms(rows, n)
    order = sorted(((a, r, j) for r, surv in enumerate(survival) for j, a in enumerate(surv)), key=lambda t: -t[0])
    for a, r, j in order:
        if j != ks[r]:  # only a prefix of a request's draft can be accepted
            continue
        theta = (tokens + a) / cost.ms(rows + 1, n, drafted + 1)
        if theta <= best:
            break
        tokens, rows, drafted, best, ks[r] = tokens + a, rows + 1, drafted + 1, theta, j + 1
    return ks


class NoDraft:
    name = "none"

    def lengths(self, streams) -> list[int]:
        return [0] * len(streams)


class Fixed:
    name = "fixed"

    def __init__(self, k: int = 4):
        self.k = k

    def lengths(self, streams) -> list[int]:
        return [self.k] * len(streams)


class Table:
    name = "table"

    def __init__(self, table: dict[tuple[int, int], int]):
        self.table = table

    def k_at(self, size: int) -> int:
        return next((k for (lo, hi), k in self.table.items() if lo <= size <= hi), 0)

    def lengths(self, streams) -> list[int]:
        return [self.k_at(len(streams))] * len(streams)


class Goodput:
    name = "goodput"

    def __init__(self, k: int = 8, alpha0: float = 0.6, cost: StepCost | None = None):
        self.k, self.alpha0, self.cost = k, alpha0, cost

    def lengths(self, streams) -> list[int]:
        assert self.cost is not None, "goodput needs its StepCost (profiled at start)"
        alphas = [self.alpha0 if math.isnan(s.accept_ema) else min(s.accept_ema, 0.99) for s in streams]
        return admit([[a ** j for j in range(1, self.k + 1)] for a in alphas], self.cost)

    def observe(self, ev) -> None:
        if self.cost is not None:
            self.cost.learn(ev)


class DSpark:
    name = "dspark"
    confidence = True  # the batch asks each request's drafter for its rows' c_k
    PROBE_EVERY = 8  # steps without drafting after which the batch drafts once more (fresh confidences); with
    # `measured`, steps after which the choice measured slower is taken once more (a fresh measurement), doubled
    # after every probe that left it slower (up to PROBE_MAX) and back to PROBE_EVERY when the faster side changes
    PROBE_MAX = 64
    PROBE_BUDGET = 0.02  # and at most this share of the time: a probe waits until its expected cost (what the last
    # one cost per request, over the faster side's time for the tokens it committed, times the requests now) is this
    # share of the time since the last one (at 32 requests a drafting probe costs several steps)
    RATE_WEIGHT = 0.2  # a step's weight in the moving averages of the blocks' survivals
    REQUEST_WEIGHT = 0.05  # a request-step's in those of measured throughput: a step of n requests weighs
    # 1 - 0.95 ** n (0.19 at 4, 0.34 at 8); at one request a step commits 1 to k + 1 tokens, and with a step's weight
    # of 0.2 drafting's measured rate fell below plain decoding's every few steps (it drafted half the steps, 1.01x)
    PRIOR = 0.75  # `may_pay`'s survival per draft token before any block was drafted: the zoo DFlash head's c_k
    # averaged over its blocks' positions (4 zoo prompts x 128 tokens greedy: 0.70 / 0.51 / 0.37 / 0.28 / 0.21 / 0.16
    # / 0.12 / 0.10 for the first eight, 2.45 in all, against 2.38 accepted a round; 0.75 ** j sums to 2.70)
    PROBE_STEPS = 2  # a measurement takes its side for at least this many steps in a row: the first after the other
    # side (a switch) pays for it (drafting after idle steps: the drafters' catch-up of every one of them), so only
    # the steps after it measure the side itself
    MEASURE_REQUEST_STEPS = 4  # and drafting for at least this many request-steps after its switch (one request's
    # drafting step commits 1 to k + 1 tokens: at one request, a single step measured drafting slower than it was)

    def __init__(self, k: int = 8, cost: StepCost | None = None, measured: int = 1, release: int = 1):
        self.k, self.measured, self.release = k, bool(measured), bool(release)
        self.cost = None if cost is None else StepCost(cost.verify0, cost.verify1, cost.per_request,
                                                       drafting=cost.drafting)  # no learned draft cost
        self.kept: dict[int, int] = {}  # request -> the drafts its last admission kept
        self.surv: dict[int, list[float]] = {}  # request -> its last block's survival products
        self.call_ms = 0.0  # a drafting step's drafter call (every request's block in one call): a moving average
        self.idle = 0  # steps since the batch last drafted
        self.rate: dict[bool, float] = {}  # drafted or not -> committed tokens per ms of such steps (moving averages
        self.sums: dict[bool, tuple[float, float]] = {}  # of their tokens and of their ms, `sums`: rate = tokens / ms)
        self.measured_steps: dict[bool, int] = {}  # drafted or not -> the steps measured in `rate`
        self.since = 0  # steps since the choice measured slower was last taken
        self.every = self.PROBE_EVERY  # steps between two such probes now
        self.best: bool | None = None  # the faster side at the last decision
        self.probing = False  # whether this step takes the side measured slower (a probe)
        self.probe_ms = 0.0  # the last probe's cost per request: its ms over the faster side's for its tokens
        self.since_ms = 0.0  # ms of steps since the last probe
        self.last: dict[bool, tuple[float, int, int]] = {}  # drafted or not -> its last step's ms, tokens, requests
        self.prev: bool | None = None  # whether the last step drafted (None: no step yet)
        self.window = 0  # steps left that keep `self.side` (a measurement of it)
        self.side = True
        self.mean_surv = [self.PRIOR ** j for j in range(1, k + 1)]  # survival products by block position: the
        # blocks' moving average (a request that has not drafted is taken to survive as they do)
        self.held = 0  # steps left before the profile is asked again whether drafting can pay (`may_pay`)
        self.plain_at: dict[int, bool] = {}  # batch size -> `plain`'s answer for the blocks' survivals as they are

    def drafts_now(self, streams, old) -> bool:
        """Whether the batch drafts this step. `measured`: the choice with the higher measured throughput (committed
        tokens per ms of the steps that drafted, and of those that did not: each tried first, then the slower one
        again after PROBE_EVERY steps, less and less often while it stays slower, and never more than PROBE_BUDGET of
        the time), so the batch does not stay on the slower side. Each measurement takes its side `measure_steps` steps
        in a row and counts only those after the first: a step after the other side pays for the switch (drafting
        after idle steps: the drafters' catch-up of every one of them). Counted as drafting's, those catch-ups had
        kept drafting measured slower at one request, where it is faster. Otherwise the modeled test: the admission
        of the last survivals against the verification rows plus one drafter call."""
        if self.measured and self.window:  # inside a measurement: its side
            self.window -= 1
            return self.side
        if self.measured and len(self.rate) < 2:  # measure drafting first, then not drafting
            if True not in self.rate and not self.may_pay(streams):
                return False  # not while drafting cannot pay by the profile
            self.side = True not in self.rate
            self.window = self.measure_steps(self.side, len(streams)) - 1
            return self.side
        if self.measured:
            best = self.rate[True] >= self.rate[False]
            if best != self.best:  # the faster side changed (or is known for the first time): look often again
                self.best, self.every, self.since = best, self.PROBE_EVERY, 0
            self.since += 1
            if self.since > self.every and self.since_ms * self.PROBE_BUDGET >= self.probe_ms * len(streams) \
                    and (best or self.may_pay(streams)):
                self.since, self.every = 0, min(2 * self.every, self.PROBE_MAX)
                self.probing = True
                self.side, self.window = not best, self.measure_steps(not best, len(streams)) - 1
                return not best
            return best
        if self.cost is not None and self.call_ms and all(o is not None for o in old) \
                and self.idle < self.PROBE_EVERY:
            return self._drafting_pays(old, self.call_ms)
        return True

    def _drafting_pays(self, surv: list[list[float]], extra_ms: float) -> bool:
        """Whether blocks with these survivals, each cut by `admit`, commit more tokens per ms than a plain step when
        drafting them adds `extra_ms` to the step (the expected tokens of a kept prefix: its survivals summed)."""
        assert self.cost is not None
        n, ks = len(surv), admit(surv, self.cost)
        gain = sum(sum(a[:k]) for a, k in zip(surv, ks))
        return (n + gain) / (self.cost.ms(n + sum(ks), n) + extra_ms) > n / self.cost.ms(n, n)

    def may_pay(self, streams) -> bool:
        """Whether drafting this step could commit more tokens per ms than a step without drafts, by the profile
        (`StepCost.drafting`: a drafting step's drafter call and slower verification, measured at start) and the
        blocks' survivals by position averaged over the steps (PRIOR ** j before any; one request's last block is
        too noisy to stop its probes on), each request's block cut by `admit`. Asked before drafting is measured,
        first or in a probe, so a batch where drafting cannot pay does not pay to find out (at 32 requests a drafting
        step with the catch-up of every prompt costs several steps). True where the cost was not profiled; after a
        no, asked again PROBE_EVERY steps later (no between), the averages moved a step back toward the prior."""
        if self.cost is None or self.cost.drafting is None:
            return True
        if self.held:
            self.held -= 1
            return False
        pays = self._profile_pays(self.blocks(streams))
        if not pays:  # the averages move only when blocks are drafted: a few poor early ones (a prompt's first tokens)
            # would keep drafting off for good, so each no moves them back toward the prior (at loads where even the
            # prior cannot pay, the answer stays no)
            self.mean_surv = [a + self.RATE_WEIGHT * (self.PRIOR ** (j + 1) - a) for j, a in enumerate(self.mean_surv)]
        self.held = 0 if pays else self.PROBE_EVERY
        return pays

    def plain(self, n: int) -> bool:
        """Whether this policy drafts for none of a batch of n requests from now on (`speclab.core.batch.Policy`:
        the batch then releases their drafters, and a step costs what plain decoding's does): with `release`, where
        the profile (`StepCost.drafting`) says that n requests drafting a block of k each, at the head's typical
        survivals (PRIOR ** j) and cut by `admit`, cannot commit more tokens per ms than a plain step, and drafting was
        not measured faster (`measured`). Without a profile: never. A load question, so not the blocks' running
        averages: released drafters never draft again, and at one request a few poor first blocks (a prompt's first
        tokens) had released them for good where drafting pays 1.3x."""
        if not self.release or self.cost is None or self.cost.drafting is None:
            return False
        if self.measured and True in self.rate and False in self.rate and self.rate[True] >= self.rate[False]:
            return False
        if n not in self.plain_at:
            self.plain_at[n] = not self._profile_pays([self.k] * n, prior=True)
        return self.plain_at[n]

    def _profile_pays(self, blocks: list[int], prior: bool = False) -> bool:
        """Whether requests drafting blocks of these lengths, at the blocks' average survivals (`prior`: the head's
        typical ones, PRIOR ** j) and cut by `admit`, commit more tokens per ms than a plain step, with the profiled
        drafting cost (`StepCost.drafting_ms`)."""
        assert self.cost is not None
        surv = [[self.PRIOR ** j for j in range(1, b + 1)] if prior else self.mean_surv[:b] for b in blocks]
        return self._drafting_pays(surv, self.cost.drafting_ms(len(surv), sum(len(a) for a in surv)))

    def measure_steps(self, drafting: bool, n: int) -> int:
        """How many steps in a row a measurement of a side takes at n requests (its switch and those it measures):
        drafting, enough for MEASURE_REQUEST_STEPS; not drafting, whose steps commit n tokens each, PROBE_STEPS."""
        if not drafting:
            return self.PROBE_STEPS
        return max(self.PROBE_STEPS, 1 + math.ceil(self.MEASURE_REQUEST_STEPS / max(n, 1)))

    def blocks(self, streams) -> list[int]:
        """Each request's block: as long as its last admission kept, plus one (at most k; a new request: k)."""
        return [min(self.k, self.kept.get(s.req.rid, self.k - 1) + 1) for s in streams]

    def lengths(self, streams) -> list[int]:
        """How long each block is, from the last step's confidences (the production variant's capacity from older
        confidences, §5.2; past steps only, never this step's drafts): first whether the batch drafts at all this
        step (`drafts_now`); then a block as long as the request's last admission kept, plus one (at most k; a new
        request: k)."""
        if not self.drafts_now(streams, [self.surv.get(s.req.rid) for s in streams]):
            self.idle += 1
            return [0] * len(streams)
        self.idle = 0
        return self.blocks(streams)

    def trim(self, streams, trees) -> list[int]:
        """DSpark's admission over this step's drafts (the drafting is paid: only the verification rows count)."""
        assert self.cost is not None, "dspark needs its StepCost (profiled at start)"
        if any(len(t) and "confidence" not in t.extra for t in trees):
            raise InvalidInput("dspark: the drafts carry no confidence (the DFlash drafter needs DSpark's confidence "
                               "head: speclab train dspark)")
        surv = [t.extra["confidence"].cumprod(0).tolist() if len(t) else [] for t in trees]
        if not any(surv):
            return [0] * len(trees)
        ks = admit(surv, self.cost)
        for s, a, k in zip(streams, surv, ks):
            if a:
                self.surv[s.req.rid], self.kept[s.req.rid] = a, k
        for j in range(len(self.mean_surv)):  # the average survival at each position this step's blocks reach
            at = [a[j] for a in surv if len(a) > j]
            if at:
                self.mean_surv[j] += self.RATE_WEIGHT * (sum(at) / len(at) - self.mean_surv[j])
        self.plain_at.clear()
        return ks

    def observe(self, ev) -> None:
        if ev.drafter_calls:
            self.call_ms = ev.ms["draft"] if not self.call_ms else 0.8 * self.call_ms + 0.2 * ev.ms["draft"]
        ms = sum(v for phase, v in ev.ms.items() if phase != "prefill")  # admissions are not the choice's
        if not ev.rids or ms <= 0:
            return
        key, tokens = ev.drafter_calls > 0, len(ev.rids) + sum(ev.accepted)  # drafted: the call was paid
        switch, self.prev = key != self.prev, key
        self.last[key] = (ms, tokens, len(ev.rids))
        if switch:  # the step pays for the switch (drafting after idle steps: the drafters' catch-up of every one),
            # not for its side, so it is not measured. A probe's switch is what a probe costs: its ms over the other
            # side's time for its tokens, per request
            if self.probing:
                self.probe_ms, self.probing, self.since_ms = self._extra_ms(key, ms, tokens, len(ev.rids)), False, 0.0
            else:
                self.since_ms += ms
            return
        first = key not in self.rate
        self.measured_steps[key] = self.measured_steps.get(key, 0) + 1
        # the mean of the first steps, then moving averages, each step weighted by its requests
        w = max(1 - (1 - self.REQUEST_WEIGHT) ** len(ev.rids), 1 / self.measured_steps[key])
        t0, m0 = self.sums.get(key, (tokens, ms))
        self.sums[key] = ((1 - w) * t0 + w * tokens, (1 - w) * m0 + w * ms)
        self.rate[key] = self.sums[key][0] / self.sums[key][1]
        if first and len(self.rate) == 2:  # both sides measured once: a probe's cost, as the slower side's step
            side = self.rate[True] < self.rate[False]
            self.probe_ms, self.since_ms = self._extra_ms(side, *self.last[side]), 0.0
        else:
            self.since_ms += ms

    def _extra_ms(self, side: bool, ms: float, tokens: int, n: int) -> float:
        """A step of `side`'s cost beyond the other side's time for its tokens, per request (a probe's cost)."""
        return max(0.0, ms - tokens / self.rate[not side]) / n


def parse_policy(spec: str) -> tuple[str, dict]:
    """'name:key=value,...' checked (one line, InvalidInput) -> (name, params)."""
    name, _, rest = spec.strip().partition(":")
    if name not in POLICIES:
        raise InvalidInput(f"--policy {spec!r}: unknown policy {name!r}; one of {', '.join(POLICIES)}")
    items = [kv for kv in rest.split(",") if kv.strip()] if rest else []
    pairs = []
    for kv in items:
        k, eq, v = kv.partition("=")
        if not eq or not k.strip() or not v.strip():
            raise InvalidInput(f"--policy {spec!r}: {kv!r} is not key=value")
        pairs.append((k.strip(), v.strip()))
    if name == "none":
        if pairs:
            raise InvalidInput(f"--policy {spec!r}: none takes no parameters")
        return name, {}
    if name == "table":
        return name, {"table": parse_table(pairs or [tuple(kv.split("=")) for kv in DEFAULT_TABLE.split(",")], spec)}
    known = {"fixed": {"k": (int, Bound(0, MAX_K))},
             "goodput": {"k": (int, Bound(1, MAX_K)), "alpha0": (float, Bound(0.0, 0.99))},
             "dspark": {"k": (int, Bound(1, MAX_K)), "measured": (int, Bound(0, 1)),
                        "release": (int, Bound(0, 1))}}[name]
    params = {}
    for k, v in pairs:
        if k not in known:
            raise InvalidInput(f"--policy {spec!r}: {name} has no parameter {k!r} (it has {', '.join(known)})")
        kind, bound = known[k]
        try:
            params[k] = check_number(f"{name} {k}", v, kind, bound)
        except InvalidInput as e:
            raise InvalidInput(f"--policy {spec!r}: {e}") from None
    return name, params


def parse_table(pairs, spec: str) -> dict[tuple[int, int], int]:
    """'lo-hi' = k pairs: ranges of batch sizes, none overlapping, k in 0..MAX_K."""
    table: dict[tuple[int, int], int] = {}
    for rng, k in pairs:
        lo, dash, hi = str(rng).partition("-")
        try:
            lo_i, hi_i, k_i = int(lo), int(hi) if dash else int(lo), int(k)
        except ValueError:
            raise InvalidInput(f"--policy {spec!r}: {rng}={k} is not lo-hi=k (batch sizes, a draft length)") from None
        if not 1 <= lo_i <= hi_i or not 0 <= k_i <= MAX_K:
            raise InvalidInput(f"--policy {spec!r}: {rng}={k} needs 1 <= lo <= hi and 0 <= k <= {MAX_K}")
        if any(lo_i <= h and l_ <= hi_i for l_, h in table):
            raise InvalidInput(f"--policy {spec!r}: the range {rng} overlaps another")
        table[(lo_i, hi_i)] = k_i
    return table


def build_policy(spec: str, cost: StepCost | None = None):
    name, params = parse_policy(spec)
    if name == "none":
        return NoDraft()
    if name == "fixed":
        return Fixed(**params)
    if name == "table":
        return Table(params["table"])
    if name == "dspark":
        return DSpark(cost=cost, **params)
    return Goodput(cost=cost, **params)


def needs_cost(spec: str) -> bool:
    return parse_policy(spec)[0] in ("goodput", "dspark")
