"""DSpark (`speclab.train.dspark`, `speclab.serve.policies.DSpark`): the calibration metrics, the sequential temperature
scaling, the confidence head on a DFlash drafter (its c_k on every drafted row, trained and calibrated by `speclab
train dspark`), the scheduler's cut drafts decoding exactly as alone, and its sampled outputs keeping the target's
distribution where a retrospective rule (one that peeks at the target) is caught by the same test."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from helpers import PROMPTS
from speclab.core.batch import Batch, Request
from speclab.core.engine import decode
from speclab.core.protocol import FixedRouter
from speclab.core.sampling import Sampling, logits_to_probs
from speclab.core.tree import DraftTree
from speclab.drafters.registry import build_drafter
from speclab.metrics import auroc, brier, ece
from speclab.serve.policies import DSpark, StepCost, admit
from speclab.train.dspark import calibration_table, fit_scaling, survival, with_head


def test_calibration_metrics_follow_their_definitions():
    p, y = np.array([0.1, 0.1, 0.9, 0.9]), np.array([0, 1, 1, 1])
    assert math.isclose(ece(p, y), 0.5 * abs(0.5 - 0.1) + 0.5 * abs(1.0 - 0.9))
    assert math.isclose(brier(p, y), (0.01 + 0.81 + 0.01 + 0.01) / 4)
    assert math.isclose(auroc(p, y), (0.5 + 1 + 1) / 3)  # one positive ties the negative
    assert math.isnan(auroc(p, np.ones(4)))


def test_sequential_scaling_undoes_an_overconfident_head():
    """Logits twice as sharp as the truth: row by row the fitted temperatures come out near 2, the biases near 0, and
    the cumulative product's ECE falls to a few hundredths at every row, with AUROC unchanged (scaling keeps the
    order)."""
    g = torch.Generator().manual_seed(0)
    true = torch.randn(20000, 4, generator=g) + 1.0
    accepted = (torch.rand(20000, 4, generator=g) < torch.sigmoid(true)).long().cumprod(-1).bool()
    temps, biases = fit_scaling(2 * true, accepted)
    assert all(1.5 < t < 2.7 for t in temps) and all(abs(b) <= 0.25 for b in biases), (temps, biases)
    table = calibration_table(2 * true, accepted, temps, biases)
    assert all(r["ece_after"] < 0.03 < r["ece_before"] for r in table[:2]), table
    assert all(r["ece_after"] < 0.03 for r in table)
    assert all(math.isclose(r["auroc_before"], r["auroc_after"], rel_tol=1e-6) for r in table[:1])
    np.testing.assert_allclose(survival(2 * true[:3], temps, biases)[:, 0],
                               torch.sigmoid(2 * true[:3, 0] / temps[0] + biases[0]), rtol=1e-5)


def test_the_bias_moves_a_mean_no_temperature_can():
    """A head whose logits are the truth's plus 1.5 (too confident on average, not too sharp): the bias comes out
    near -1.5, the temperature near 1, and the first row's ECE falls below 0.02; with a temperature alone the best
    ECE stays above 0.05 (a temperature rescales the logits around 0: it cannot move their mean)."""
    from speclab.metrics import ece
    from speclab.train.dspark import TEMPERATURES
    g = torch.Generator().manual_seed(1)
    true = torch.randn(20000, 2, generator=g) * 2.0
    accepted = (torch.rand(20000, 2, generator=g) < torch.sigmoid(true)).long().cumprod(-1).bool()
    temps, biases = fit_scaling(true + 1.5, accepted)
    assert abs(biases[0] + 1.5) <= 0.2 and 0.8 < temps[0] < 1.25, (temps, biases)
    assert calibration_table(true + 1.5, accepted, temps, biases)[0]["ece_after"] < 0.02
    y = accepted[:, 0].numpy()
    assert min(ece(torch.sigmoid((true[:, 0] + 1.5) / t).numpy(), y) for t in TEMPERATURES) > 0.05


@pytest.fixture(scope="module")
def dspark(deep, trained_dflash):
    """The tiny trained DFlash drafter with a confidence head (random weights: what the head predicts does not
    matter for losslessness, only that the scheduler cuts by it)."""
    import copy
    m = copy.deepcopy(trained_dflash)
    with_head(m)
    w = m.confidence_head.weight  # drawn on the CPU (its generator's device), then put where the head is
    with torch.no_grad():
        w.copy_(torch.empty(w.shape).normal_(0, 0.5, generator=torch.Generator().manual_seed(1)))
    return m.requires_grad_(False)


def test_the_head_gives_every_drafted_row_its_confidence(deep, dspark):
    d = build_drafter("dflash", deep, {"dflash": dspark}, block_size=6, markov=1)
    ids = torch.tensor(deep.tokenizer(PROMPTS[0])["input_ids"])
    d.reset(ids, deep.forward(ids[:-1], deep.new_cache(), layers=d.layers).features)
    d.catch_up(ids[:0], None)
    assert "confidence" not in d.propose(5, Sampling(), None).extra  # nobody asked: not computed
    d.commit(DraftTree.empty(), torch.zeros(0, dtype=torch.long))
    d.confidence = True  # what the batch sets for a scheduler that reads it (DSpark's)
    tree = d.propose(5, Sampling(), None)
    c = tree.extra["confidence"]
    assert c.shape == (5,) and ((c > 0) & (c < 1)).all()
    prev = torch.cat([ids[-1:].to(tree.tokens.device), tree.tokens[:-1]])
    torch.testing.assert_close(c, torch.sigmoid(dspark.confidence_logits(d.last_h[:5], prev).float()))


def test_dspark_cuts_drafts_and_each_request_decodes_as_alone(deep, dspark):
    """Four requests under the scheduler: the drafts are cut to different lengths (by the survival products),
    never longer than drafted, and every output is its single-stream decode's (greedy, fp32)."""
    def make():
        return {"dflash": build_drafter("dflash", deep, {"dflash": dspark}, block_size=6, markov=1)}
    ids = [torch.tensor(deep.tokenizer(p)["input_ids"]) for p in PROMPTS]
    batch = Batch(deep, make, DSpark(k=5, cost=StepCost(4.0, 0.5, 0.2), measured=0), Sampling(), max_batch=4)
    for i, x in enumerate(ids):
        batch.submit(Request(i, x, 24))
    kept = []
    while not batch.idle:
        kept += batch.step().drafted
    assert len(set(kept)) > 2 and max(kept) <= 5
    for i, x in enumerate(ids):
        ds = make()
        assert torch.equal(batch.done[i].new_ids, decode(deep, x, ds, FixedRouter("dflash"), 24).new_ids), i


