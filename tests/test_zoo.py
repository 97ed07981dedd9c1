"""The zoo is the product's default: it loads offline, the draft and the EAGLE-3 and DFlash drafters fit the
target, and greedy speculative decoding on it equals AR for one prompt of every domain."""

import pytest

from helpers import demo_rows
from speclab import generate, zoo
from speclab.core.target import Target
from speclab.drafters.dflash import load_dflash
from speclab.drafters.eagle3 import load_eagle3

PROMPTS = demo_rows()


@pytest.fixture(scope="module")
def zoo_models():
    return Target.load(zoo.default_target(), dtype="fp32"), Target.load(zoo.default_draft(), dtype="fp32")


def test_zoo_models_load_offline_and_fit(zoo_models):
    target, draft = zoo_models
    n_t = sum(p.numel() for p in target.model.parameters())
    n_d = sum(p.numel() for p in draft.model.parameters())
    assert 20e6 < n_t < 36e6 and 1e6 < n_d < 3.5e6
    assert target.vocab_size == draft.vocab_size == len(target.tokenizer)
    assert target.tokenizer.eos_token_id in target.eos_ids
    sizes = sum(f.stat().st_size for f in zoo.zoo_dir().rglob("*") if f.is_file())
    assert sizes < 150e6  # the whole zoo stays small enough to ship in the repository


@pytest.mark.slow
@pytest.mark.parametrize("row", PROMPTS, ids=[r["category"] for r in PROMPTS])
def test_zoo_speculative_greedy_equals_ar(zoo_models, row):
    target, draft = zoo_models
    ar = generate(target, row["prompt"], "ar", max_new_tokens=40)
    sps = generate(target, row["prompt"], "sps", models={"draft": draft}, k=4, max_new_tokens=40)
    tree = generate(target, row["prompt"], "sps", models={"draft": draft}, k=3, tree_topk=3, max_new_tokens=40)
    pld = generate(target, row["prompt"], "pld", k=6, max_new_tokens=40)
    assert sps.token_ids == ar.token_ids and tree.token_ids == ar.token_ids and pld.token_ids == ar.token_ids
    assert sps.decode.rounds < len(ar.token_ids)  # the zoo draft really gets tokens accepted


@pytest.fixture(scope="module")
def zoo_eagle3(zoo_models):
    return load_eagle3(zoo.default_eagle3(), zoo_models[0])


def test_zoo_eagle3_fits_the_target(zoo_models, zoo_eagle3):
    target = zoo_models[0]
    c = zoo_eagle3.config
    assert c.layer_ids == (1, 3, 5) and c.target_layers == (0, 2, 4)  # three distinct layers of the 6
    assert c.vocab_size == target.vocab_size and c.target_hidden_size == target.hidden_size
    assert zoo_eagle3.embed_tokens is None  # it shares the target's embedding


@pytest.mark.slow
@pytest.mark.parametrize("row", PROMPTS, ids=[r["category"] for r in PROMPTS])
def test_zoo_eagle3_greedy_equals_ar(zoo_models, zoo_eagle3, row):
    """The trained drafter: the CPU default, a chain and a wider tree, deferred and not."""
    target = zoo_models[0]
    ar = generate(target, row["prompt"], "ar", max_new_tokens=40)
    for spec, deferred in [("eagle3", True), ("eagle3:tree_topk=1+depth=4", False),
                           ("eagle3:depth=4+tree_topk=3+total_tokens=10", True)]:
        res = generate(target, row["prompt"], spec, models={"eagle3": zoo_eagle3}, max_new_tokens=40, deferred=deferred)
        assert res.token_ids == ar.token_ids, spec
        assert res.decode.rounds < len(ar.token_ids)  # drafts are accepted


@pytest.fixture(scope="module")
def zoo_dflash(zoo_models):
    return load_dflash(zoo.default_dflash(), zoo_models[0])


def test_zoo_dflash_fits_the_target(zoo_models, zoo_dflash):
    target = zoo_models[0]
    c = zoo_dflash.config
    assert c.target_layer_ids == (1, 2, 3) and c.hidden_size == target.hidden_size  # DFlash's 1..L-3 of the 6
    assert target.tokenizer.convert_ids_to_tokens(c.mask_token_id) == "<|mask|>"
    assert zoo_dflash.has_markov and c.block_size == 16


@pytest.mark.slow
@pytest.mark.parametrize("row", PROMPTS, ids=[r["category"] for r in PROMPTS])
def test_zoo_dflash_greedy_equals_ar(zoo_models, zoo_dflash, row):
    """The trained drafter: the CPU default (Markov head on), without the head, and the GPU preset's block of 16."""
    target = zoo_models[0]
    ar = generate(target, row["prompt"], "ar", max_new_tokens=40)
    for spec, deferred in [("dflash", True), ("dflash:markov=0", False), ("dflash:block_size=16", True)]:
        res = generate(target, row["prompt"], spec, models={"dflash": zoo_dflash}, max_new_tokens=40, deferred=deferred)
        assert res.token_ids == ar.token_ids, spec
        assert res.decode.rounds < len(ar.token_ids)  # drafts are accepted


def test_paths_show_relative_to_the_repository_only_when_inside_it(tmp_path):
    """`zoo.display_path`: a path inside the repository relative to it; one outside whole (a trace in a temporary
    folder is not shown as if it lay in the repository: app v4, item 11); a relative path or hub name as given."""
    assert zoo.display_path(zoo.REPO_ROOT / "data" / "zoo" / "target") == "data/zoo/target"
    outside = tmp_path / "traces" / "app.duckdb"
    assert zoo.display_path(outside) == str(outside.resolve())
    assert zoo.display_path("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"
