"""Lossless speculative sampling: the committed tokens follow the target's distribution exactly.

Checked with chi-square goodness-of-fit tests at fixed seeds, against the exact distribution computed
from the target. Each test also shows the same test has power: samples from the draft alone fail it, and
end to end a chain whose depth-2 token is verified against the wrong draft distribution fails it too.
"""
import zlib

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from helpers import NoTok as _NoTok
from speclab.core.engine import decode
from speclab.core.sampling import Sampling, draw, logits_to_probs, sample
from speclab.core.target import Target
from speclab.core.tree import DraftTree, TreeDraw, dynamic_tree
from speclab.core.verify import block_tests, verify_sampling
from speclab.drafters.sps import StandaloneDraft

V = 8
PLAIN = Sampling(1.0)  # temperature 1, no top-k / top-p
N_RUNS = 1200  # decodes per end-to-end test (the depth-2 power check rejects at p ~ 1e-11)


def chi2_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit, pooling cells with expected count < 5 into one; 0 when a zero-probability cell
    (a token outside top-k / top-p, say) was hit."""
    if counts[probs == 0].sum() > 0:
        return 0.0
    counts, probs = counts[probs > 0], probs[probs > 0]
    exp = probs * counts.sum()
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


@pytest.mark.slow
def test_verify_sampled_multi_candidate_node_keeps_p(pq):
    """Three children drawn i.i.d. from q at the root (SpecInfer-style): the first token still follows p."""
    p, q = pq
    def tree_fn(g):
        toks = torch.multinomial(q, 3, replacement=True, generator=g)
        return DraftTree(toks, torch.full((3,), -1), q[toks], q.repeat(4, 1))
    counts = first_token_counts(p, q, tree_fn, 6000, seed=1)
    assert chi2_p(counts, p.numpy()) > 1e-3
    assert chi2_p(counts, q.numpy()) < 1e-3  # the test can tell p from q


def wor_tree(q: torch.Tensor, k: int, g, scheme: str = "wor") -> DraftTree:
    """k children of the root drawn from q without replacement (`speclab.core.sampling.draw`), verified as `scheme`."""
    toks = draw(q[None], k, "wor", g)[0]
    toks = toks[toks >= 0]
    tree = DraftTree(toks, torch.full((toks.numel(),), -1), q[toks], q.repeat(toks.numel() + 1, 1))
    tree.scheme = scheme
    return tree


@pytest.mark.slow
def test_verify_children_drawn_without_replacement_keeps_p(pq):
    """Three children drawn from q without replacement, verified by recursive rejection without replacement (the
    rejected token leaves q as well as p): the first token follows p. Power: the same draws verified as if i.i.d.
    (q left whole) do not."""
    p, q = pq
    counts = first_token_counts(p, q, lambda g: wor_tree(q, 3, g), 6000, seed=3)
    assert chi2_p(counts, p.numpy()) > 1e-3
    wrong = first_token_counts(p, q, lambda g: wor_tree(q, 3, g, scheme="iid"), 6000, seed=3)
    assert chi2_p(wrong, p.numpy()) < 1e-3


def test_draws_without_replacement_follow_sequential_sampling():
    """Gumbel top-k draws are sequential draws without replacement: the first follows q, the second q without the
    first renormalised (exact distribution of the ordered pair, chi-square), and no row repeats a token; a row with
    fewer tokens of mass than k marks the rest -1."""
    g = torch.Generator().manual_seed(0)
    q = torch.softmax(torch.randn(5, generator=g) * 1.5, -1)
    pairs = draw(q[None].expand(20000, -1).contiguous(), 2, "wor", g)
    assert (pairs[:, 0] != pairs[:, 1]).all()
    counts = np.bincount((pairs[:, 0] * 5 + pairs[:, 1]).numpy(), minlength=25)
    want = (q[:, None] * q[None] / (1 - q[:, None])).fill_diagonal_(0).flatten().numpy()
    assert chi2_p(counts, want) > 1e-3
    assert chi2_p(counts, np.outer(q, q).flatten()) < 1e-3  # i.i.d. pairs are told apart
    sparse = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    assert sorted(draw(sparse, 3, "wor", g)[0].tolist()) == [-1, 0, 1]


class PathModels:
    """Synthetic target and drafter over a vocabulary of `v` tokens: p and q after any path are seeded random softmaxes
    (fixed per path), so the exact joint of the next tokens is a sum over paths, with no model."""

    def __init__(self, v: int, seed: int):
        self.v, self.seed, self.memo = v, seed, {}

    def dist(self, who: str, path: tuple) -> torch.Tensor:
        key = (who, path)
        if key not in self.memo:
            g = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()) + self.seed)  # stable across runs
            self.memo[key] = torch.softmax(torch.randn(self.v, generator=g) * 1.5, -1)
        return self.memo[key]

    def joint(self, n: int, path: tuple = (), who: str = "p") -> np.ndarray:
        """The target's ("p") or the drafter's ("q") exact distribution of the next n tokens after `path`, flattened
        (index a * v^2 + b * v + c)."""
        p = self.dist(who, path).double().numpy()
        if n == 1:
            return p
        return np.concatenate([p[t] * self.joint(n - 1, path + (t,), who) for t in range(self.v)])

    def tree(self, k: int, depth: int, total: int, scheme: str, g) -> DraftTree:
        """The sampled dynamic tree (`dynamic_tree` with a `TreeDraw`) of the drafter's q."""
        def expand(level, tokens, state):
            paths = torch.cat([state[0], tokens[:, None]], 1)
            lq = torch.stack([self.dist("q", tuple(r)).log() for r in paths.tolist()])
            return lq, (paths,)
        return dynamic_tree(self.dist("q", ()).log(), expand, depth, k, total, (torch.zeros(k, 0, dtype=torch.long),),
                            sampled=TreeDraw(lambda lq: lq.exp(), scheme, g, self.v))

    def first_tokens(self, tree: DraftTree, n: int, g, verify_as: str) -> tuple[int, int]:
        """The first n tokens out of a decode whose first round verifies `tree` (as drawn by `verify_as`) and whose
        later tokens the target samples alone, as one cell index; and how many drafts the round accepted."""
        tree.scheme = verify_as
        rows = [self.dist("p", ())] + [self.dist("p", tuple(tree.tokens[tree.path_to(i)].tolist()))
                                       for i in range(len(tree))]
        v = verify_sampling(tree, torch.stack(rows), g)
        out = tree.tokens[v.accepted].tolist() + [v.bonus]
        while len(out) < n:
            out.append(int(sample(self.dist("p", tuple(out)), g)))
        return int(np.ravel_multi_index(out[:n], (self.v,) * n)), v.accepted.numel()


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["wor", "iid"])
def test_sampled_depth3_trees_keep_the_joint(scheme):
    """A sampled dynamic tree of depth 3 with 2 children per expanded node (2 + 4 + 4 nodes, children drawn without
    replacement or i.i.d.), verified by its scheme's recursive rejection: the first three tokens follow the target's
    exact joint. Power: as many draws from the drafter's own joint are told apart; the round accepts drafts at all
    three depths often (the test is not AR in disguise). (Verifying these trees as point masses, accept x with p(x),
    would pass too: that rule is exact for any candidates, only less often accepted.)"""
    m = PathModels(4, seed=11)
    want = m.joint(3)
    g = torch.Generator().manual_seed(7)
    counts, deep = np.zeros(64), 0
    for _ in range(6000):
        tree = m.tree(2, 3, 10, scheme, g)
        assert int((tree.parents == -1).sum()) == 2 and int(tree.depth.max()) == 3
        cell, accepted = m.first_tokens(tree, 3, g, scheme)
        counts[cell] += 1
        deep += accepted == 3
    assert chi2_p(counts, want) > 1e-3
    q = m.joint(3, who="q")
    drafted = np.bincount(np.random.default_rng(0).choice(64, size=6000, p=q / q.sum()), minlength=64)
    assert chi2_p(drafted, want) < 1e-3
    assert deep > 300, deep


