"""Telling a numerical tie from a bug: the first differing token and the target's top-2 logit gap there."""
import pytest
import torch

from helpers import PROMPTS
from speclab.equality import first_divergence, output_hash
from speclab.generate import encode_prompt, generate


def test_equal_outputs_have_no_divergence(qwen3):
    ids = encode_prompt(qwen3, PROMPTS[0])
    out = generate(qwen3, ids, "ar", max_new_tokens=12).token_ids
    assert first_divergence(qwen3, ids, out, list(out)) is None
    assert output_hash(out) == output_hash(list(out)) != output_hash(out[:-1])


def test_divergence_reports_position_and_the_targets_top2_gap(qwen3):
    ids = encode_prompt(qwen3, PROMPTS[2])
    ref = generate(qwen3, ids, "ar", max_new_tokens=12).token_ids
    other = list(ref)
    logits = qwen3.forward(torch.cat([ids, torch.tensor(ref[:7])]), qwen3.new_cache()).logits[-1]
    top = logits.topk(2)
    other[7] = int(top.indices[1])  # a different token at position 7 (the target's runner-up)
    div = first_divergence(qwen3, ids, ref, other)
    assert (div.pos, div.ref_token, div.token) == (7, ref[7], other[7])
    assert div.top2_gap == pytest.approx(float(top.values[0] - top.values[1]), abs=1e-5)
    assert not div.near_tie and "bug" in div.describe()  # a tiny model's random logits are far from a tie
    div.tolerance = div.top2_gap  # within rounding of the top logit: a near-tie
    assert div.near_tie and "near-tie" in div.describe()
    assert first_divergence(qwen3, ids, ref, ref[:5]).pos == 5  # one output stopped early
    # with the tokenizer: the two tokens' text and the target's probabilities of them (the app's note, v4 item 6)
    probs = torch.softmax(logits.float(), -1)
    assert (div.ref_prob, div.prob) == pytest.approx((float(probs[ref[7]]), float(probs[other[7]])), abs=1e-6)
    text = div.describe(qwen3.tokenizer)
    assert f"AR {qwen3.tokenizer.decode([ref[7]])!r}, p {div.ref_prob:.3g} vs" in text
    assert f"{qwen3.tokenizer.decode([other[7]])!r}, p {div.prob:.3g})" in text and f"({ref[7]} vs" not in text
    assert "the end of the output" in first_divergence(qwen3, ids, ref, ref[:5]).describe(qwen3.tokenizer)
