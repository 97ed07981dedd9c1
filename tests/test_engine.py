"""Lossless greedy decoding: AR equals a plain argmax loop, deferred verification saves target calls, EOS stops,
several drafters switch losslessly with the right features, no drafter cache grows in a decode. Every drafter in
every documented shape equals AR token for token: the conformance suite (tests/test_conformance.py)."""
import pytest
import torch

from helpers import PROMPTS
from speclab.core.engine import decode
from speclab.drafters.pld import PromptLookup
from speclab.generate import encode_prompt, generate

N_NEW = 40


def argmax_reference(target, prompt_ids, n):
    """Step-by-step argmax with a full forward (no cache) each step."""
    ids = prompt_ids.clone()
    for _ in range(n):
        nxt = target.forward(ids, target.new_cache()).logits[-1].argmax()
        ids = torch.cat([ids, nxt.view(1)])
        if int(nxt) in target.eos_ids:
            break
    return ids[prompt_ids.numel():].tolist()


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("deferred", [True, False])
def test_ar_greedy_equals_argmax_reference(arch, deferred, request):
    t = request.getfixturevalue(arch)
    for p in PROMPTS[:3]:
        ids = encode_prompt(t, p)
        res = decode(t, ids, max_new_tokens=N_NEW, deferred=deferred)
        assert res.new_ids.tolist() == argmax_reference(t, ids, N_NEW)
        assert res.target_calls == res.new_ids.numel() + (1 if deferred and ids.numel() > 1 else 0)


@pytest.fixture(scope="module")
def ar_outputs(qwen3):
    return {p: generate(qwen3, p, "ar", max_new_tokens=N_NEW).token_ids for p in PROMPTS}


def test_sps_chain_stops_after_an_unsure_draft_token(qwen3, qwen3_draft):
    from speclab.core.sampling import Sampling
    from speclab.drafters.sps import StandaloneDraft

    lengths = []
    for p in PROMPTS:
        d = StandaloneDraft(qwen3_draft, k=6, tree_topk=1, stop_prob=0.5)
        d.reset(encode_prompt(qwen3, p), None)
        d.catch_up(torch.zeros(0, dtype=torch.long), None)
        tree = d.propose(6, Sampling())
        lengths.append(len(tree))
        probs = tree.draft_probs.tolist()
        assert all(q >= 0.5 for q in probs[:-1])  # it went on only while the draft was sure
        assert len(tree) == 6 or probs[-1] < 0.5  # and stopped short only after an unsure token
    assert min(lengths) < 6  # some chains really were cut


@pytest.mark.slow
@pytest.mark.parametrize("deferred", [True, False])
def test_hf_backend_decodes_like_lean(qwen3_hf, qwen3_draft_hf, ar_outputs, deferred):
    """The transformers forward (DynamicCache, HF masks) gives the same greedy tokens as the lean forward."""
    for p in PROMPTS[:2]:
        assert generate(qwen3_hf, p, "ar", max_new_tokens=N_NEW, deferred=deferred).token_ids == ar_outputs[p]
        assert generate(qwen3_hf, p, "pld", k=4, max_new_tokens=N_NEW, deferred=deferred).token_ids == ar_outputs[p]
        for k, topk, stop in [(3, 1, 0.0), (3, 2, 0.0), (5, 1, 0.5)]:
            res = generate(qwen3_hf, p, "sps", models={"draft": qwen3_draft_hf}, k=k, tree_topk=topk, stop_prob=stop,
                           max_new_tokens=N_NEW, deferred=deferred)
            assert res.token_ids == ar_outputs[p], (p, k, topk)


def test_pld_proposes_repeated_ngrams():
    d = PromptLookup(k=3, max_ngram=2, min_ngram=1)
    d.reset(torch.tensor([1, 2, 3, 4, 9, 1, 2]), None)
    from speclab.core.sampling import Sampling
    tree = d.propose(10, Sampling())
    assert tree.tokens.tolist() == [3, 4, 9] and tree.is_chain
    d.catch_up(torch.tensor([3, 4]), None)  # most recent match of (3, 4) wins: continuation 9, 1, 2
    assert d.propose(10, Sampling()).tokens.tolist() == [9, 1, 2]


