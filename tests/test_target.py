"""Target adapter, on both backends (lean and hf): tree-masked forward equals linear paths, cache surgery
equals a full forward, feature capture."""
import pytest
import torch

from speclab.core.target import crop_cache, keep_cache
from speclab.core.tree import DraftTree, tree_attention_mask, tree_position_ids


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_hf"])
def test_tree_mask_forward_equals_linear_paths(arch, request):
    t = request.getfixturevalue(arch)
    prefix = torch.tensor([5, 17, 300, 42, 7])
    # root = prefix[-1]; a tree with two branches of depth 2 and 3
    tree = DraftTree(torch.tensor([11, 12, 13, 14, 15]), torch.tensor([-1, 0, -1, 2, 3]), torch.ones(5))
    cache = t.new_cache()
    t.prefill(prefix[:-1], cache)
    past = cache.get_seq_length()
    inp = torch.cat([prefix[-1:], tree.tokens])
    out = t.forward(inp, cache, tree_position_ids(tree.depth, past, True),
                    tree_attention_mask(tree.ancestors, past, t.dtype, True)).logits
    for leaf in (1, 4):
        path = tree.path_to(leaf)
        seq = torch.cat([prefix, tree.tokens[path]])
        ref = t.forward(seq, t.new_cache()).logits
        got = out[[0] + [p + 1 for p in path]]
        assert torch.allclose(got, ref[len(prefix) - 1:], atol=1e-4), (leaf, (got - ref[len(prefix) - 1:]).abs().max())


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_hf"])
def test_keep_path_then_continue_equals_full_forward(arch, request):
    t = request.getfixturevalue(arch)
    prefix = torch.tensor([9, 8, 7, 6])
    tree = DraftTree(torch.tensor([21, 22, 23, 24]), torch.tensor([-1, -1, 1, 2]), torch.ones(4))
    cache = t.new_cache()
    t.prefill(prefix[:-1], cache)
    past = cache.get_seq_length()
    t.forward(torch.cat([prefix[-1:], tree.tokens]), cache, tree_position_ids(tree.depth, past, True),
              tree_attention_mask(tree.ancestors, past, t.dtype, True))
    accepted = torch.tensor([1, 2])  # the path 22 -> 23 (node 0 rejected)
    keep_cache(cache, past, torch.cat([torch.zeros(1, dtype=torch.long), accepted + 1]))
    assert cache.get_seq_length() == len(prefix) + 2
    nxt = torch.tensor([99, 98])
    got = t.forward(nxt, cache).logits
    ref = t.forward(torch.cat([prefix, tree.tokens[accepted], nxt]), t.new_cache()).logits[-2:]
    assert torch.allclose(got, ref, atol=1e-4)


@pytest.mark.parametrize("backend", ["qwen3", "qwen3_hf"])
def test_crop_then_continue_equals_full_forward(backend, request):
    qwen3 = request.getfixturevalue(backend)
    seq = torch.arange(3, 15)
    cache = qwen3.new_cache()
    qwen3.prefill(seq, cache)
    crop_cache(cache, 8)
    got = qwen3.forward(torch.tensor([77]), cache).logits
    ref = qwen3.forward(torch.cat([seq[:8], torch.tensor([77])]), qwen3.new_cache()).logits[-1:]
    assert torch.allclose(got, ref, atol=1e-4)


@pytest.mark.parametrize("backend", ["qwen3", "qwen3_hf"])
def test_forward_returns_the_asked_layers_per_call(backend, request):
    """Features are an output of the call that asks for them: no state on the Target between calls."""
    qwen3 = request.getfixturevalue(backend)
    d = qwen3.hidden_size
    out = qwen3.forward(torch.tensor([4, 5, 6]), qwen3.new_cache(), layers=(0, 1))
    assert out.features.shape == (3, 2 * d) and out.hidden is None
    ref = qwen3.model(input_ids=torch.tensor([[4, 5, 6]]), output_hidden_states=True).hidden_states
    assert torch.allclose(out.features[:, :d], ref[1][0], atol=1e-5)  # layer j's output = HF hidden_states[j + 1]
    assert qwen3.forward(torch.tensor([4]), qwen3.new_cache()).features is None
