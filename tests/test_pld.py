"""Prompt lookup's own parts: the n-gram index against a scan of the whole sequence, and the sampled gate (what it
observes, when it holds a proposal back, that a greedy decode never consults it). That a gated decode keeps the
target's distribution is tests/test_conformance.py's chi-square test (pld's "chain" shape has a gate)."""
from __future__ import annotations

import random

import pytest
import torch

from helpers import PROMPTS
from speclab.core.engine import decode
from speclab.core.sampling import Sampling
from speclab.drafters.pld import MATCH_CAP, NgramIndex, PromptLookup
from speclab.generate import encode_prompt

GREEDY, SAMPLED = Sampling(), Sampling(1.0, seed=0)


def scan(ids: list[int], min_n: int, max_n: int) -> int:
    """What prompt lookup's index must find, by brute force: where the continuation starts after the most recent
    occurrence of the longest n-gram (max_n down to min_n) ending at the last token that has a token after it."""
    t = torch.tensor(ids, dtype=torch.long)
    for n in range(max_n, min_n - 1, -1):
        if t.numel() <= n:
            break
        hits = (t[:-1].unfold(0, n, 1) == t[-n:]).all(1).nonzero().flatten()
        if hits.numel():
            return int(hits[-1]) + n
    return -1


@pytest.mark.parametrize("min_n,max_n,vocab", [(1, 3, 3), (1, 3, 12), (2, 4, 4), (1, 1, 5), (3, 3, 2)])
def test_the_index_finds_what_a_scan_finds(min_n, max_n, vocab):
    rng = random.Random(min_n * 100 + max_n * 10 + vocab)
    for _ in range(20):
        seq = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        index = NgramIndex(min_n, max_n)
        index.extend(seq[:1])
        at = 1
        while at < len(seq):  # grown in chunks, as rounds hand tokens over
            step = rng.randrange(1, 6)
            index.extend(seq[at : at + step])
            at += step
            assert index.lookup() == scan(seq[:at], min_n, max_n), (seq[:at], min_n, max_n)


def test_probe_counts_the_match_behind_the_continuation():
    d = PromptLookup(k=4, max_ngram=3, min_ngram=1)
    d.reset(torch.tensor([5, 6, 7, 8, 9, 1, 6, 7, 8]))  # "6 7 8" occurred before, followed by 9
    assert d.probe() == {"pld_match": 3.0, "pld_tokens": 4.0}
    d.catch_up(torch.tensor([3]))  # "3" never occurred: no match
    assert d.probe() == {"pld_match": 0.0, "pld_tokens": 0.0}
    d.reset(torch.arange(40).repeat(2))  # a match as long as the whole first copy: capped
    assert d.probe()["pld_match"] == MATCH_CAP


def test_the_gate_holds_proposals_back_while_the_first_token_is_unlikely():
    d = PromptLookup(k=3, max_ngram=2, min_ngram=1, gate=0.3)
    d.reset(torch.tensor([1, 2, 3, 4, 1, 2]))  # "1 2" was followed by 3
    probs = torch.zeros(8)
    assert d.propose(8, SAMPLED).tokens.tolist() == [3, 4, 1]  # nothing observed yet: it proposes
    probs[3] = 0.1
    d.observe(probs)  # p(c_1) = 0.1 < 0.3
    assert d.accept_ema == pytest.approx(0.1)
    assert len(d.propose(8, SAMPLED)) == 0  # gated
    assert d.propose(8, GREEDY).tokens.tolist() == [3, 4, 1]  # a greedy decode never consults the gate
    probs[3] = 0.9
    d.observe(probs)  # the average 0.5: open again
    assert d.accept_ema == pytest.approx(0.5) and len(d.propose(8, SAMPLED)) == 3
    d.observe(probs)
    before = d.accept_ema
    d.observe(probs)  # nothing looked up since the last observation: nothing to learn
    assert d.accept_ema == before
    d.reset(torch.tensor([1, 2, 3, 4, 1, 2]))
    assert d.accept_ema is None  # reset forgets


@torch.inference_mode()
def test_a_sampled_decode_feeds_the_gate_and_gated_rounds_are_plain_steps(qwen3):
    ids = encode_prompt(qwen3, PROMPTS[0] * 4)  # repeats itself: prompt lookup finds matches
    seen: list = []

    def watched() -> PromptLookup:  # p(c_1) never reaches 1: shut after one observation
        d = PromptLookup(k=4, max_ngram=3, min_ngram=1, gate=1.0)
        real = d.observe
        d.observe = lambda p: (seen.append(float(p.sum())), real(p))  # type: ignore[method-assign]
        return d

    events: list = []
    decode(qwen3, ids, {"pld": watched()}, max_new_tokens=12, sampling=SAMPLED, listeners=(events.append,))
    # a distribution every round that had room for a draft (all but the last, whose bonus token ends the decode)
    assert len(seen) == len(events) - 1 and all(abs(s - 1) < 1e-4 for s in seen)
    drafted = [len(e.tree) for e in events]
    assert sum(1 for n in drafted if n) <= 1, drafted  # at most the first round drafts, before anything was observed
    seen.clear()
    events.clear()
    decode(qwen3, ids, {"pld": watched()}, max_new_tokens=12, sampling=GREEDY, listeners=(events.append,))
    assert not seen and sum(len(e.tree) for e in events) > 0  # greedy: nothing observed, proposals made