def test_where_drafting_cannot_pay_the_batch_releases_the_drafters(deep, dspark):
    """`DSpark.plain`: the profile here says drafting pays for one request and not for two or more (each request's
    drafting adds 1 ms to a 1 + 0.1 x rows ms step). A request admitted alone drafts; once a batch of four is there
    every request's drafters are released (the one that drafted too, mid-decode) and the newcomers get none, so the
    steps make no drafter call and keep no features; one admitted alone after them drafts again. Every output is
    its single-stream AR decode's (greedy, fp32); with `release=0` the requests keep their drafters."""
    def make():
        return {"dflash": build_drafter("dflash", deep, {"dflash": dspark}, block_size=5, markov=1)}

    def policy(release=1):
        return DSpark(k=4, cost=StepCost(1.0, 0.1, 0.0, drafting=(0.0, 0.0, 1.0)), measured=0, release=release)
    assert not policy().plain(1) and policy().plain(2) and policy().plain(4) and not policy(0).plain(4)
    ids = [torch.tensor(deep.tokenizer(p)["input_ids"]) for p in PROMPTS]
    batch = Batch(deep, make, policy(), Sampling(), max_batch=4)
    batch.submit(Request(0, ids[0], 24))
    assert batch.step().drafter_calls and batch.step() and batch.active[0].seq.feats is not None  # alone: it drafts
    for i in (1, 2, 3):
        batch.submit(Request(i, ids[i], 24))
    crowded = []
    while not batch.idle:
        crowded.append(batch.step())
    assert not any(ev.drafter_calls for ev in crowded) and len(crowded[0].rids) == 4
    batch.submit(Request(4, ids[0], 24))  # alone again: a new request gets its drafters
    alone = []
    while not batch.idle:
        alone.append(batch.step())
    assert alone[0].drafter_calls and sum(alone[0].drafted) > 0
    for i, x in enumerate(ids + [ids[0]]):
        assert torch.equal(batch.done[i].new_ids, decode(deep, x, None, None, 24).new_ids), i
    kept = Batch(deep, make, policy(release=0), Sampling(), max_batch=4)
    for i, x in enumerate(ids):
        kept.submit(Request(i, x, 8))
    kept.step()
    assert all(s.name == "dflash" and s.seq.feats is not None for s in kept.active)