def test_pld_adaptive_length_follows_the_heuristic_schedule():
    """`adaptive`: a proposal accepted whole lengthens the next by 2 (at most k), a rejection shortens it by 1
    (at least 1), a round without a proposal changes nothing, and a reset starts again at k; "sampled" adapts at
    T > 0 only; "off": always k."""
    from speclab.core.sampling import Sampling
    from speclab.core.tree import DraftTree

    ids = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9, 1])  # "1" matches: continuation 2, 3, 4, ...
    d = PromptLookup(k=5, max_ngram=1, min_ngram=1, adaptive="always")
    d.reset(ids, None)
    lengths = []
    for accept_whole in (False, False, False, False, False, True, True, True):
        tree = d.propose(10, Sampling())
        lengths.append(len(tree))
        d.commit(tree, torch.arange(len(tree) if accept_whole else 0))
    assert lengths == [5, 4, 3, 2, 1, 1, 3, 5]
    d.commit(DraftTree.empty(), torch.arange(0))
    assert len(d.propose(10, Sampling())) == 5
    d.commit(d.propose(10, Sampling()), torch.arange(1))
    d.reset(ids, None)
    assert len(d.propose(10, Sampling())) == 5
    fixed = PromptLookup(k=5, max_ngram=1, min_ngram=1)
    fixed.reset(ids, None)
    fixed.commit(fixed.propose(10, Sampling()), torch.arange(0))
    assert len(fixed.propose(10, Sampling())) == 5
    hot = PromptLookup(k=5, max_ngram=1, min_ngram=1, adaptive="sampled")
    hot.reset(ids, None)
    hot.commit(hot.propose(10, Sampling(temperature=1.0)), torch.arange(0))
    assert len(hot.propose(10, Sampling())) == 5 and len(hot.propose(10, Sampling(temperature=1.0))) == 4


@pytest.mark.parametrize("k", [2, 4])
def test_draft_equal_to_target_accepts_everything(qwen3, model_dir, k):
    """With the draft == the target every draft token is accepted: tau = k + 1, one target call per round."""
    from speclab.core.target import Target
    same = Target.load(model_dir["qwen3"], dtype="fp32")  # same weights, its own call counter
    res = generate(qwen3, PROMPTS[1], "sps", models={"draft": same}, k=k, max_new_tokens=5 * (k + 1))
    d = res.decode
    if d.stopped == "max_new_tokens":
        assert d.rounds == 5 and len(res.token_ids) == 5 * (k + 1)
    assert d.target_calls == d.rounds + 1  # + the prefill


@pytest.mark.slow
def test_deferred_saves_target_calls(qwen3, qwen3_draft):
    models = {"draft": qwen3_draft}
    on = generate(qwen3, PROMPTS[0], "sps", models=models, k=3, deferred=True, max_new_tokens=N_NEW).decode
    off = generate(qwen3, PROMPTS[0], "sps", models=models, k=3, deferred=False, max_new_tokens=N_NEW).decode
    assert on.new_ids.tolist() == off.new_ids.tolist()
    assert off.target_calls > on.target_calls
    assert on.target_calls == on.rounds + 1  # the prefill, then one call per round
    assert off.target_calls > 1.8 * off.rounds  # the prefill, a verify and a lone bonus forward per round


def test_stops_on_eos(qwen3):
    ids = encode_prompt(qwen3, PROMPTS[0])
    ref = decode(qwen3, ids, max_new_tokens=N_NEW).new_ids
    qwen3.eos_ids = [int(ref[5])]  # pretend the 6th generated token is EOS
    try:
        for d in ({}, {"pld": PromptLookup(k=4, max_ngram=3, min_ngram=1)}):
            res = decode(qwen3, ids, d, max_new_tokens=N_NEW)
            assert res.stopped == "eos" and res.new_ids.tolist() == ref[:6].tolist()
    finally:
        qwen3.eos_ids = [0]


# ---- several drafters per decode: switching is lossless and features flow correctly ----

class Alternate:
    """Test-only router: a fixed cycle (or seeded random pattern) over drafters, whatever the signals say.
    It asks for both signals and keeps them, so the tests can check what the engine computed."""
    policy = "alternate"
    needs = frozenset({"entropy", "hidden"})

    def __init__(self, names, seed=None):
        self.names, self.seen = list(names), []
        self.rng = None if seed is None else torch.Generator().manual_seed(seed)

    def choose(self, s):
        from speclab.core.protocol import Decision
        self.seen.append(s)
        n = len(self.names)
        i = s.round % n if self.rng is None else int(torch.randint(n, (1,), generator=self.rng))
        return Decision(self.names[i], self.policy, s.entropy)