@pytest.mark.slow
def test_verify_deterministic_candidates_keep_p(pq):
    """Top-3 of q as point-mass candidates (EAGLE-style tree level): the first token still follows p."""
    p, q = pq
    top = q.topk(3).indices
    counts = first_token_counts(p, q, lambda g: DraftTree(top, torch.full((3,), -1), q[top]), 6000, seed=2)
    assert chi2_p(counts, p.numpy()) > 1e-3


# ---- end to end: the first two generated tokens, exact joint distribution from the target ----

def block_outcomes(P, Q, prefix: tuple, gamma: int, weighted: bool = True, point: bool = False) -> dict[tuple, float]:
    """The exact distribution of one round of block verification (`verify.block_tests`) after `prefix`: every
    chain of `gamma` tokens drawn from Q, the kept prefix by its tests' probabilities (the largest i passing:
    h_i times 1 - h_j for every j > i), then the target's token, from P after the whole chain or from
    norm(max(w_a P - Q, 0)) (`weighted=False`: max(P - Q, 0), a broken rule) -> {tokens committed: probability}.
    `point`: Q's rows are point masses (a deterministic chain), handed to the tests as None."""
    import itertools
    out: dict[tuple, float] = {}
    for xs in itertools.product(range(3), repeat=gamma):
        dists = [prefix + xs[:i] for i in range(gamma + 1)]
        p, q = torch.stack([P(d) for d in dists]), torch.stack([Q(d) for d in dists[:gamma]])
        drawn = float(torch.prod(q[torch.arange(gamma), torch.tensor(xs)]))
        h, w = block_tests(p, None if point else q, torch.tensor(xs))
        keep, rest = {}, 1.0
        for i in range(gamma, 0, -1):
            keep[i], rest = rest * h[i - 1], rest * (1 - h[i - 1])
        keep[0] = rest
        for a, pa in keep.items():
            if pa == 0:  # never kept (its test cannot pass: no mass left to correct to)
                continue
            nxt = p[gamma] if a == gamma else (w[a] if weighted else 1.0) * p[a] - q[a]
            nxt = nxt.clamp(min=0) / nxt.clamp(min=0).sum()
            for v in range(3):
                key = xs[:a] + (v,)
                out[key] = out.get(key, 0.0) + drawn * pa * float(nxt[v])
    return out