@pytest.mark.parametrize("probe_ms", [0.5, 14.95])
def test_measured_scheduling_takes_the_faster_side_and_keeps_measuring_the_other(probe_ms):
    """With `measured` (the default) the batch drafts or not by the measured throughput of each (committed tokens per
    ms of the steps that drafted and of those that did not, a step after the other side not counted): each measured
    first, then the faster one, with the
    slower one probed after PROBE_EVERY steps and then less often while it stays slower, and never more than
    PROBE_BUDGET of the time (a probe that costs 14.95 ms more than the faster side would for its tokens waits 150
    5-ms steps; one that costs 0.5 ms waits for the step count); drafting that turns faster moves the choice."""
    from types import SimpleNamespace

    from speclab.core.batch import StepEvent
    p = DSpark(k=4, cost=StepCost(1.0, 0.1, 0.0))
    streams = [SimpleNamespace(req=SimpleNamespace(rid=i)) for i in range(4)]

    def step(drafting: bool, ms: float) -> None:
        ks = p.lengths(streams)
        assert (sum(ks) > 0) == drafting, ks
        half = ms / 2 if drafting else 0.0
        p.observe(StepEvent(0, 0.0, [0, 1, 2, 3], ks, [0] * 4, 4 + sum(ks), 1, int(drafting), 0,
                            {"prefill": 50.0, "draft": half, "verify": ms - half}))
    step(True, 5.0 + probe_ms)  # drafting first, twice (the first step pays the switch and is not counted): 4 tokens
    step(True, 5.0 + probe_ms)  # (no draft accepted) in 5 + probe_ms ms,
    step(False, 5.0)  # then not drafting, twice: 4 tokens in 5 ms
    step(False, 5.0)
    assert p.rate == {True: pytest.approx(4 / (5.0 + probe_ms)), False: pytest.approx(0.8)}
    assert p.probe_ms * 4 == pytest.approx(probe_ms)  # the slower side's cost: over 5 ms for its 4 tokens
    wait = max(p.PROBE_EVERY, math.ceil(probe_ms / (p.PROBE_BUDGET * 5.0)))  # steps before the first probe
    choices = []
    for _ in range(2 * wait + 2 * p.PROBE_EVERY + 2):
        drafts = sum(p.lengths(streams)) > 0
        choices.append(drafts)
        p.observe(StepEvent(0, 0.0, [0, 1, 2, 3], [4 * drafts] * 4, [0] * 4, 4, 1, int(drafts), 0,
                            {"draft": probe_ms / 2 * drafts, "verify": 5.0 + probe_ms / 2 * drafts}))
    # the slower side probed after PROBE_EVERY steps (or its time budget), two steps in a row (the switch, then one
    # measured), then after twice as many steps (it stayed slower; or its time budget again)
    on = [i for i, c in enumerate(choices) if c]
    assert len(on) == 4 and on[:2] == [wait, wait + 1] and on[3] == on[2] + 1, on
    assert on[2] - on[1] > 2 * p.PROBE_EVERY and on[2] - on[1] >= 0.95 * probe_ms / (p.PROBE_BUDGET * 5.0), on
    for _ in range(6):  # drafting turns faster (every draft accepted): the choice moves to it
        p.observe(StepEvent(0, 0.0, [0, 1, 2, 3], [4] * 4, [4] * 4, 20, 1, 1, 0, {"draft": 2.0, "verify": 3.0}))
    assert sum(p.lengths(streams)) > 0
    off = DSpark(k=4, cost=StepCost(1.0, 0.1, 0.0), measured=0)  # measured=0: the modeled test alone
    assert sum(off.lengths(streams)) > 0 and not off.rate