class Recorder:
    """Test-only drafter: drafts with a wrapped drafter (or not at all) and keeps every (feature, token) pair it
    is handed, to compare with a full forward over the final sequence."""

    def __init__(self, name, layers, inner=None):
        self.name, self.layers, self.inner = name, tuple(layers), inner
        self.ids, self.feats = [], []

    def reset(self, ids, feats, capacity=None):
        self.ids, self.feats = [ids.clone()], [feats.clone()]
        if self.inner:
            self.inner.reset(ids, None, capacity)

    def catch_up(self, ids, feats):
        self.ids.append(ids.clone())
        self.feats.append(feats.clone())
        if self.inner:
            self.inner.catch_up(ids, None)

    def propose(self, max_depth, sampling, generator=None):
        from speclab.core.tree import DraftTree
        return self.inner.propose(max_depth, sampling, generator) if self.inner else DraftTree.empty()

    def commit(self, tree, accepted):
        if self.inner:
            self.inner.commit(tree, accepted)


@pytest.mark.parametrize("backend", ["qwen3", "qwen3_hf"])
@pytest.mark.parametrize("deferred", [True, False])
def test_alternating_between_sps_and_pld_is_lossless(backend, deferred, qwen3_draft, ar_outputs, request):
    from speclab.drafters.sps import StandaloneDraft
    t = request.getfixturevalue(backend)
    for p in PROMPTS:
        router = Alternate(["sps", "pld"])
        drafters = {"sps": StandaloneDraft(qwen3_draft, k=3, tree_topk=1, stop_prob=0.0),
                    "pld": PromptLookup(k=4, max_ngram=3, min_ngram=1)}
        res = decode(t, encode_prompt(t, p), drafters, router, max_new_tokens=N_NEW, deferred=deferred)
        assert res.new_ids.tolist() == ar_outputs[p], p
        assert res.rounds < len(ar_outputs[p])  # drafts were accepted


@pytest.mark.parametrize("deferred", [True, False])
@pytest.mark.parametrize("seed", [None, 5])
def test_drafters_get_exactly_the_feature_token_pairs_of_a_full_forward(qwen3, qwen3_draft, ar_outputs, deferred, seed):
    """Whatever the switching pattern, each drafter is handed x_t with f_{t-1} equal to a full forward's layer
    outputs over the final sequence, for every token up to its last catch-up; the router's signals are the
    entropy and final hidden state of the row that produced the last committed token."""
    from speclab.drafters.sps import StandaloneDraft
    d = qwen3.hidden_size
    for p in PROMPTS[:3]:
        # "a" drafts a tree: its kept rows jump
        rec = {"a": Recorder("a", (0, 1), StandaloneDraft(qwen3_draft, k=3, tree_topk=2, stop_prob=0.0)),
               "b": Recorder("b", (1,), StandaloneDraft(qwen3_draft, k=2, tree_topk=1, stop_prob=0.0)),
               "pld": PromptLookup(k=4, max_ngram=3, min_ngram=1)}
        router = Alternate(list(rec), seed=seed)
        prompt = encode_prompt(qwen3, p)
        events = []
        res = decode(qwen3, prompt, rec, router, max_new_tokens=N_NEW, deferred=deferred, listeners=(events.append,))
        assert res.new_ids.tolist() == ar_outputs[p]
        seq = torch.cat([prompt, res.new_ids])
        full = qwen3.forward(seq, qwen3.new_cache(), layers=(0, 1), hidden=True)
        for name, cols in (("a", slice(0, 2 * d)), ("b", slice(d, 2 * d))):
            ids, feats = torch.cat(rec[name].ids), torch.cat(rec[name].feats)
            assert len(rec[name].ids) > 2  # it was chosen, and fell behind in between
            assert torch.equal(ids, seq[: ids.numel()])
            assert feats.shape == (ids.numel() - 1, cols.stop - cols.start)
            assert torch.allclose(feats, full.features[: ids.numel() - 1, cols], atol=1e-4)
        # signals: round r sees the distribution that produced the last token committed before it
        logp = torch.log_softmax(full.logits, -1)
        ent = -(logp.exp() * logp).sum(-1)
        n = prompt.numel()  # committed tokens at the start of each round
        for s, ev in zip(router.seen, events):
            if n >= 2:  # row n - 2 of the full forward produced token n - 1
                assert s.entropy == pytest.approx(float(ent[n - 2]), abs=1e-4)
                assert torch.allclose(s.hidden, full.hidden[n - 2], atol=1e-4)
            n += ev.committed.numel()
        assert sum(e.n_accepted for e in events if e.drafter == "a") > 0


