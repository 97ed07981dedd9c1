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
from speclab.sampling import Sampling, logits_to_probs, sample
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


class IIDTree:
    """Test-only drafter: `width` children sampled i.i.d. from q at the root and `width` more under the first
    child (SpecInfer-style multi-candidate tree), with the full q of every parent kept for verification."""
    name, layers = "iid", ()

    def __init__(self, model, width=2):
        self.model, self.width = model, width

    def reset(self, ids, feats):
        self.ids = ids.clone()

    def catch_up(self, ids, feats):
        self.ids = torch.cat([self.ids, ids])

    def _q(self, ids, s):
        return logits_to_probs(self.model.forward(ids, self.model.new_cache(), last=1).logits, s)

    def propose(self, max_depth, s, generator=None):
        w = self.width
        q0 = self._q(self.ids, s)
        kids = sample(q0.expand(w, -1), generator)
        if max_depth < 2:
            return DraftTree(kids, torch.full((w,), -1), q0[0, kids], torch.cat([q0, q0.new_zeros(w, V)]))
        q1 = self._q(torch.cat([self.ids, kids[:1]]), s)
        kids2 = sample(q1.expand(w, -1), generator)
        dists = torch.cat([q0, q1, q0.new_zeros(2 * w - 1, V)])  # root, node 0, then nodes without children
        return DraftTree(torch.cat([kids, kids2]), torch.tensor([-1] * w + [0] * w),
                         torch.cat([q0[0, kids], q1[0, kids2]]), dists)

    def commit(self, tree, accepted):
        pass


# name: (drafter params, max_new_tokens, sampling, deferred, accepted depth the test must see reached)
CASES = {
    "sampled-chain-depth1": (dict(k=2), 2, {}, True, 1),
    "sampled-chain-depth2": (dict(k=2), 3, {}, True, 2),
    "multi-candidate-tree": (dict(k=2, tree_topk=3), 2, {}, True, 1),
    "early-stopped-chain": (dict(k=3, stop_prob=0.2), 3, {}, True, 2),
    "top-k": (dict(k=2), 3, dict(top_k=5), True, 2),
    "top-p": (dict(k=2), 3, dict(temperature=0.8, top_p=0.9), True, 2),
    "not-deferred": (dict(k=2), 3, {}, False, 2),
    "iid-siblings-tree": (None, 3, {}, True, 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_speculative_sampling_matches_target_distribution(tiny_vocab, case):
    """The first two decoded tokens follow the target's exact joint distribution (under the same temperature,
    top-k and top-p), whatever drafts them: sampled chains accepted at depth 1 and 2, deterministic top-k trees,
    early-stopped chains, i.i.d. sibling trees, deferred or not. With n_new = 3 the first round can draft two
    levels, so both tokens can come from accepted drafts; the test checks it really happened."""
    params, n_new, skw, deferred, depth = CASES[case]
    target, draft = tiny_vocab
    target.eos_ids = draft.eos_ids = []
    s = Sampling(**{"temperature": 1.0, **skw})
    prompt = torch.tensor([1, 5, 2])
    want = exact_joint(target, prompt, s)
    drafter = IIDTree(draft) if params is None else StandaloneDraft(draft, **params)
    counts = np.zeros(V * V)
    deepest = []
    for seed in range(N_RUNS):
        res = decode(target, prompt, {drafter.name: drafter}, max_new_tokens=n_new, deferred=deferred,
                     sampling=Sampling(**{**s.__dict__, "seed": seed}),
                     listeners=(lambda ev: deepest.append(ev.n_accepted),))
        a, b = res.new_ids.tolist()[:2]
        counts[a * V + b] += 1
    assert sum(d >= depth for d in deepest) > N_RUNS // 20  # drafts were accepted that deep (not AR in disguise)
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
