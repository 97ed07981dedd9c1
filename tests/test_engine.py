"""Lossless greedy decoding: AR equals a plain argmax loop; every drafter and option equals AR token for token."""
import pytest
import torch

from conftest import PROMPTS
from speclab.engine import decode
from speclab.generate import encode_prompt, generate
from speclab.drafters.pld import PromptLookup

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


@pytest.mark.parametrize("deferred", [True, False])
@pytest.mark.parametrize("k,topk,stop_prob", [(1, 1, 0), (3, 1, 0), (5, 1, 0), (3, 2, 0), (4, 3, 0), (6, 1, 0.5)])
def test_sps_greedy_equals_ar(qwen3, qwen3_draft, ar_outputs, k, topk, stop_prob, deferred):
    accepted = 0
    for p in PROMPTS:
        res = generate(qwen3, p, "sps", draft=qwen3_draft, k=k, tree_topk=topk, stop_prob=stop_prob, deferred=deferred,
                       max_new_tokens=N_NEW)
        assert res.token_ids == ar_outputs[p], (p, k, topk)
        accepted += len(res.token_ids) - res.decode.rounds
    assert accepted > 0  # the perturbed draft agrees sometimes, so verification really accepted drafts


def test_sps_chain_stops_after_an_unsure_draft_token(qwen3, qwen3_draft):
    from speclab.drafters.sps import StandaloneDraft
    from speclab.sampling import Sampling

    lengths = []
    for p in PROMPTS:
        d = StandaloneDraft(qwen3_draft, k=6, stop_prob=0.5)
        d.reset(encode_prompt(qwen3, p))
        tree = d.propose(6, Sampling())
        lengths.append(len(tree))
        probs = tree.draft_probs.tolist()
        assert all(q >= 0.5 for q in probs[:-1])  # it went on only while the draft was sure
        assert len(tree) == 6 or probs[-1] < 0.5  # and stopped short only after an unsure token
    assert min(lengths) < 6  # some chains really were cut


def test_hf_backend_decodes_like_lean(qwen3_hf, qwen3_draft_hf, ar_outputs):
    """The transformers forward (DynamicCache, HF masks) gives the same greedy tokens as the lean forward."""
    for p in PROMPTS[:2]:
        assert generate(qwen3_hf, p, "ar", max_new_tokens=N_NEW).token_ids == ar_outputs[p]
        for k, topk in [(3, 1), (3, 2)]:
            res = generate(qwen3_hf, p, "sps", draft=qwen3_draft_hf, k=k, tree_topk=topk, max_new_tokens=N_NEW)
            assert res.token_ids == ar_outputs[p], (p, k, topk)


@pytest.mark.parametrize("deferred", [True, False])
@pytest.mark.parametrize("k", [2, 6])
def test_pld_greedy_equals_ar(qwen3, ar_outputs, k, deferred):
    for p in PROMPTS:
        res = generate(qwen3, p, "pld", k=k, deferred=deferred, max_new_tokens=N_NEW)
        assert res.token_ids == ar_outputs[p]


def test_pld_proposes_repeated_ngrams():
    d = PromptLookup(k=3, max_ngram=2)
    d.reset(torch.tensor([1, 2, 3, 4, 9, 1, 2]))
    from speclab.sampling import Sampling
    tree = d.propose(10, Sampling())
    assert tree.tokens.tolist() == [3, 4, 9] and tree.is_chain
    d.catch_up(torch.tensor([3, 4]))  # most recent match of (3, 4) wins: continuation 9, 1, 2
    assert d.propose(10, Sampling()).tokens.tolist() == [9, 1, 2]


@pytest.mark.parametrize("k", [2, 4])
def test_draft_equal_to_target_accepts_everything(qwen3, model_dir, k):
    """With the draft == the target every draft token is accepted: tau = k + 1, one target call per round."""
    from speclab.target import Target
    same = Target.load(model_dir["qwen3"])  # same weights, its own call counter
    res = generate(qwen3, PROMPTS[1], "sps", draft=same, k=k, max_new_tokens=5 * (k + 1))
    d = res.decode
    if d.stopped == "max_new_tokens":
        assert d.rounds == 5 and len(res.token_ids) == 5 * (k + 1)
    assert d.target_calls == d.rounds + 1  # + the prefill


def test_deferred_saves_target_calls(qwen3, qwen3_draft):
    on = generate(qwen3, PROMPTS[0], "sps", draft=qwen3_draft, k=3, deferred=True, max_new_tokens=N_NEW).decode
    off = generate(qwen3, PROMPTS[0], "sps", draft=qwen3_draft, k=3, deferred=False, max_new_tokens=N_NEW).decode
    assert on.new_ids.tolist() == off.new_ids.tolist()
    assert off.target_calls > on.target_calls
    assert on.target_calls == on.rounds + 1  # the prefill, then one call per round
    assert off.target_calls > 1.8 * off.rounds  # the prefill, a verify and a lone bonus forward per round


def test_stops_on_eos(qwen3):
    ids = encode_prompt(qwen3, PROMPTS[0])
    ref = decode(qwen3, ids, max_new_tokens=N_NEW).new_ids
    qwen3.eos_ids = [int(ref[5])]  # pretend the 6th generated token is EOS
    try:
        for d in ({}, {"pld": PromptLookup(k=4)}):
            res = decode(qwen3, ids, d, max_new_tokens=N_NEW)
            assert res.stopped == "eos" and res.new_ids.tolist() == ref[:6].tolist()
    finally:
        qwen3.eos_ids = [0]