def test_a_switch_steps_catch_up_is_not_counted_as_drafting():
    """Drafting whose first step after idle steps pays a long catch-up (50 ms) but whose next steps commit twice the
    tokens of a plain step in the same time: the measured choice settles on drafting (counting the catch-up as
    drafting's own cost had kept it measured slower, and probed only rarely)."""
    from types import SimpleNamespace

    from speclab.core.batch import StepEvent
    p = DSpark(k=4, cost=StepCost(1.0, 0.1, 0.0))
    streams = [SimpleNamespace(req=SimpleNamespace(rid=i)) for i in range(2)]
    choices, prev = [], False
    for _ in range(40):
        drafts = sum(p.lengths(streams)) > 0
        choices.append(drafts)
        ms = 50.0 if drafts and not prev else 5.0  # a switch to drafting: the drafters catch up first
        p.observe(StepEvent(0, 0.0, [0, 1], [4 * drafts] * 2, [2 * drafts] * 2, 2 + 8 * drafts, 1, int(drafts), 0,
                            {"draft": ms / 2 * drafts, "verify": ms - ms / 2 * drafts}))
        prev = drafts
    assert sum(choices[4:]) >= 0.9 * len(choices[4:]) and p.rate[True] > p.rate[False]  # (not drafting: probes)


def test_the_profile_keeps_drafting_from_being_measured_where_it_cannot_pay():
    """With a profiled drafting cost (`StepCost.drafting`), DSpark does not draft to measure drafting where the profile
    says a drafting step cannot commit tokens faster than a plain one: here each request's drafter work costs 3 ms
    a step (per_request) against a 1.1 ms plain step of one request. At one request a 4-token block at the prior's
    survivals (0.75 ** j) would commit 1 + 2.05 tokens in 1.5 + 3 ms (0.68 a ms) against 0.91 a ms: no drafting,
    and none in the probes either; a cheaper profile (0.2 ms a request) lets it measure drafting first as before."""
    from types import SimpleNamespace

    from speclab.core.batch import StepEvent
    for per_request, drafts in ((3.0, False), (0.2, True)):
        p = DSpark(k=4, cost=StepCost(1.0, 0.1, 0.0, drafting=(0.0, 0.0, per_request)))
        streams = [SimpleNamespace(req=SimpleNamespace(rid=0))]
        assert (sum(p.lengths(streams)) > 0) == drafts
        if drafts:
            continue
        for _ in range(20 * p.PROBE_EVERY):  # plain steps only: every probe of drafting held back by the profile
            assert sum(p.lengths(streams)) == 0
            p.observe(StepEvent(0, 0.0, [0], [0], [0], 1, 1, 0, 0, {"verify": 1.1}))
        assert True not in p.rate and p.rate[False] == pytest.approx(1 / 1.1)


def test_a_few_poor_first_blocks_do_not_keep_drafting_off():
    """Survival averages pulled down by a few poor blocks (a prompt's first tokens) neither release the drafters
    (`plain` answers the load question from the head's typical survivals, PRIOR ** j) nor hold drafting off for good
    (`may_pay`'s averages move back toward the prior with every no), where at the prior drafting pays; and a measured
    step of one request weighs REQUEST_WEIGHT in the throughput averages, one of eight requests 1 - 0.95 ** 8."""
    from types import SimpleNamespace

    from speclab.core.batch import StepEvent
    p = DSpark(k=4, cost=StepCost(1.0, 0.1, 0.0, drafting=(0.5, 0.0, 0.0)))
    streams = [SimpleNamespace(req=SimpleNamespace(rid=0))]
    p.mean_surv = [0.1, 0.01, 0.001, 0.0001]
    assert not p._profile_pays([4]) and p._profile_pays([4], prior=True)
    assert not p.plain(1)
    answers = []
    for _ in range(10 * p.PROBE_EVERY):
        answers.append(p.may_pay(streams))
    assert not answers[0] and answers[-1] and sum(answers) < len(answers)  # held back first, then asked yes again
    p.rate, p.sums, p.measured_steps = {True: 1.0}, {True: (4.0, 4.0)}, {True: 100}  # past the first steps' mean
    p.prev = True
    p.observe(StepEvent(0, 0.0, [0], [4], [4], 1, 1, 1, 0, {"draft": 1.0, "verify": 1.0}))  # 5 tokens in 2 ms
    w = p.REQUEST_WEIGHT
    assert p.rate[True] == pytest.approx(((1 - w) * 4 + w * 5) / ((1 - w) * 4 + w * 2))