def test_block_verification_keeps_the_target_distribution_exactly():
    """Block verification (Sun et al. 2025; the rule every sampled chain takes, `verify.block_accept`), computed
    exactly on a vocabulary of 3 with target and draft distributions that depend on the whole prefix: rounds of
    3-token chains composed until 4 tokens are committed give the target's distribution of those 4 tokens to 1e-12,
    drafted from q or as point masses (a deterministic chain: prompt lookup's, a greedy drafter's);
    a residual without the weight w_a (the natural slip) is off by more than 1e-3. On the paper's example (binary,
    p = (1/3, 2/3), q = (2/3, 1/3), chains of 2) it keeps 11/9 tokens a round against token by token's 10/9."""
    import itertools
    g = torch.Generator().manual_seed(3)
    table: dict[tuple, torch.Tensor] = {}

    def dist(kind: str, prefix: tuple) -> torch.Tensor:
        if (kind, prefix) not in table:
            table[kind, prefix] = torch.softmax(torch.randn(3, generator=g, dtype=torch.float64) * 2, -1)
        return table[kind, prefix]

    def P(d):
        return dist("p", d)

    def Q(d):
        return dist("q", d)

    def Q_point(d):  # a deterministic drafter: a point mass at its own choice after each prefix
        return torch.nn.functional.one_hot(dist("q", d).argmax(), 3).double()

    def committed(weighted: bool, point: bool = False) -> dict[tuple, float]:
        got: dict[tuple, float] = {}

        def walk(prefix: tuple, prob: float) -> None:
            if len(prefix) >= 4:
                got[prefix[:4]] = got.get(prefix[:4], 0.0) + prob
                return
            for toks, pr in block_outcomes(P, Q_point if point else Q, prefix, 3, weighted, point).items():
                walk(prefix + toks, prob * pr)
        walk((), 1.0)
        return got

    exact = {s: float(np.prod([P(s[:i])[s[i]] for i in range(4)])) for s in itertools.product(range(3), repeat=4)}
    for weighted, point, close in ((True, False, True), (True, True, True), (False, False, False)):
        got = committed(weighted, point)
        err = max(abs(got.get(s, 0.0) - pr) for s, pr in exact.items())
        assert (err < 1e-12) if close else (err > 1e-3), (weighted, err)
    p2, q2 = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64), torch.tensor([2 / 3, 1 / 3], dtype=torch.float64)
    kept = 0.0
    for xs in itertools.product(range(2), repeat=2):
        h, _ = block_tests(p2.repeat(3, 1), q2.repeat(2, 1), torch.tensor(xs))
        drawn = float(q2[xs[0]] * q2[xs[1]])
        kept += drawn * (2 * h[1] + (1 - h[1]) * h[0])
    assert abs(kept - 11 / 9) < 1e-12


