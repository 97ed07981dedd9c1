"""The zoo is the product's default: it loads offline, the draft fits the target, and greedy speculative
decoding on it equals AR for one prompt of every domain."""
import json

import pytest

from speclab import generate, zoo
from speclab.target import Target

PROMPTS = [json.loads(l) for l in (zoo.REPO_ROOT / "data" / "prompts" / "demo.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def zoo_models():
    return Target.load(zoo.default_target()), Target.load(zoo.default_draft())


def test_zoo_models_load_offline_and_fit(zoo_models):
    target, draft = zoo_models
    n_t = sum(p.numel() for p in target.model.parameters())
    n_d = sum(p.numel() for p in draft.model.parameters())
    assert 20e6 < n_t < 36e6 and 1e6 < n_d < 3.5e6
    assert target.vocab_size == draft.vocab_size == len(target.tokenizer)
    assert target.tokenizer.eos_token_id in target.eos_ids
    sizes = sum(f.stat().st_size for f in zoo.zoo_dir().rglob("*") if f.is_file())
    assert sizes < 62e6  # the whole zoo stays small enough to ship in the repository


@pytest.mark.parametrize("row", PROMPTS, ids=[r["category"] for r in PROMPTS])
def test_zoo_speculative_greedy_equals_ar(zoo_models, row):
    target, draft = zoo_models
    ar = generate(target, row["prompt"], "ar", max_new_tokens=40)
    sps = generate(target, row["prompt"], "sps", draft=draft, k=4, max_new_tokens=40)
    tree = generate(target, row["prompt"], "sps", draft=draft, k=3, tree_topk=3, max_new_tokens=40)
    pld = generate(target, row["prompt"], "pld", k=6, max_new_tokens=40)
    assert sps.token_ids == ar.token_ids and tree.token_ids == ar.token_ids and pld.token_ids == ar.token_ids
    assert sps.decode.rounds < len(ar.token_ids)  # the zoo draft really gets tokens accepted
