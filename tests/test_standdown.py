"""Standing down where drafting does not pay (`speclab.drafters.schedule.PaysRouter`, a method's `pays`): the
decisions from the rounds before, greedy output still AR's, sampled output still the target's distribution."""
import numpy as np
import pytest
import torch

from speclab.core.engine import decode
from speclab.core.protocol import Signals
from speclab.core.sampling import Sampling
from speclab.drafters.registry import drafters
from speclab.drafters.schedule import MOST_WAIT, WAIT_GROWTH, PaysRouter
from speclab.drafters.sps import StandaloneDraft
from speclab.generate import generate
from speclab.methods import METHODS, build_method, method_params
from test_sampling import N_RUNS, V, chi2_p, exact_joint, told_apart


def follow(router: PaysRouter, brought: list[int], rounds: int) -> list[bool]:
    """Whether the router drafts each of `rounds` rounds, a drafted round bringing the next of `brought` (accepted
    drafts + 1), as the engine hands it the history."""
    acc, who, out, it = [], [], [], iter(brought)
    for r in range(rounds):
        d = router.choose(Signals(r, accepted=list(acc[-32:]), drafters=list(who[-32:])))
        out.append(d.choice is not None)
        acc.append(next(it) - 1 if d.choice is not None else 0)
        who.append(d.choice)
    return out


def test_the_router_stands_down_below_pays_and_probes_ever_later():
    r = PaysRouter("eagle3", pays=3.0)
    assert follow(r, [5] * 10, 10) == [True] * 10  # rounds that bring 5 tokens pay: it always drafts
    drafted = follow(r, [1] * 40, 400)  # rounds that bring 1 token never pay: plain steps, probes ever further apart
    at = [i for i, d in enumerate(drafted) if d]
    gaps = np.diff(at) - 1
    want = [min(WAIT_GROWTH ** i, MOST_WAIT) for i in range(len(gaps))]  # 1, 4, 16, ...
    assert at[0] == 0 and gaps.tolist() == want and want[-1] == MOST_WAIT, (at, want)
    # a probe that pays brings drafting back: the average climbs over `pays` again
    back = follow(PaysRouter("eagle3", pays=3.0), [1, 8, 8, 8, 8], 10)  # averages 1, 2.75, 4.06, ...
    assert back == [True, False, True, False, False, False, False, True, True, True], back
    # a new decode (round 0) forgets the one before
    assert follow(r, [5], 1) == [True]


def test_probe_opens_the_decode_with_plain_rounds_and_caps_the_stand_down():
    """`probe` 200: the first 200 rounds are plain steps, then a probe; probes that do not pay back off to at most
    200 rounds apart (above MOST_WAIT); one that pays brings drafting back at once."""
    drafted = follow(PaysRouter("confu", pays=4.0, probe=200), [1] * 10, 1200)
    at = [i for i, d in enumerate(drafted) if d]
    assert at[0] == 200 and (np.diff(at) - 1).tolist() == [200] * (len(at) - 1), at
    assert follow(PaysRouter("confu", pays=4.0, probe=3), [6] * 5, 8) == [False] * 3 + [True] * 5
    with pytest.raises(ValueError, match="probe"):
        PaysRouter("confu", pays=4.0, probe=-1)


@pytest.mark.parametrize("name", ["eagle3", "confu", "specblock"])
def test_a_method_that_stands_down_decodes_as_ar_greedy(deep, name):
    """A random drafter and pays 2: most rounds stand down, some probe (a drafter with round hooks, ConFu, resumes
    from a stale future token; SpecBlock after a long backlog); the tokens are AR's (fp32)."""
    entry = drafters()[name]
    models = {entry.model.role: entry.model.random(deep, seed=0)}
    prompt = "def add(a, b):\n    return"
    want = generate(deep, prompt, "ar", max_new_tokens=40).token_ids
    events: list = []
    got = generate(deep, prompt, name, models=models, max_new_tokens=40, pays=2.0, on_round=events.append)
    plain = sum(e.drafter is None for e in events)
    assert got.token_ids == want
    assert 0 < plain < len(events) - 1, plain  # it stood down and it drafted
    assert {e.decision.policy for e in events} == {"pays"}