N_NEW = 3  # room for a depth-2 draft in the first round (the bonus token always fits), so both tested tokens
# can be accepted drafts; a decode that ends in one round accepted two drafted levels


def exact_joint(target, prompt, s: Sampling, n=2) -> np.ndarray:
    """The exact distribution of the next n tokens under sampling `s`, flattened (index a * V + b for n = 2)."""
    probs = logits_to_probs(target.forward(prompt, target.new_cache(), last=1).logits, s)[0].double().cpu().numpy()
    if n == 1:
        return probs
    return np.concatenate([probs[t] * exact_joint(target, torch.cat([prompt, torch.tensor([t])]), s, n - 1)
                           for t in range(V)])


class IIDTree:
    """Test-only drafter: `width` children sampled i.i.d. from q at the root and `width` more sampled i.i.d.
    from q' under the first child (a SpecInfer-style multi-candidate tree), with the full q of both parents in
    `draft_dists`. It keeps no cache: every proposal forwards the committed tokens afresh (tiny models)."""
    name, layers = "iid", ()

    def __init__(self, model, width=2):
        self.model, self.width = model, width

    def reset(self, ids, feats, capacity=None):
        self.ids = ids.to(self.model.device).clone()

    def catch_up(self, ids, feats):
        self.ids = torch.cat([self.ids, ids.to(self.ids.device)])

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


class WrongDepth2Q(StandaloneDraft):
    """A broken sampled chain: its depth-2 token is verified against the root's q instead of the q it was
    sampled from (the first token is verified correctly)."""

    def propose(self, max_depth, s, generator=None):
        tree = super().propose(max_depth, s, generator)
        if len(tree) >= 2:
            dists = tree.draft_dists.clone()
            dists[1] = dists[0]
            tree = DraftTree.chain(tree.tokens, tree.draft_probs, dists)
        return tree


PROMPT = torch.tensor([1, 5, 2])


def decode_counts(target, drafter, s: Sampling, prompt=PROMPT, deferred=True, seed0=0, runs: int = N_RUNS):
    """`runs` decodes of N_NEW tokens at seeds seed0, seed0 + 1, ...: counts of the first two tokens (a * V + b)
    and how many decodes took one round (the first round accepted drafts at depths 1 and 2)."""
    counts, one_round = np.zeros(V * V), 0
    for seed in range(seed0, seed0 + runs):
        res = decode(target, prompt, {drafter.name: drafter}, max_new_tokens=N_NEW, deferred=deferred,
                     sampling=Sampling(s.temperature, s.top_k, s.top_p, seed=seed))
        a, b = res.new_ids.tolist()[:2]
        counts[a * V + b] += 1
        one_round += res.rounds == 1
    return counts, one_round


def told_apart(other_joint: np.ndarray, want: np.ndarray, seed: int = 0, runs: int = N_RUNS) -> bool:
    """Power: `runs` draws from another joint distribution fail the chi-square test against `want`."""
    rng = np.random.default_rng(seed)
    other = np.bincount(rng.choice(V * V, size=runs, p=other_joint / other_joint.sum()), minlength=V * V)
    return chi2_p(other, want) < 1e-3


def assert_keeps_target_distribution(target, drafter, seed0: int, min_one_round: int,
                                     prompt: torch.Tensor = PROMPT, s: Sampling = PLAIN) -> None:
    """The first two tokens sampled through `drafter` after `prompt` under `s` follow the target's exact joint
    (chi-square), more than `min_one_round` decodes take both in one round (the drafts are really tested), and the
    test has power: the target's joint under other sampling is told apart by as many draws. Plain T = 1: N_RUNS
    decodes, against temperature 0.7. Top-k / top-p: N_RUNS / 2, against plain T = 1 (whose draws land on tokens the
    truncation excludes: a sharp test with half the decodes)."""
    want = exact_joint(target, prompt, s)
    plain = s.temperature == 1.0 and not s.top_k and s.top_p >= 1.0
    runs = N_RUNS if plain else N_RUNS // 2
    counts, one_round = decode_counts(target, drafter, s, prompt, seed0=seed0, runs=runs)
    assert one_round > min_one_round * runs // N_RUNS, (one_round, min_one_round)
    assert chi2_p(counts, want) > 1e-3
    assert told_apart(exact_joint(target, prompt, Sampling(0.7 if plain else 1.0)), want, runs=runs)