def test_the_profile_expects_a_prefix_to_commit_its_survivals_summed():
    """`may_pay`'s arithmetic: the expected tokens of a kept prefix are its survival products summed (not the last
    one alone), so a batch whose blocks each keep 0.9 + 0.81 drafts where the last survival alone (0.81) would not."""
    from types import SimpleNamespace
    p = DSpark(k=2, cost=StepCost(1.0, 0.0, 0.0, drafting=(0.0, 0.0, 0.0)))
    p.mean_surv = [0.9, 0.81]
    streams = [SimpleNamespace(req=SimpleNamespace(rid=i)) for i in range(2)]
    # plain: 2 tokens in 1 ms; drafting: 2 + 2 x 1.71 tokens in 1 + 1.5 ms (sum) against 2 + 2 x 0.81 (last alone)
    p.cost.drafting = (1.5, 0.0, 0.0)
    assert p.may_pay(streams)  # 5.42 / 2.5 = 2.17 > 2
    p.held, p.cost.drafting = 0, (1.0, 0.0, 0.0)
    p.mean_surv = [0.5, 0.1]  # 2 + 2 x 0.6 tokens in 2 ms = 1.6 < 2
    assert not p.may_pay(streams) and p.held == p.PROBE_EVERY


def test_the_drafting_profile_runs_the_batch(deep, dspark):
    """`StepCost.profile_drafting` times real batched drafting steps (the tiny target and DFlash drafter): a fit of
    three finite terms, and a drafting step modeled dearer than the plain one's verification alone at every size."""
    def make():
        return {"dflash": build_drafter("dflash", deep, {"dflash": dspark}, block_size=4, markov=1)}
    cost = StepCost(1.0, 0.1, 0.1)
    cost.drafting = cost.profile_drafting(deep, make, context=16, requests=(1, 2, 4), ks=(1, 3), steps=4)
    assert len(cost.drafting) == 3 and all(math.isfinite(c) for c in cost.drafting)
    assert all(cost.drafting_ms(n, 3 * n) >= 0.0 for n in (1, 4, 16))
    assert "drafting adds" in cost.describe() and "drafting" not in StepCost(1.0, 0.1, 0.1).describe()


class Retrospective(DSpark):
    """A test-only rule that peeks at the target before verification: it keeps a request's first draft only where
    the target likes it more than the drafter did (p(x) > q(x)). Its outputs are not the target's distribution."""

    def __init__(self, target, sampling):
        super().__init__(k=1, cost=StepCost(1.0, 0.0, 0.0), measured=0)
        self.target, self.sampling = target, sampling

    def trim(self, streams, trees):
        keep = []
        for s, t in zip(streams, trees):
            if not len(t):
                keep.append(0)
                continue
            logits = self.target.forward(s.seq.ids[: s.seq.n], self.target.new_cache(), last=1).logits
            p = logits_to_probs(logits, self.sampling)[0, t.tokens[0]]
            keep.append(int(p > t.draft_probs[0]))
        return keep


