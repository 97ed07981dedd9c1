"""Lossless speculative sampling: the committed tokens follow the target's distribution exactly.

Checked with chi-square goodness-of-fit tests at fixed seeds, against the exact distribution computed
from the target. Each test also shows the same test has power: samples from the draft alone fail it.
"""
import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from conftest import build_tiny
from speclab.engine import decode
from speclab.drafters.sps import StandaloneDraft
from speclab.sampling import Sampling, logits_to_probs
from speclab.target import Target
from speclab.tree import DraftTree
from speclab.verify import verify_sampling

V = 8
N_RUNS = 1500  # decodes per end-to-end test


def chi2_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit, pooling cells with expected count < 5 into one."""
    n = counts.sum()
    exp = probs * n
    small = exp < 5
    c = np.append(counts[~small], counts[small].sum())
    e = np.append(exp[~small], exp[small].sum())
    if e[-1] == 0:
        c, e = c[:-1], e[:-1]
    return chisquare(c, e * c.sum() / e.sum()).pvalue


def first_token_counts(p, q, tree_fn, trials, seed):
    g = torch.Generator().manual_seed(seed)
    counts = np.zeros(V)
    target = torch.log(p).repeat(V + 1, 1)  # same target distribution at every node (depth-1 test)
    for _ in range(trials):
        tree = tree_fn(g)
        v = verify_sampling(tree, torch.softmax(target, -1), g)
        first = int(tree.tokens[v.accepted[0]]) if v.accepted.numel() else v.bonus
        counts[first] += 1
    return counts


@pytest.fixture(scope="module")
def pq():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    return p, q


def test_verify_sampled_multi_candidate_node_keeps_p(pq):
    """Three children drawn i.i.d. from q at the root (SpecInfer-style): the first token still follows p."""
    p, q = pq
    def tree_fn(g):
        toks = torch.multinomial(q, 3, replacement=True, generator=g)
        return DraftTree(toks, torch.full((3,), -1), q[toks], q.repeat(4, 1))
    counts = first_token_counts(p, q, tree_fn, 6000, seed=1)
    assert chi2_p(counts, p.numpy()) > 1e-3
    assert chi2_p(counts, q.numpy()) < 1e-3  # the test can tell p from q


def test_verify_deterministic_candidates_keep_p(pq):
    """Top-3 of q as point-mass candidates (EAGLE-style tree level): the first token still follows p."""
    p, q = pq
    top = q.topk(3).indices
    counts = first_token_counts(p, q, lambda g: DraftTree(top, torch.full((3,), -1), q[top]), 6000, seed=2)
    assert chi2_p(counts, p.numpy()) > 1e-3


# ---- end to end: two generated tokens, exact joint distribution from the target ----

@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    d = tmp_path_factory.mktemp("tiny_vocab")

    def make(seed, name):
        path = build_tiny("qwen3", d / name, seed=seed, vocab_size=V, tokenizer=False, hidden=32, init=0.08)
        return Target(AutoModelForCausalLM.from_pretrained(path).eval(), _NoTok())
    return make(3, "target"), make(4, "draft")


class _NoTok:
    eos_token_id = None


def exact_joint(target, prompt, s: Sampling, n=2):
    joint = np.zeros([V] * n)
    for prefix in itertools.product(range(V), repeat=n):
        prob, ids = 1.0, prompt
        for tok in prefix:
            logits = target.forward(ids, target.new_cache()).logits[-1:]
            prob *= float(logits_to_probs(logits, s)[0, tok])
            ids = torch.cat([ids, torch.tensor([tok])])
        joint[prefix] = prob
    return joint.flatten()


@pytest.mark.parametrize("k,topk,stop_prob,n_new", [(2, 1, 0.0, 2), (2, 3, 0.0, 2), (3, 1, 0.3, 3)],
                         ids=["sampled-chain", "multi-candidate-tree", "early-stopped-chain"])
def test_speculative_sampling_matches_target_distribution(tiny_vocab, k, topk, stop_prob, n_new):
    """The first two decoded tokens follow the target's exact joint distribution (n_new = 3 lets the chain
    reach depth 2, where the early stop can cut it)."""
    target, draft = tiny_vocab
    target.eos_ids = draft.eos_ids = []
    s = Sampling(temperature=1.0)
    prompt = torch.tensor([1, 5, 2])
    want = exact_joint(target, prompt, s)
    drafter = StandaloneDraft(draft, k=k, tree_topk=topk, stop_prob=stop_prob)
    counts = np.zeros(V * V)
    accepted = 0
    for seed in range(N_RUNS):
        res = decode(target, prompt, {"sps": drafter}, max_new_tokens=n_new, sampling=Sampling(1.0, seed=seed))
        a, b = res.new_ids.tolist()[:2]
        counts[a * V + b] += 1
        accepted += n_new - res.rounds
    assert accepted > N_RUNS // 10  # drafts were really accepted (not AR in disguise)
    assert chi2_p(counts, want) > 1e-3
    draft_joint = exact_joint(draft, prompt, s)
    rng = np.random.default_rng(0)
    draft_counts = np.bincount(rng.choice(V * V, size=N_RUNS, p=draft_joint / draft_joint.sum()), minlength=V * V)
    assert chi2_p(draft_counts, want) < 1e-3  # power: the draft's own distribution is told apart


def test_top_k_top_p_processing():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    p = logits_to_probs(logits, Sampling(1.0, top_k=2))
    assert (p[0, 2:] == 0).all() and abs(float(p.sum()) - 1) < 1e-6
    p = logits_to_probs(logits, Sampling(1.0, top_p=0.5))
    assert int((p > 0).sum()) == 1
    g = logits_to_probs(logits, Sampling(0.0))
    assert g.tolist() == [[1.0, 0.0, 0.0, 0.0]]