# name: (sps drafter params, or None for the i.i.d. sibling tree; sampling besides temperature 1; deferred; prompt).
# A plain sampled chain and a top-k tree of every drafter: the conformance suite (tests/test_conformance.py)
CASES = {
    "early-stopped-chain-not-deferred": (dict(k=3, stop_prob=0.2), {}, False, PROMPT),
    # top-3 of target and draft share 2 tokens at the root and after each: partial supports at both depths
    "top-k-sampling": (dict(k=2), dict(top_k=3), True, torch.tensor([1, 7, 5])),
    "top-p-sampling": (dict(k=2), dict(temperature=0.8, top_p=0.9), True, PROMPT),
    "iid-siblings-tree": (None, {}, True, PROMPT),
}


def seed_of(case: str) -> int:
    """Each case's first seed (the first two blocks of N_RUNS seeds were the plain chain's and the top-k tree's)."""
    return (2 + list(CASES).index(case)) * N_RUNS


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_speculative_sampling_matches_target_distribution(tiny_vocab, case):
    """The first two decoded tokens follow the target's exact joint distribution (under the same temperature,
    top-k and top-p), whatever drafts them: sampled chains stopped early, not deferred, under top-k and top-p, and
    trees of siblings sampled i.i.d. from q. With N_NEW = 3 the first round drafts two
    levels, and the test checks that drafts at both depths were accepted (not AR in disguise). Power: a sample
    of the draft's own joint distribution fails the same test."""
    params, skw, deferred, prompt = CASES[case]
    target, draft = tiny_vocab
    s = Sampling(**{"temperature": 1.0, **skw})
    want = exact_joint(target, prompt, s)
    drafter = IIDTree(draft) if params is None else StandaloneDraft(draft,
                                                                    **{"tree_topk": 1, "stop_prob": 0.0, **params})
    counts, one_round = decode_counts(target, drafter, s, prompt, deferred, seed0=seed_of(case))
    assert one_round > N_RUNS // 40  # both tested tokens were accepted drafts, and not rarely
    assert chi2_p(counts, want) > 1e-3
    assert told_apart(exact_joint(draft, prompt, s), want)  # power: the draft's own distribution is told apart


@pytest.fixture(scope="module")
def tiny_vocab_bf16(tiny_vocab):
    """The same target and draft in bf16, the target in exact mode (speclab.core.lean): its rows do not depend on how
    many run together, so a sampled decode's p is exactly the p of `exact_joint`."""
    import copy

    def bf16(t, exact):
        out = Target(copy.deepcopy(t.model).to(torch.bfloat16), _NoTok(), exact=exact)
        out.eos_ids = []
        return out
    return bf16(tiny_vocab[0], True), bf16(tiny_vocab[1], False)


@pytest.mark.slow
def test_bf16_exact_speculative_sampling_matches_target_distribution(tiny_vocab_bf16):
    """Sampling in bf16 (logits in fp32, exact mode) keeps the target's distribution; power as above."""
    target, draft = tiny_vocab_bf16
    assert target.dtype == torch.bfloat16 and target.exact
    s = Sampling(1.0)
    want = exact_joint(target, PROMPT, s)
    counts, one_round = decode_counts(target, StandaloneDraft(draft, k=2, tree_topk=1, stop_prob=0.0), s,
                                      seed0=(2 + len(CASES)) * N_RUNS)
    assert one_round > N_RUNS // 40
    assert chi2_p(counts, want) > 1e-3
    assert told_apart(exact_joint(draft, PROMPT, s), want)