def test_a_drafter_asking_for_a_missing_layer_is_refused(qwen3):
    from speclab.errors import InvalidInput
    with pytest.raises(InvalidInput, match="target layer"):
        decode(qwen3, torch.tensor([5, 6, 7]), {"x": Recorder("x", (0, 9))}, max_new_tokens=4)


def test_untraced_fast_path_decodes_the_same(qwen3, qwen3_draft, ar_outputs):
    """With no listener the engine builds no RoundEvent (it yields None) and decodes the same tokens."""
    from speclab.core.engine import decode_rounds
    from speclab.drafters.sps import StandaloneDraft
    for record in (False, True):
        gen = decode_rounds(qwen3, encode_prompt(qwen3, PROMPTS[0]),
                            {"sps": StandaloneDraft(qwen3_draft, k=3, tree_topk=1, stop_prob=0.0)},
                            max_new_tokens=N_NEW, record=record)
        items = []
        try:
            while True:
                items.append(next(gen))
        except StopIteration as end:
            res = end.value
        assert res.new_ids.tolist() == ar_outputs[PROMPTS[0]]
        assert all((it is None) != record for it in items) and len(items) == res.rounds
        assert res.elapsed_s > 0 and 0 < res.model_s <= res.elapsed_s


@pytest.mark.parametrize("name, params", [
    ("sps", dict(k=4, tree_topk=2)),
    ("eagle3", dict(depth=4, tree_topk=2, total_tokens=8)),
    ("dflash", dict(block_size=6)),
    ("specblock", dict(blocks=2, starts=2, total_tokens=16)),
    ("confu", dict(depth=3, tree_topk=2, total_tokens=6)),
])
def test_a_decode_never_reallocates_a_drafter_cache(deep, name, params, monkeypatch):
    """Every drafter's cache is sized once per decode, at `reset` (the pool hands it the decode's prompt +
    max_new_tokens; it adds its largest draft): with the default size of a cache (which doubles as it fills) made
    tiny, a decode ends on the very tensors `reset` allocated."""
    from speclab.core.lean import KVCache
    from speclab.drafters.registry import build_drafter, drafters

    monkeypatch.setattr(KVCache, "DEFAULT_CAPACITY", 4)
    models = {e.model.role: e.model.random(deep, 0) for e in drafters().values() if e.model}
    d = build_drafter(name, deep, models, **params)
    after_reset, reset = [], d.reset

    def ptrs():
        assert isinstance(d.cache, KVCache)
        return d.cache.k.data_ptr(), d.cache.v.data_ptr(), d.cache.k.shape[2]

    def spy(*a, **kw):
        reset(*a, **kw)
        after_reset.append(ptrs())

    d.reset = spy
    out = decode(deep, encode_prompt(deep, PROMPTS[0]), {name: d}, max_new_tokens=24, stop_on_eos=False)
    assert out.new_ids.numel() == 24 and len(after_reset) == 1
    assert ptrs() == after_reset[0]  # the same tensors, never grown
    assert d.cache.length > 4 * KVCache.DEFAULT_CAPACITY  # and filled far past what a default one held


@pytest.mark.parametrize("deferred", [True, False], ids=["deferred", "not-deferred"])
def test_a_decode_never_grows_the_targets_cache(deep, deferred, monkeypatch):
    """The target's cache is sized once, for the decode's tokens and the last round's tree (`lean.TREE_ROOM`): a
    decode whose last rounds verify a tree of 16 nodes right up to max_new_tokens never grows it."""
    from helpers import random_eagle3
    from speclab.core.lean import KVCache
    from speclab.drafters.registry import build_drafter

    grown, reserve = [], KVCache.reserve

    def spy(self, n):
        if self.length + n > self.k.shape[2]:
            grown.append((self.length, n, self.k.shape[2]))
        reserve(self, n)

    monkeypatch.setattr(KVCache, "reserve", spy)
    d = build_drafter("eagle3", deep, {"eagle3": random_eagle3(deep, 0)}, depth=4, tree_topk=4, total_tokens=16)
    out = decode(deep, encode_prompt(deep, PROMPTS[0]), {"eagle3": d}, max_new_tokens=24, stop_on_eos=False,
                 deferred=deferred)
    assert out.new_ids.numel() == 24 and grown == []