def test_pays_is_the_default_at_t_above_0_only(deep):
    """Off (0, every round drafts) greedy; the measured default at T > 0; a method built with it routes by it."""
    entry = drafters()["eagle3"]
    models = {"eagle3": entry.model.random(deep, seed=0)}
    greedy, sampled = method_params("eagle3", {}, deep), method_params("eagle3", {}, deep, sampled=True)
    assert greedy["pays"] == 0 and greedy["probe"] == sampled["probe"] == 0
    confu = method_params("confu", {}, deep, sampled=True)  # measured not to pay at T > 0: no probe for 128 rounds
    assert confu["pays"] == 4 and confu["probe"] == 128 and method_params("confu", {}, deep)["probe"] == 0
    _, router = build_method("eagle3", deep, models, greedy)
    assert router.policy == "fixed"
    _, router = build_method("eagle3", deep, models, {**sampled, "pays": 2.5, "probe": 7})
    assert router.policy == "pays" and router.pays == 2.5 and router.probe == 7
    assert "pays" not in METHODS["eagle3"].grid  # `speclab grid`'s default sweep stays the greedy one
    assert "pays" not in METHODS["whiflash-entropy"].defaults  # a routed method's own router decides: no silent no-op


@pytest.mark.slow
def test_standing_down_keeps_the_target_distribution(tiny_vocab):
    """sps chains of 2 with pays 2.5: a first round that accepts at most one draft is followed by plain steps, so the
    second token comes from a drafted round or from a plain one depending on the first round; the first two tokens
    still follow the target's exact joint (chi-square), and the test has power (the draft's own joint fails it)."""
    target, draft = tiny_vocab
    prompt = torch.tensor([1, 7, 5, 3])
    want = exact_joint(target, prompt, Sampling(1.0))
    drafter = StandaloneDraft(draft, k=2, tree_topk=1, stop_prob=0.0)
    counts, plain = np.zeros(V * V), 0
    for seed in range(7 * N_RUNS, 8 * N_RUNS):
        events: list = []
        res = decode(target, prompt, {drafter.name: drafter}, PaysRouter(drafter.name, 2.5), max_new_tokens=3,
                     sampling=Sampling(1.0, seed=seed), listeners=(events.append,))
        a, b = res.new_ids.tolist()[:2]
        counts[a * V + b] += 1
        plain += len(events) > 1 and events[1].drafter is None and events[0].committed.numel() == 1
    assert plain > N_RUNS // 10, plain  # the second token came from a plain step in many decodes
    assert chi2_p(counts, want) > 1e-3
    assert told_apart(exact_joint(draft, prompt, Sampling(1.0)), want)


def test_the_app_shows_how_many_rounds_drafted(deep):
    """A column of the app's side by side for a method standing down: its share of drafted rounds, not WhiFlash's
    EAGLE-3 share (there is no other drafter)."""
    from app.decode import Column
    from app.lab import vocab_text
    from speclab.generate import Generation

    models = {"eagle3": drafters()["eagle3"].model.random(deep, seed=0)}
    g = Generation(deep, "def add(a, b):\n    return", "eagle3", models=models, max_new_tokens=40, pays=2.0,
                   on_round=lambda ev: None)
    col, text = Column(g), vocab_text(deep.tokenizer)
    for ev in g:
        col.add(ev, text, "accept")
    stats = col.stats(None)
    drafted = sum(ev.drafter is not None for ev in col.events)
    assert stats["drafted rounds"] == f"{drafted / len(col.events):.0%}" and drafted < len(col.events)
    assert "EAGLE-3 rounds" not in stats