@pytest.mark.slow
def test_depth2_verified_against_wrong_q_is_detected(tiny_vocab):
    """Power at depth 2: the end-to-end test rejects a sampled chain whose depth-2 token is verified against the
    wrong draft distribution. The first token is still right, so the rejection comes from the second."""
    target, draft = tiny_vocab
    s = Sampling(1.0)
    want = exact_joint(target, PROMPT, s)
    counts, one_round = decode_counts(target, WrongDepth2Q(draft, k=2, tree_topk=1, stop_prob=0.0), s)
    assert one_round > N_RUNS // 40
    assert chi2_p(counts.reshape(V, V).sum(1), want.reshape(V, V).sum(1)) > 1e-3  # first token: fine
    assert chi2_p(counts, want) < 1e-3  # the joint: told apart


def test_top_k_top_p_processing():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    p = logits_to_probs(logits, Sampling(1.0, top_k=2))
    assert (p[0, 2:] == 0).all() and abs(float(p.sum()) - 1) < 1e-6
    p = logits_to_probs(logits, Sampling(1.0, top_p=0.5))
    assert int((p > 0).sum()) == 1
    g = logits_to_probs(logits, Sampling(0.0))
    assert g.tolist() == [[1.0, 0.0, 0.0, 0.0]]


@pytest.mark.slow
def test_sampling_through_a_flash_sps_chain_keeps_target_distribution(tiny_vocab):
    """A standalone draft's sampled chain through a FlashHead (`speclab.drafters.flashhead`: 3 of 4 clusters of 2 tokens
    drawn from the centroid softmax per row; q is the softmax over their 6 tokens): the target's joint is kept."""
    from speclab.drafters.flashhead import FlashHead, build_index
    from speclab.drafters.sps import StandaloneDraft
    target, draft = tiny_vocab
    drafter = StandaloneDraft(draft, k=2, tree_topk=1, stop_prob=0.0)
    drafter.flash = FlashHead(draft.head_weight, build_index(draft.head_weight, 4), probes=3)
    assert_keeps_target_distribution(target, drafter, 40_000, N_RUNS // 100)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["wor", "iid"])
def test_merged_trees_keep_the_joint(scheme):
    """A merged arm's tree (`speclab.core.tree.merge`): a looked-up chain of point masses beside a sampled depth-3
    tree (2 children per node), verified in one go, each candidate against its own drafter's q: the first three
    tokens follow the target's exact joint, and rounds accept drafts through both branches and to depth 3. Power:
    the drafter's own joint is told apart; for siblings drawn without replacement, verifying them as if i.i.d. is
    caught."""
    from speclab.core.tree import IID, POINT, merge
    m = PathModels(4, seed=11)
    want = m.joint(3)
    g = torch.Generator().manual_seed(5)
    look = DraftTree.chain(torch.tensor([1, 0, 2]), torch.full((3,), float("nan")))
    counts, wrong, deep, through = np.zeros(64), np.zeros(64), 0, {POINT: 0, "q": 0}
    trials = 6000 if scheme == "wor" else 3000  # wor's power check (siblings verified as if i.i.d.) needs 6000
    for _ in range(trials):
        tree, maps = merge([look, m.tree(2, 3, 10, scheme, g)])
        assert (tree.child_groups == POINT).sum() == 3 and tree.child_dists.shape == (len(tree), 4)
        cell, accepted = m.first_tokens(tree, 3, g, scheme)
        counts[cell] += 1
        deep += accepted == 3
        if scheme == "wor":
            bad = DraftTree(tree.tokens, tree.parents, tree.draft_probs, child_dists=tree.child_dists,
                            child_groups=torch.where(tree.child_groups >= 0, IID, tree.child_groups))
            wrong[m.first_tokens(bad, 3, g, scheme)[0]] += 1
        rows = [m.dist("p", ())] + [m.dist("p", tuple(tree.tokens[tree.path_to(i)].tolist())) for i in range(len(tree))]
        v = verify_sampling(tree, torch.stack(rows), torch.Generator().manual_seed(_))
        if v.accepted.numel():
            through[POINT if int(tree.child_groups[v.accepted[0]]) == POINT else "q"] += 1
    assert chi2_p(counts, want) > 1e-3
    q = m.joint(3, who="q")
    drafted = np.bincount(np.random.default_rng(0).choice(64, size=trials, p=q / q.sum()), minlength=64)
    assert chi2_p(drafted, want) < 1e-3
    if scheme == "wor":
        assert chi2_p(wrong, want) < 1e-3
    assert deep > trials // 20 and min(through.values()) > trials // 20, (deep, through)