def test_scheduled_sampling_keeps_the_target_distribution_and_biased_rules_are_caught(tiny_vocab):
    """N_RUNS sampled requests of one prompt through the scheduler, 16 at a time. With confidences that, like the
    head's c_k, depend only on the tokens before row k (here: the largest probability of the q row k was drawn from),
    the first two tokens follow the target's exact joint (chi-square). The same test catches a confidence that reads
    row k's own token (q(x_k): cutting a token by its own value biases it) and a rule that peeks at the target."""
    from test_sampling import N_RUNS, PLAIN, PROMPT, V, chi2_p, exact_joint
    target, draft = tiny_vocab

    class WithConfidence:  # sps's sampled chain, with a stand-in for the head's c_k
        def __init__(self, own_token):
            self.d = build_drafter("sps", target, {"draft": draft}, k=3)
            self.name, self.layers, self.own_token = "sps", (), own_token

        def __getattr__(self, name):
            return getattr(self.d, name)

        def propose(self, k, s, g):
            tree = self.d.propose(k, s, g)
            if len(tree):
                tree.extra["confidence"] = (tree.draft_probs.float() if self.own_token else
                                            tree.draft_dists[: len(tree)].max(-1).values.float())
            return tree

    def counts(policy, own_token=False):
        batch = Batch(target, lambda: {"sps": WithConfidence(own_token)}, policy, PLAIN, max_batch=16)
        for i in range(N_RUNS):
            batch.submit(Request(i, PROMPT, 3, seed=i))
        while not batch.idle:
            batch.step()
        return np.bincount([int(d.new_ids[0]) * V + int(d.new_ids[1]) for d in batch.done.values()],
                           minlength=V * V), batch
    want = exact_joint(target, PROMPT, PLAIN)
    cost = StepCost(10.0, 0.1, 0.0)
    got, batch = counts(DSpark(k=3, cost=cost, measured=0))
    assert chi2_p(got, want) > 1e-3
    drafted = [d.drafted for d in batch.done.values()]
    assert sum(drafted) > N_RUNS // 2 and len(set(drafted)) >= 2  # drafts were scheduled, cut and verified
    assert chi2_p(counts(DSpark(k=3, cost=cost, measured=0), own_token=True)[0], want) < 1e-3
    assert chi2_p(counts(Retrospective(target, PLAIN))[0], want) < 1e-3


def test_admission_is_the_rule_not_a_threshold():
    """Theta = tokens x steps per second decides: the same survival gets more tokens when rows are cheaper."""
    surv = [[0.9, 0.6, 0.3]]
    assert admit(surv, StepCost(10.0, 0.5, 0.0)) == [3]
    assert admit(surv, StepCost(10.0, 4.0, 0.0)) == [2]
    assert admit(surv, StepCost(10.0, 10.0, 0.0)) == [1]


def test_a_draft_token_costs_its_drafting_and_the_slower_verification_after_it():
    """`StepCost.learn`: steps without drafts set how far a verification runs past the model anyway; a drafting
    step's draft ms and its verification's excess beyond that, per draft token, become `draft_ms`."""
    from speclab.core.batch import StepEvent

    def step(drafted, rows, verify, draft=0.0):
        return StepEvent(0, 0.0, [0, 1], drafted, [0, 0], rows, 1, 1, 0, {"draft": draft, "verify": verify})
    cost = StepCost(4.0, 0.5, 0.25)  # 2 requests: 4.5 + 0.5 per row
    cost.learn(step([1, 1], 4, 9.0, draft=1.0))  # before any plain step: its draft ms only
    assert cost.draft_ms == pytest.approx(0.5)
    cost.draft_ms = 0.0
    cost.learn(step([0, 0], 2, 6.0))  # 0.5 ms past the model without drafting
    assert cost.plain_excess == pytest.approx(0.5) and cost.draft_ms == 0
    cost.learn(step([3, 1], 6, 9.0, draft=2.0))  # 7.5 modeled: 1.5 past it, 1.0 more than a plain step
    assert cost.draft_ms == pytest.approx((2.0 + 1.0) / 4)
    cost.learn(step([0, 0], 2, 5.5))  # as modeled: the plain excess moves toward 0
    assert cost.plain_excess == pytest.approx(0.8 * 0.5)
    cost.learn(step([2, 2], 6, 7.0, draft=4.0))  # faster than a plain step past the model: nothing added
    assert cost.draft_ms == pytest.approx(0.8 * 0.75 + 0.2 * 1.0)
