"""speclab.core.native: the decoder layers' loop run from C++ is bitwise the Python path's, for the target's lean
forward and for the drafters that use it, in fp32 and bf16; and it is really used where a compiler is at hand."""
import copy
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from helpers import PROMPTS, NoTok, build_tiny, tiny_config
from speclab.core import native
from speclab.core.layers import apply_rope, rope_tables
from speclab.core.lean import ConRows, Segment
from speclab.core.target import Target
from speclab.drafters.registry import drafters
from speclab.generate import generate

needs_build = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                 reason="no C++ compiler on this machine: decoding runs from Python")


def _python(monkeypatch):
    monkeypatch.setattr(native, "ENABLED", False)


def _same_natively_as_from_python(run, monkeypatch) -> None:
    """`run()`'s tensors natively, then from Python (`_python`): as many, each equal bit for bit."""
    fast = run()
    _python(monkeypatch)
    slow = run()
    assert len(fast) == len(slow) and all(torch.equal(a, b) for a, b in zip(fast, slow))


@needs_build
def test_the_native_layers_build_and_run_on_the_cpu():
    assert native.build() is not None
    with torch.inference_mode():
        assert native.active(torch.zeros(1))
    assert not native.active(torch.zeros(1))  # autograd on: training's forwards stay Python's


@needs_build
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_pass_rms_norm_and_rope_are_bitwise_torchs_ops(dtype):
    """The module's own RMSNorm and rotary loops on every shape the models give them (widths of the zoo's and the
    tests' models, one row to a prefill's, head slices of a fused qkv, no weight, tiny and large values, the eps
    values in use): bitwise torch's ops. This torch passes the module's own check, so the loops are what runs."""
    mod = native.build()
    assert native._fused_ops_agree(mod)
    g = torch.Generator().manual_seed(1)
    for n in (32, 64, 100, 192, 512, 1536):
        for shape in ((1,), (7,), (300,), (2, 12)):
            for scale in (1e-3, 1.0, 300.0):
                x = (torch.randn(*shape, n, generator=g) * scale).to(dtype)
                w = torch.randn(n, generator=g).to(dtype)
                for eps in (1e-6, 1e-5, torch.finfo(dtype).eps):
                    assert torch.equal(mod.rms_norm(x, w, eps), F.rms_norm(x, (n,), w, eps)), (n, shape, scale, eps)
                    assert torch.equal(mod.rms_norm(x, None, eps), F.rms_norm(x, (n,), None, eps))
    for d in (32, 64, 128):
        cos, sin = rope_tables(1.0 / 10000 ** (torch.arange(0, d, 2).float() / d), 1.0, 400, dtype)
        for rows, heads in ((1, 4), (5, 12), (300, 1)):
            pos = torch.randint(0, 400, (rows,), generator=g)
            c, s = cos[pos][:, None], sin[pos][:, None]
            qkv = (torch.randn(rows, 2 * heads, d, generator=g) * 3).to(dtype)
            for x in (qkv, qkv[:, :heads]):  # whole, and q and k sliced out of a fused qkv (strided)
                a, b = mod.rope(x, c, s), apply_rope(x, c, s)
                assert torch.equal(a, b) and a.stride() == b.stride(), (d, rows, heads)


@needs_build
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_drafters_paired_norms_and_head_log_probs_are_bitwise_torchs_ops(dtype):
    """EAGLE-3's attention input (two norms side by side) and its head as log-probabilities, each one native call:
    bitwise the modules and ops they replace, for one row, a tree's frontier and a backlog."""
    from speclab.core.layers import Linear
    g = torch.Generator().manual_seed(2)
    na, nb, norm = (torch.nn.RMSNorm(64, eps=1e-6).to(dtype) for _ in range(3))
    head = Linear(64, 300, bias=False).to(dtype)
    with torch.no_grad():
        for m in (na, nb, norm, head):
            m.weight.copy_(torch.randn(m.weight.shape, generator=g))
    with torch.inference_mode():
        for rows in (1, 4, 37):
            a, b = (torch.randn(rows, 64, generator=g).to(dtype) * 3 for _ in range(2))
            assert torch.equal(native.pair_norm(na, a, nb, b), torch.cat([na(a), nb(b)], -1)), rows
            want = torch.log_softmax(head(norm(b)).float(), -1)
            assert torch.equal(native.head_logp(norm, head, b), want), rows


@needs_build
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_lean_forward_natively_is_bitwise_the_python_forward(arch, dtype, monkeypatch):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, 300, layers=3)).eval().to(dtype)
    lean = Target(model, NoTok(), backend="lean").lean
    ids = torch.randint(3, 300, (120,))

    def run():
        out = []
        with torch.inference_mode():
            for n in (1, 5, 37):
                cache = lean.new_cache(200)
                first = lean.forward(ids[:40], cache, layers=(2, 0))  # kept layers come back in the order asked
                plain = lean.forward(ids[40 : 40 + n], cache, layers=(1,), hidden=True)
                tree = torch.zeros(1, 1, n, 40 + 2 * n, dtype=dtype)  # a tree mask: each node sees itself only
                tree[..., 40 + n :] = float("-inf")
                tree[..., 40 + n :].diagonal(dim1=-2, dim2=-1).zero_()
                masked = lean.forward(ids[:n], cache, mask=tree, last=2)
                out += [*first[:2], *plain[:3], masked[0], cache.k[:, :, : 40 + 2 * n], cache.v[:, :, : 40 + 2 * n]]
        return out

    fast = run()
    _python(monkeypatch)
    slow = run()
    assert all(torch.equal(a, b) for a, b in zip(fast, slow))


@needs_build
@pytest.mark.parametrize("dtype,logits", [(torch.bfloat16, "fp32"), (torch.bfloat16, "model"), (torch.float32, "fp32")],
                         ids=["bf16", "bf16-model-logits", "fp32"])
def test_the_lean_forward_in_one_native_call_is_the_per_op_forwards_bits(dtype, logits):
    """`native.lean_forward` (the lean forward of rows at consecutive positions: embedding, rotary rows, causal mask,
    layers, kept features, final norm, head, in one call) against the same forward op by op (explicit positions take
    that path: the tables' rows by index, the same values): logits, features in the order asked, final-norm states
    and the cache, for 1 to 37 rows, with and without `last`, refined fp32 logits or the model's, and for a ragged
    batch (`forward_many`); and it is taken."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3", 300, layers=3)).eval().to(dtype)
    lean = Target(model, NoTok(), backend="lean", logits=logits).lean
    ids = torch.randint(3, 300, (120,))
    calls = []
    real = native.lean_forward

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    with torch.inference_mode(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(native, "lean_forward", spy)
        for n, layers, last in ((1, (), None), (5, (1,), None), (37, (2, 0), 2), (2, (0, 2, 1), 1)):
            one, per_op = lean.new_cache(200), lean.new_cache(200)
            for c in (one, per_op):
                lean.forward(ids[:40], c, pos=torch.arange(40))
            got = lean.forward(ids[40 : 40 + n], one, layers=layers, last=last, hidden=True)
            want = lean.forward(ids[40 : 40 + n], per_op, pos=torch.arange(40, 40 + n), layers=layers, last=last,
                                hidden=True)
            for a, b in zip(got[:3], want[:3]):
                assert (a is None and b is None) or torch.equal(a, b), (n, layers, last)
            assert one.length == per_op.length == 40 + n
            assert torch.equal(one.k[:, :, : 40 + n], per_op.k[:, :, : 40 + n])
            assert torch.equal(one.v[:, :, : 40 + n], per_op.v[:, :, : 40 + n])
        # a ragged batch (`forward_many`: a single row beside chains), each sequence after its own cache
        ones, per_ops = [lean.new_cache(200) for _ in range(3)], [lean.new_cache(200) for _ in range(3)]
        for i, (a, b) in enumerate(zip(ones, per_ops)):
            for c in (a, b):
                lean.forward(ids[: 30 + 7 * i], c, pos=torch.arange(30 + 7 * i))
        rows = [ids[60:61], ids[61:66], ids[66:69]]
        got = lean.forward_many([Segment(x, c, None, None) for x, c in zip(rows, ones)], layers=(2, 0), hidden=True)
        want = lean.forward_many([Segment(x, c, torch.arange(c.length, c.length + x.numel()), None)
                                  for x, c in zip(rows, per_ops)], layers=(2, 0), hidden=True)
        for g, w in zip(got, want):
            assert all(torch.equal(a, b) for a, b in zip(g, w))
        for a, b in zip(ones, per_ops):
            assert a.length == b.length and torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    assert len(calls) == 5


@needs_build
@pytest.mark.parametrize("arch,hidden", [("qwen3", 256), ("llama", 128), ("qwen2", 128)])
def test_a_decode_steps_layers_without_atens_small_ops_are_the_loops_bits(arch, hidden):
    """`native.cpp`'s `decode_layers` (a few bf16 rows of a sequence or of several: Qwen3's q/k norms, Qwen2's
    biases, Llama's grouped heads; heads of 64 and 32) against the loop it stands for: logits, kept layers, final
    states and the cache's keys and values bit for bit, at 1, 2, 5 and 9 rows, causal and under a tree mask, with
    extra rows riding along (ConFu's) and as a ragged batch of three sequences (serving's); every call took it."""
    from transformers import Qwen2Config

    mod = native.build()
    if native.attention_module() is None:
        pytest.skip("no native attention in this process (no AVX512-BF16): the loop runs everywhere")
    torch.manual_seed(0)
    cfg = tiny_config("qwen3" if arch == "qwen2" else arch, 300, hidden=hidden, layers=3)
    if arch == "qwen2":  # q/k/v biases, no q/k norms
        cfg = Qwen2Config(**{k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                          "num_hidden_layers", "num_attention_heads",
                                                          "num_key_value_heads", "max_position_embeddings")})
    model = AutoModelForCausalLM.from_config(cfg).eval().to(torch.bfloat16)
    with torch.no_grad():  # norm weights and biases off their initial ones and zeros (a product by 1 hides a rounding)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    lean = Target(model, NoTok(), backend="lean").lean
    ids = torch.randint(3, 300, (60,))

    def run(fast: bool):
        mod.set_fast_layers(fast)
        out, calls = [], mod.get_fast_calls()
        try:
            with torch.inference_mode():
                for n in (1, 2, 5, 9):
                    cache = lean.new_cache(100)
                    lean.forward(ids[:40], cache)  # a prefill: more rows than the path takes
                    plain = lean.forward(ids[40 : 40 + n], cache, layers=(2, 0), hidden=True)
                    see = torch.ones(n, 40 + 2 * n, dtype=torch.bool).tril(40 + n)  # a tree: node 0 unseen by the rest
                    see[1:, 40 + n] = False
                    tree = torch.zeros(1, 1, n, 40 + 2 * n, dtype=torch.bfloat16).masked_fill(~see, float("-inf"))
                    pos = 40 + n + torch.tensor([0] + [1] * (n - 1))
                    masked = lean.forward(ids[:n], cache, pos, tree, hidden=True)
                    out += [*plain[:3], *masked[:3:2], cache.k[:, :, : 40 + 2 * n], cache.v[:, :, : 40 + 2 * n]]
                    # n extra rows riding after n plain ones (ConFu's contemplate rows: their own fp32 keys and values,
                    # row r seeing the cache up to plain row r and itself), the plain rows' outputs and theirs
                    visible = torch.ones(n, 40 + 3 * n, dtype=torch.bool).tril(40 + 2 * n)
                    con = ConRows(emb[:n], 40 + 2 * n + torch.arange(n), visible, soft_k, soft_v)
                    wide = lean.forward(ids[n : 2 * n], cache, layers=(1,), hidden=True, con=con)
                    out += [*wide[:3], wide[3], cache.k[:, :, : 40 + 3 * n]]
                    # a ragged batch (a serving step): 1 row after another cache, n after this one, n under a tree
                    other, third = lean.new_cache(100), lean.new_cache(100)
                    lean.forward(ids[:35], other)  # prefills: more rows than the path takes
                    lean.forward(ids[5:45], third)
                    see = torch.ones(n, 40 + n, dtype=torch.bool).tril(40)
                    see[1:, 40] = False
                    tree = torch.zeros(1, 1, n, 40 + n, dtype=torch.bfloat16).masked_fill(~see, float("-inf"))
                    segs = [Segment(ids[35:36], other), Segment(ids[:n], cache),
                            Segment(ids[n : 2 * n], third, 40 + torch.tensor([0] + [1] * (n - 1)), tree)]
                    out += [x for row in lean.forward_many(segs, layers=(0, 2), hidden=True) for x in row]
                    out += [other.k[:, :, :36], cache.v[:, :, : 40 + 4 * n], third.k[:, :, : 40 + n]]
        finally:
            mod.set_fast_layers(True)
        return out, mod.get_fast_calls() - calls

    kv, D = cfg.num_key_value_heads, hidden // cfg.num_attention_heads
    soft_k, soft_v = torch.randn(2, 3, kv, 4, D).unbind(0)  # 4 soft prompts a layer and kv head, in fp32
    emb = torch.randn(9, hidden, dtype=torch.bfloat16)
    (fast, taken), (loop, none) = run(True), run(False)
    heads = 16 if native.product() else 0  # the fp32 head from raw rows where its copy is a native product's
    assert taken == 16 + heads and none == 0  # 16 forwards of a few rows: their layers (and heads)
    assert len(fast) == len(loop) and all(torch.equal(a, b) for a, b in zip(fast, loop))


@pytest.mark.parametrize("qk_norm,bias,wide", [(True, False, False), (False, True, True)],
                         ids=["qk-norms", "biases-wide-input"])
def test_a_drafters_layer_without_atens_small_ops_is_the_ops_bits(qk_norm, bias, wide):
    """`native.cpp`'s `decode_layer_rows` (a drafter's `DecoderLayer` over a few bf16 rows of one sequence or of a
    ragged batch: DFlash's and SpecBlock's q/k norms; biases and EAGLE-3's two-wide input) against the ops it stands
    for: the output and the caches' keys and values bit for bit, at 1, 3 and 9 rows and a batch of three sequences,
    every row querying or the last ones (`q_rows`, EAGLE-3's catch-up), causal and under a mask; every call took it."""
    from speclab.core.layers import DecoderLayer
    from speclab.core.lean import KVCache

    mod = native.build()
    if native.attention_module() is None:
        pytest.skip("no native attention in this process (no AVX512-BF16): the ops run everywhere")
    torch.manual_seed(0)
    d, H, KV, D = 128, 4, 2, 32
    layer = DecoderLayer(d, 256, H, KV, D, 1e-6, bias=bias, d_in=2 * d if wide else None, qk_norm=qk_norm)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.05).add_(1.0 if p.dim() == 1 and p.shape[0] in (d, D) else 0.0)  # norms about 1
    layer = layer.to(torch.bfloat16).eval()
    cos_t, sin_t = rope_tables(torch.tensor([1.0 / 10000 ** (i / D) for i in range(0, D, 2)]), 1.0, 200,
                               torch.bfloat16)

    def run(fast: bool):
        mod.set_fast_layers(fast)
        out, calls = [], mod.get_fast_calls()
        try:
            with torch.inference_mode():
                for n, last, masked in [(1, False, False), (3, False, True), (9, True, False), (9, False, True)]:
                    g = torch.Generator().manual_seed(n)
                    cache = KVCache(1, KV, D, torch.bfloat16, "cpu", 64)
                    x = torch.randn(n, (2 if wide else 1) * d, generator=g).to(torch.bfloat16)
                    q_rows = torch.tensor([n - 1]) if last else None
                    nq = 1 if last else n
                    h = torch.randn(nq, d, generator=g).to(torch.bfloat16)
                    mask = None
                    if masked:
                        see = torch.ones(nq, 20 + n, dtype=torch.bool).tril(20 + n - nq)
                        see[-1, 20] = False
                        mask = torch.zeros(nq, 20 + n, dtype=torch.bfloat16).masked_fill(~see, float("-inf"))
                    y = native.decoder_layer(layer, 0, x, h, cos_t[20 : 20 + n, None], sin_t[20 : 20 + n, None],
                                             [cache], [20], [n], [mask], D ** -0.5, q_rows, [nq])
                    out += [y, cache.k[:, :, : 20 + n], cache.v[:, :, : 20 + n]]
                # a ragged batch of three sequences (a batch of requests' drafters), every row querying or each
                # sequence's last (`q_rows`, EAGLE-3's batched catch-up); the third under a mask
                starts, ns = [20, 35, 10], [3, 1, 4]
                ends = torch.tensor(ns).cumsum(0)
                pos = torch.cat([torch.arange(a, a + k) for a, k in zip(starts, ns)])
                for last in (False, True):
                    g = torch.Generator().manual_seed(7)
                    caches = [KVCache(1, KV, D, torch.bfloat16, "cpu", 64) for _ in ns]
                    x = torch.randn(sum(ns), (2 if wide else 1) * d, generator=g).to(torch.bfloat16)
                    q_rows, nqs = (ends - 1, [1, 1, 1]) if last else (None, ns)
                    h = torch.randn(sum(nqs), d, generator=g).to(torch.bfloat16)
                    see = torch.ones(nqs[2], 14, dtype=torch.bool).tril(14 - nqs[2])
                    see[-1, 10] = False
                    mask = torch.zeros(nqs[2], 14, dtype=torch.bfloat16).masked_fill(~see, float("-inf"))
                    y = native.decoder_layer(layer, 0, x, h, cos_t[pos][:, None], sin_t[pos][:, None], caches, starts,
                                             ns, [None, None, mask], D ** -0.5, q_rows, nqs)
                    out += [y, *[c.k[:, :, : a + k] for c, a, k in zip(caches, starts, ns)],
                            *[c.v[:, :, : a + k] for c, a, k in zip(caches, starts, ns)]]
        finally:
            mod.set_fast_layers(True)
        return out, mod.get_fast_calls() - calls

    (fast, taken), (loop, none) = run(True), run(False)
    assert taken == 6 and none == 0
    assert len(fast) == len(loop) and all(torch.equal(a, b) for a, b in zip(fast, loop))


def test_the_refined_head_from_raw_rows_is_the_ops_bits():
    """`native.cpp`'s `refined_rows` (the fp32 head's refinement: the bf16 product, the dot product's or the tiles',
    its top 16 recomputed in fp32, the rows whose bound says an unrefined logit could reach the maximum) against the
    ops it stands for: logits and flags bit for bit at 1, 3 and 17 rows, rows with near-ties (flagged) among them;
    every call took it."""
    mod = native.build()
    if native.product() not in ("dp", "tiles") or native.attention_module() is None:
        pytest.skip("no native product with AVX512-BF16 in this process: the ops run everywhere")
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(1000, 128, generator=g) * 0.1).to(torch.bfloat16)
    w[1:20] = w[0]  # twenty equal rows: h[0]'s top 16 logits and the 17th tie, the bound flags that row
    copies = native._copies(w)
    w_norm = float(w.float().norm(dim=-1).max())

    def run(fast: bool):
        mod.set_fast_layers(fast)
        out, calls = [], mod.get_fast_calls()
        try:
            with torch.inference_mode():
                for n in (1, 3, 17):
                    h = torch.randn(n, 128, generator=g)
                    h[0] = w[0].float() * 4  # its top logits are those of rows 0-19, equal
                    out += mod.refined_head(h, w, *copies, 16, w_norm)
        finally:
            mod.set_fast_layers(True)
        return out, mod.get_fast_calls() - calls

    g.manual_seed(1)
    (fast, taken) = run(True)
    g.manual_seed(1)
    (loop, none) = run(False)
    assert taken == 3 and none == 0
    assert all(torch.equal(a, b) for a, b in zip(fast, loop))
    assert fast[1][0] and fast[3][0] and not fast[3][1:].any()  # the tied rows flagged, the others not


def test_drafters_decode_with_the_fast_layers_as_with_the_loops(tmp_path):
    """Every model drafter on a bf16 target with heads of 32 (the sizes the fast paths take): greedy and sampled
    decodes give the same tokens in the same rounds with `decode_layers` / `decode_layer_rows` as with the ops they
    stand for, and the drafters' calls take them too (more fast calls than the target's forwards)."""
    mod = native.build()
    if native.attention_module() is None:
        pytest.skip("no native attention in this process (no AVX512-BF16): the loop runs everywhere")
    target = Target.load(build_tiny("qwen3", tmp_path / "t", seed=3, hidden=128, layers=4), dtype="bf16")
    for name in ("eagle3", "dflash", "sps", "specblock", "confu"):
        entry = drafters()[name]
        models = {entry.model.role: entry.model.random(target, 0)}
        with torch.no_grad():  # norm weights off their initial ones (a product by 1 hides a rounding; sps's draft is
            for p in getattr(models[entry.model.role], "parameters", list)():  # a Target: the test above's layers)
                p.add_(torch.randn_like(p) * 0.05)

        def run(fast: bool, name=name, models=models):
            mod.set_fast_layers(fast)
            out, calls, fwd = [], mod.get_fast_calls(), target.calls
            try:
                for t in (0.0, 1.0):
                    g = generate(target, PROMPTS[0], name, models=models, max_new_tokens=24, temperature=t, seed=3)
                    out.append((g.token_ids, g.decode.rounds))
            finally:
                mod.set_fast_layers(True)
            return out, mod.get_fast_calls() - calls, target.calls - fwd

        (fast, taken, forwards), (loop, none, _) = run(True), run(False)
        assert fast == loop, name
        assert taken > forwards and none == 0, name


@needs_build
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ["eagle3", "dflash", "sps", "specblock", "confu"])
def test_drafters_decode_natively_as_from_python(name, dtype, deep, monkeypatch):
    """Greedy and sampled decodes (the target not in exact mode, so its forwards run natively too): the same tokens
    in the same rounds with the native layers as without."""
    entry = drafters()[name]
    target = Target.load(deep.name, dtype=dtype)
    models = {entry.model.role: entry.model.random(target, 0)}

    def run():
        out = []
        for t in (0.0, 1.0):
            g = generate(target, PROMPTS[0], name, models=models, max_new_tokens=24, temperature=t, seed=3)
            out.append((g.token_ids, g.decode.rounds))
        return out

    fast = run()
    _python(monkeypatch)
    assert run() == fast


def _ragged_forward(target, prompts) -> tuple[list[torch.Tensor], list]:
    """`forward_many` (layers 2 and 0 kept) over one sequence after each prompt: a chain of three rows, one row, the
    root and a tree of four under its mask, then one row each -> (every sequence's logits and features, the caches)."""
    from speclab.core.lean import Segment
    from speclab.core.tree import DraftTree, tree_attention_mask, tree_position_ids

    tree = DraftTree(torch.tensor([5, 6, 7, 8]), torch.tensor([-1, 0, 0, 1]), torch.ones(4))
    with torch.inference_mode():
        caches = [target.new_cache(128) for _ in prompts]
        for x, c in zip(prompts, caches):
            target.forward(x, c)
        rows = [torch.tensor([5, 6, 7]), torch.tensor([9]), torch.cat([torch.tensor([4]), tree.tokens])]
        segs = [Segment(r, c) for r, c in zip(rows + [torch.tensor([11])] * (len(prompts) - 3), caches)]
        segs[2] = Segment(rows[2], caches[2], tree_position_ids(tree.depth, caches[2].length, True),
                          tree_attention_mask(tree.ancestors, caches[2].length, target.dtype, True))
        return [t for o in target.forward_many(segs, layers=(2, 0)) for t in (o.logits, o.features)], caches


def _eagle3_batch(target, model, prompts, tokens: int) -> list:
    """The prompts decoded together with EAGLE-3 chains of 3 (`Batch`, fixed k = 3) -> each request's `Done`."""
    from speclab.core.batch import Batch, Request
    from speclab.core.sampling import Sampling
    from speclab.drafters.registry import build_drafter
    from speclab.serve.policies import Fixed

    make = lambda: {"eagle3": build_drafter("eagle3", target, {"eagle3": model}, depth=3)}  # noqa: E731
    batch = Batch(target, make, Fixed(3), Sampling(), max_batch=len(prompts))
    for i, x in enumerate(prompts):
        batch.submit(Request(i, x, tokens))
    while not batch.idle:
        batch.step()
    return [batch.done[i] for i in range(len(prompts))]


@needs_build
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_ragged_batches_natively_are_bitwise_the_python_batches(dtype, deep, trained_dflash, monkeypatch):
    """`forward_many` over three sequences (a chain, one row, a tree's rows) and DFlash's blocks of two drafters in
    one call (their prompts' backlogs, then a batch's stashed backlogs with the blocks, then a drafter's own catch-up
    alone: `native.dflash_block`, called each time): the same logits, features and caches natively as from
    Python."""
    from speclab.core.sampling import Sampling
    from speclab.drafters.dflash import DFlashDrafter
    from speclab.drafters.registry import build_drafter

    target = Target.load(deep.name, dtype=dtype)
    model = copy.deepcopy(trained_dflash).to(target.dtype)  # the session's fixture stays as it is (fp32)
    prompts = [torch.tensor(target.tokenizer(p)["input_ids"]) for p in PROMPTS[:3]]

    calls = []
    block = native.dflash_block
    monkeypatch.setattr(native, "dflash_block", lambda *a, **k: calls.append(a[6].numel()) or block(*a, **k))

    def run():
        out, caches = _ragged_forward(target, prompts)
        out += [c.k[:, :, : c.length] for c in caches]
        with torch.inference_mode():
            ds = [build_drafter("dflash", target, {"dflash": model}, block_size=5, markov=0) for _ in prompts[:2]]
            feats = [target.forward(x, target.new_cache(128), layers=ds[0].layers).features for x in prompts[:2]]
            for d, x, f in zip(ds, prompts, feats):
                d.reset(x, f)
            out += DFlashDrafter.blocks_logits(ds, [5, 3])
            out += [d.cache.v[:, :, : d.cache.length] for d in ds]
            out += [d.propose(4, Sampling(), None).tokens for d in ds]
            DFlashDrafter.catch_up_many(ds, [prompts[0][:3], prompts[1][:1]], [feats[0][:3], feats[1][:1]])
            out += DFlashDrafter.blocks_logits(ds, [4, 5])
            ds[0].catch_up(prompts[0][:2], feats[0][:2])
            out += [d.cache.k[:, :, : d.cache.length] for d in ds]
            out.append(ds[0].propose(3, Sampling(1.0), torch.Generator().manual_seed(1)).tokens)
        return out

    _same_natively_as_from_python(run, monkeypatch)
    assert calls == [8, 5, 5, 9, 0, 4], calls  # block rows of each call (0: a catch-up alone), all from Python after


@needs_build
@pytest.mark.parametrize("head_dim", [32, 64])
def test_ragged_batches_attend_in_one_pass_as_sequence_by_sequence(head_dim, tmp_path, monkeypatch):
    """A ragged batch's attention step in bf16 with heads of 32 or 64 (the sizes `native.cpp`'s attention takes:
    the zoo's is 64), where the native layers attend every sequence in one pass (`mix_rows`): logits, features and
    caches of four sequences (a chain, one row, a tree's rows under its mask, one row) bitwise what Python's layers
    give, attending sequence by sequence; and an EAGLE-3 batch's drafter layer (its backlogs' last rows as queries)
    the same tokens."""
    from speclab.drafters.eagle3 import random_eagle3

    target = Target.load(build_tiny("qwen3", tmp_path / "t", seed=3, hidden=4 * head_dim, layers=4), dtype="bf16")
    assert target.lean is not None and target.lean.head_dim == head_dim
    drafter = random_eagle3(target, seed=0)
    prompts = [torch.tensor(target.tokenizer(p)["input_ids"]) for p in PROMPTS[:4]]

    def run():
        out, caches = _ragged_forward(target, prompts)
        out += [c.k[:, :, : c.length] for c in caches] + [c.v[:, :, : c.length] for c in caches]
        return out + [d.new_ids for d in _eagle3_batch(target, drafter, prompts, 12)]

    _same_natively_as_from_python(run, monkeypatch)


@needs_build
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_batched_eagle3_decodes_natively_as_from_python(dtype, deep, trained_eagle3, monkeypatch):
    """Three requests decoded together with EAGLE-3 (its backlogs in one call, its chains one call per depth for
    all requests): the same tokens and the same accepted drafts natively as from Python."""
    target = Target.load(deep.name, dtype=dtype)
    model = copy.deepcopy(trained_eagle3).to(target.dtype)
    prompts = [torch.tensor(target.tokenizer(p)["input_ids"]) for p in PROMPTS[:3]]

    def run():
        return [(d.new_ids.tolist(), d.accepted) for d in _eagle3_batch(target, model, prompts, 24)]

    fast = run()
    _python(monkeypatch)
    assert run() == fast
    assert sum(a for _, a in fast) > 0  # drafts were accepted: the drafter's outputs mattered


needs_product = pytest.mark.skipif(native.product_module() is None,
                                   reason="no native product in this process (no build, or a CPU with neither AMX "
                                          "nor AVX512-BF16)")


def _native_op():
    """This process's native product: its operator's name and the operator (`speclab::tile_linear` on AMX,
    `speclab::dp_linear` on AVX512-BF16)."""
    from speclab.core import layers

    name = {"tiles": "tile_linear", "dp": "dp_linear"}[native.product()]
    assert name in layers._NATIVE_OPS.values()
    return f"speclab::{name}", getattr(torch.ops.speclab, name)


@needs_build
@needs_product
def test_the_native_product_is_f_linears_bits_and_each_rows_alone():
    """This process's native product (the AMX tiles' `speclab::tile_linear` or AVX512-BF16's `speclab::dp_linear`)
    by its packed weight: bit for bit F.linear at every row count up to `layers.TILE_ROWS`, with and without a bias,
    at widths and output counts that are and are not multiples of its blocks (32 inputs and 64 outputs for the
    tiles; 64 outputs and oneDNN's blocks of 512 or 1024 inputs for the dot product: 512, 1024, 1536 and 2048
    inputs), in 2-D and 3-D; for the dot product also on SwiGLU-like inputs (whose sums tell summation orders apart
    more often) and at 40 rows. A row alone is the same bits as among the others on the tiles; on the dot product it
    is F.linear's row alone (F.linear sums a row alone in other blocks than many rows where K is above 1024, and so
    does the dot product). `layers.linear` of 40 rows (above TILE_ROWS: oneDNN's copy kept beside the native one) is
    F.linear's. The dot product's prefetch distance (`set_dp_ahead`) changes no bit. Bad operands are refused, not read
    out of bounds."""
    from speclab.core import layers

    mod = native.product_module()
    name, op = _native_op()
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        dp = native.product() == "dp"  # the tiles' cases are session 32's (checked on the Intel Xeon); the dot
        # product's add oneDNN's input blocks (2048 inputs), SwiGLU-like inputs and 40 rows against F.linear
        shapes = ((512, 1024), (1536, 512), (1024, 320), (80, 96), (33, 7), (5, 3), (64, 130)) + ((2048, 256),) * dp
        for k, n in shapes:
            w = torch.randn(n, k, generator=g).bfloat16()
            packed = mod.native_pack(w)
            cases = ((None, False), (torch.randn(n, generator=g).bfloat16(), False), (None, True))
            for bias, swiglu in cases[: 2 + dp]:
                x = torch.randn(layers.TILE_ROWS + 8, k, generator=g) * 3
                if swiglu:  # silu(gate) * up: many small values beside a few large ones
                    x = F.silu(x) * torch.randn(x.shape, generator=g)
                x = x.bfloat16()
                many = op(x, packed, bias, n, k)  # 40 rows: the op takes any count
                if dp:  # oneDNN's AMX product of over 32 rows sums in another order than the tiles
                    assert torch.equal(many, F.linear(x, w, bias))
                for rows in range(1, layers.TILE_ROWS + 1):
                    got = op(x[:rows], packed, bias, n, k)
                    assert torch.equal(got, F.linear(x[:rows], w, bias)), (k, n, rows)
                    if rows > 1 or not dp:
                        assert torch.equal(got, many[:rows])
                for r in range(0, 40, 3) if dp else (0, 17, 39):  # a row alone: as F.linear sums it alone (dp); as
                    alone = op(x[r : r + 1], packed, bias, n, k)  # among the others (the tiles)
                    assert torch.equal(alone, F.linear(x[r : r + 1], w, bias) if dp else many[r : r + 1]), (k, r)
                assert torch.equal(op(x[None, :5], packed, bias, n, k), many[None, :5])
                w2 = w.clone()
                assert torch.equal(layers.linear(x, w2, bias), F.linear(x, w2, bias))  # 40 rows
                assert layers.is_native(w2._speclab_packed[1])
        if dp:  # how far ahead the dot product prefetches its weight moves lines only: the same bits at any distance
            want = op(x[:5], packed, None, n, k)
            before = mod.set_dp_ahead(0)
            try:
                for ahead in (0, 64, before // 2, 1 << 20):
                    mod.set_dp_ahead(ahead)
                    assert torch.equal(op(x[:5], packed, None, n, k), want), ahead
            finally:
                mod.set_dp_ahead(before)
        for bad in ((x.float(), packed, None, n, k), (x[:, :-1], packed, None, n, k), (x, packed, None, n + 64, k),
                    (x, packed, None, n, k + 32), (x, w, None, n, k), (x, packed, torch.zeros(n + 1).bfloat16(), n, k)):
            with pytest.raises(RuntimeError, match=name):
                op(*bad)


@needs_build
@needs_product
def test_the_native_product_is_an_operator_the_byte_count_and_profiler_see():
    """A decode step's and a verification's forward of the lean target dispatch the native product's operator for
    their products (none of oneDNN's), and `speclab costs roofline` counts the bytes it reads: every weight once. A
    call of more rows than it takes (a big tree, a batch, a prefill) takes oneDNN's copy kept beside it."""
    from speclab.bench.roofline import call_bytes

    name, _ = _native_op()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3", 300, layers=2)).eval().to(torch.bfloat16)
    lean = Target(model, NoTok(), backend="lean").lean
    ids = torch.randint(3, 300, (48,))
    embed = model.get_input_embeddings().weight  # a lookup, unless it is the head's weight too
    weights = sum(p.numel() * p.element_size() for p in model.parameters()
                  if p.dim() == 2 and (p is not embed or model.config.tie_word_embeddings))
    with torch.inference_mode():
        cache = lean.new_cache(64)
        lean.forward(ids[:40], cache)
        for n in (1, 8):
            with torch.profiler.profile() as prof:
                lean.forward(ids[40 : 40 + n], cache)
            cache.crop(40)
            names = {e.key for e in prof.key_averages()}
            assert name in names and "mkldnn::_linear_pointwise" not in names
            nbytes = call_bytes(lambda n=n: (lean.forward(ids[40 : 40 + n], cache), cache.crop(40)))
            assert weights <= nbytes <= weights * 1.25, (n, weights, nbytes)
        with torch.profiler.profile() as prof:
            lean.forward(ids[:40], lean.new_cache(64))  # 40 rows
        names = {e.key for e in prof.key_averages()}
        assert "mkldnn::_linear_pointwise" in names and name not in names


@needs_build
def test_the_softmax_entropy_of_the_round_events_is_the_kernels_to_rounding():
    """`native.softmax_entropy` (the trace's logsumexp and entropy of each verification row, two passes a row in
    `native.cpp` where the CPU has AVX512F) equals `kernels.reference.softmax_entropy` up to fp32 rounding: rows of
    the zoo's vocabulary and of widths that are not multiples of its 16 lanes, large logits, a flat row (entropy
    log V) and a near one-hot one (entropy near 0); outside inference it is the kernels' op itself."""
    from kernels import reference

    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for v in (8192, 100, 17, 1):
            for rows in (1, 9, 37):
                x = torch.randn(rows, v, generator=g) * 6
                x[0] = 0.0  # flat
                if rows > 1 and v > 1:
                    x[1, 0] = 60.0  # near one-hot
                if rows > 2:
                    x[2] += 1e4  # large logits
                lse, ent = native.softmax_entropy(x)
                ref_lse, ref_ent = reference.softmax_entropy(x)
                assert lse.dtype == ent.dtype == torch.float32 and lse.shape == ent.shape == (rows,)
                torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=1e-5)
                torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
                assert abs(ent[0].item() - math.log(v)) < 1e-5
        bf16 = (torch.randn(3, 300, generator=g) * 6).bfloat16()
        torch.testing.assert_close(native.softmax_entropy(bf16), reference.softmax_entropy(bf16), rtol=1e-5,
                                   atol=1e-5)
    x = torch.randn(2, 50, generator=g)
    assert all(torch.equal(a, b) for a, b in zip(native.softmax_entropy(x), reference.softmax_entropy(x)))


def test_a_traced_rounds_figures_in_one_call_are_the_ops_on_the_softmax_entropy():
    """`native.round_stats` (a traced round's node log-probabilities, entropies and the target token's
    log-probabilities, `engine.round_event`) equals the ops it replaces on `native.softmax_entropy`'s logsumexp, bit for
    bit: trees of 0-8 nodes over 1-9 rows, the zoo's vocabulary and odd widths; outside inference, or in another dtype
    than fp32, it leaves them to the ops (None)."""
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for trial in range(60):
            rows, v = 1 + trial % 9, (8192, 300, 17)[trial % 3]
            x = torch.randn(rows, v, generator=g) * (1 + trial % 4)
            at = torch.randint(0, rows, (trial % rows,), generator=g)
            tokens, bonus = torch.randint(0, v, (at.numel(),), generator=g), int(torch.randint(0, v, (1,), generator=g))
            lse, ent = native.softmax_entropy(x)
            want = (x[at, tokens] - lse[at], ent, x[:, bonus] - lse)
            got = native.round_stats(x, at, tokens, bonus)
            assert got is not None and all(torch.equal(a, b) for a, b in zip(got, want))
        assert native.round_stats(x.bfloat16(), at, tokens, bonus) is None
    assert native.round_stats(x, at, tokens, bonus) is None


def test_the_native_layers_weights_are_made_again_after_a_change_in_place():
    """`native.decoder_weights` keeps a layer's weights (and their packed copies) between calls, checking only the
    tensors' versions; a weight changed in place (a training step) makes them again, with the new values."""
    from speclab.core.layers import DecoderLayer

    layer = DecoderLayer(64, 128, 4, 2, 16, 1e-6).to(torch.bfloat16)
    first = native.decoder_weights(layer)
    assert native.decoder_weights(layer) is first
    with torch.no_grad():
        layer.mlp.down_proj.weight.mul_(2)
    second = native.decoder_weights(layer)
    assert second is not first and any(t is layer.mlp.down_proj.weight for t in second)
    assert native.decoder_weights(layer) is second


@needs_build
def test_the_native_draws_and_chain_tests_are_the_aten_ops_bits(monkeypatch):
    """`native.draw_rows` (`sampling.sample` and `draw_one` on the CPU) and `native.chain_accept` (a sampled chain's
    tests in `verify`) give the tokens, q(x), spread rows and accept lengths of the ATen ops they replace, bit for
    bit: vocabularies of the zoo's sizes and tiny ones, rows with zero-mass tokens, uniforms at 0, just below 1 and
    exactly at a prefix of the CDF (where `searchsorted(right=True)` and a wrong comparison part), drafts a point mass
    (q(x) = 1), and a residual row alone equal to the same row of the whole matrix's (the verifier takes one row)."""
    from kernels import reference
    from speclab.core import sampling

    g = torch.Generator().manual_seed(0)
    for trial in range(64):
        V, R = (3, 100, 4096, 8192)[trial % 4], 1 + trial % 5
        logits = torch.randn(R, V, generator=g) * (1 + trial % 7)
        if trial % 3 == 0:
            logits[:, ::3] = float("-inf")  # zero-mass tokens
        q = torch.softmax(logits, -1)
        cdf = q.cumsum(-1)
        u = torch.rand(R, 1, generator=g)
        u[0] = (0.0, 1 - 2 ** -24, float(cdf[0, trial % V] / cdf[0, -1]))[trial % 3]  # the edges, a prefix exactly
        want = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=V - 1).squeeze(-1)
        idx, qx, none = native.draw_rows(q, u)
        assert torch.equal(idx, want) and torch.equal(qx, q.gather(-1, want[:, None])[:, 0]) and none is None
        to_target = torch.randperm(2 * V, generator=g)[:V]
        tok, qx2, spread = native.draw_rows(q, u, to_target, 2 * V)
        assert torch.equal(tok, to_target[want]) and torch.equal(qx2, qx)
        assert torch.equal(spread, sampling.spread(q, to_target, 2 * V))
        p = torch.softmax(torch.randn(R + 1, V, generator=g), -1)
        x = torch.randint(0, V, (R,), generator=g)
        for qq in (q, torch.nn.functional.one_hot(x, V).float()):
            uu = torch.rand(R + 1, generator=g)
            accept, resid = reference.sampling_accept(p[:R], qq, x, uu[:R])
            assert native.chain_accept(p, qq, x, uu) == int(accept.long().cumprod(0).sum())
            assert all(torch.equal(resid[a], reference.residual(p[a], qq[a])) for a in range(R))
    q = torch.softmax(torch.randn(2, 50, generator=g), -1)
    rows = (q[0], q, q[:, None].expand(-1, 3, -1))  # `sample` takes it for one row, a batch, i.i.d. siblings (3-D)
    with torch.inference_mode():
        fast = [sampling.sample(probs, torch.Generator().manual_seed(1)) for probs in rows]
        monkeypatch.setattr(sampling, "_native_rows", lambda probs: False)
        slow = [sampling.sample(probs, torch.Generator().manual_seed(1)) for probs in rows]
    assert all(torch.equal(a, b) and a.shape == probs.shape[:-1] for a, b, probs in zip(fast, slow, rows))


@needs_build
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_markov_heads_greedy_chains_natively_are_the_python_loops_bits(dtype, deep, monkeypatch):
    """DSpark's Markov head left to right at T = 0 (`DFlashDrafter._markov_chains`, `native.markov_chains`): the same
    picks and draft probabilities from C++ as from the Python loop, for one block and for ragged blocks of several
    drafters together, including rows whose logits tie (the first maximal index wins either way)."""
    from speclab.drafters.dflash import DFlashDrafter, random_dflash
    from speclab.drafters.registry import build_drafter

    target = Target.load(deep.name, dtype=dtype)
    model = random_dflash(target, 0, markov_rank=8)
    ds = [build_drafter("dflash", target, {"dflash": model}, block_size=5, markov=1) for _ in range(3)]
    g = torch.Generator().manual_seed(0)
    V = target.vocab_size
    cases = []
    for trial in range(12):
        n = [1 + (trial + j) % 6 for j in range(1 + trial % 3)]
        logits = [torch.randn(k, V, generator=g) * 4 for k in n]
        if trial % 4 == 0:
            logits[0][:, : V // 2] = 7.0  # ties: equal logits across half the vocabulary
        roots = torch.randint(0, V, (len(n),), generator=g)
        cases.append((logits, roots))

    def run():
        out = []
        with torch.inference_mode():
            for logits, roots in cases:
                for d, r in zip(ds, roots):
                    d.root = r.view(1)
                for tree in DFlashDrafter._markov_chains(ds[: len(logits)], logits):
                    out += [tree.tokens, tree.draft_probs]
        return out

    _same_natively_as_from_python(run, monkeypatch)


@needs_build
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_dflash_blocks_sampled_natively_are_the_python_loops_draws(dtype, deep, monkeypatch):
    """A DFlash block drawn under sampling (`DFlashDrafter._left_to_right`): with the Markov head, the same tokens, q(x)
    and q rows from C++ (`native.markov_draws`) as from the Python loop, and the generator left in the same state;
    without it, the block drawn at once equals drawing its rows one by one (the uniforms in the same order). At T = 1,
    at T = 0.7 with top-p 0.9, at T = 1 with top-k 20, and at a draft temperature of 0.8."""
    from speclab.core.sampling import Sampling, chain_dists, draw_one
    from speclab.drafters.dflash import random_dflash
    from speclab.drafters.registry import build_drafter

    target = Target.load(deep.name, dtype=dtype)
    model = random_dflash(target, 0, markov_rank=8)
    g = torch.Generator().manual_seed(0)
    V = target.vocab_size
    blocks = [(torch.randn(1 + i % 5, V, generator=g) * 3, torch.randint(0, V, (1,), generator=g)) for i in range(6)]
    settings = [(Sampling(1.0), 1.0), (Sampling(0.7, top_p=0.9), 1.0), (Sampling(1.0, top_k=20), 0.8)]

    def run(markov):
        out = []
        with torch.inference_mode():
            for sampling, draft_temp in settings:
                d = build_drafter("dflash", target, {"dflash": model}, block_size=5, markov=markov,
                                  draft_temp=draft_temp)
                gen = torch.Generator().manual_seed(5)
                for logits, root in blocks:
                    d.root = root
                    tree = d._left_to_right(logits, sampling, gen)
                    out += [tree.tokens, tree.draft_probs, tree.draft_dists]
                out.append(torch.rand(3, generator=gen))  # the generator's state after
        return out

    _same_natively_as_from_python(lambda: run(1), monkeypatch)
    rows = []
    with torch.inference_mode():
        for sampling, draft_temp in settings:
            gen = torch.Generator().manual_seed(5)
            for logits, _ in blocks:
                drawn = [draw_one(logits[k : k + 1], sampling, draft_temp, gen) for k in range(logits.shape[0])]
                rows += [torch.cat([t for t, _, _ in drawn]), torch.cat([x for _, x, _ in drawn]),
                         chain_dists([q for _, _, q in drawn])]
            rows.append(torch.rand(3, generator=gen))
    assert all(torch.equal(a, b) for a, b in zip(run(0), rows))


@needs_build
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_eagle3s_chain_and_catch_up_natively_are_the_python_loops_bits(dtype, deep, monkeypatch):
    """EAGLE-3's catch-up of 1-5 tokens (`native.eagle3_prefill`) and its chain of 1-4 tokens after it
    (`native.eagle3_chain`), greedy and sampled (T = 1, T = 0.7 with top-p 0.9, T = 1 with top-k 20, a draft
    temperature of 0.8): the same tokens, q(x), q rows, root rows and cache contents from C++ as from the Python
    loop, and the generator left in the same state (the uniforms drawn in the same order)."""
    from speclab.core.sampling import Sampling
    from speclab.drafters.eagle3 import random_eagle3
    from speclab.drafters.registry import build_drafter

    target = Target.load(deep.name, dtype=dtype)
    model = random_eagle3(target, 0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, target.vocab_size, (60,), generator=g)
    with torch.inference_mode():
        feats = target.forward(ids, target.new_cache(), layers=model.config.target_layers).features
    settings = [(Sampling(), 1.0), (Sampling(1.0), 1.0), (Sampling(0.7, top_p=0.9), 1.0),
                (Sampling(1.0, top_k=20), 0.8)]

    def run():
        out = []
        with torch.inference_mode():
            for sampling, draft_temp in settings:
                d = build_drafter("eagle3", target, {"eagle3": model}, depth=4, draft_temp=draft_temp)
                d.reset(ids[:20], feats[:19], capacity=60)
                gen, at = torch.Generator().manual_seed(5), 20
                for i in range(8):
                    m = 1 + i % 5
                    d.catch_up(ids[at : at + m], feats[at - 1 : at + m - 1])
                    at += m
                    out += [d.root_h, d.root_logits]
                    tree = d._chain(1 + i % 4, None if sampling.greedy else sampling, gen)
                    out += [tree.tokens, tree.draft_probs, d.cache.k[:, :, : d.cache.length].clone(),
                            torch.tensor(d.cache.length)]
                    out += [tree.draft_dists] if tree.draft_dists is not None else []
                    d.commit(tree, torch.empty(0, dtype=torch.long))
                out.append(torch.rand(3, generator=gen))
        return out

    _same_natively_as_from_python(run, monkeypatch)


@needs_build
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_draft_models_chain_natively_is_the_python_loops_bits(dtype, deep, monkeypatch):
    """The standalone draft's chain of 1-4 tokens (`native.draft_chain`) after catch-ups of 1-5 tokens, greedy and
    sampled (T = 1, T = 0.7 with top-p 0.9, T = 1 with top-k 20, a draft temperature of 0.8): the same tokens, draft
    probabilities, q rows and cache contents from one native call as from the Python loop (its forwards native
    too), partly accepted rounds kept alike, and the generator left in the same state (the same uniforms in the same
    order)."""
    from speclab.core.sampling import Sampling
    from speclab.drafters import sps
    from speclab.drafters.registry import build_drafter

    target = Target.load(deep.name, dtype=dtype)
    model = sps.random_draft(target, 0)
    ids = torch.randint(3, target.vocab_size, (60,), generator=torch.Generator().manual_seed(0))
    settings = [(Sampling(), 1.0), (Sampling(1.0), 1.0), (Sampling(0.7, top_p=0.9), 1.0),
                (Sampling(1.0, top_k=20), 0.8)]
    native_calls = []

    def run():
        out = []
        with torch.inference_mode():
            for sampling, draft_temp in settings:
                d = build_drafter("sps", target, {"draft": model}, k=4, draft_temp=draft_temp)
                d.reset(ids[:20], capacity=60)
                gen, at = torch.Generator().manual_seed(5), 20
                for i in range(8):
                    m = 1 + i % 5
                    d.catch_up(ids[at : at + m])
                    at += m
                    tree = d.propose(1 + i % 4, sampling, gen)
                    native_calls.append(d._native_ok(d.root_logits))
                    out += [d.root_logits, tree.tokens, tree.draft_probs, torch.tensor(d.cache.length),
                            d.cache.k[:, :, : d.cache.length].clone()]
                    out += [tree.draft_dists] if tree.draft_dists is not None else []
                    d.commit(tree, torch.arange(min(i % 3, len(tree))))
                out.append(torch.rand(3, generator=gen))
        return out

    fast = run()
    assert all(native_calls)
    monkeypatch.setattr(sps.StandaloneDraft, "_native_ok", lambda self, logits: False)
    slow = run()
    assert len(fast) == len(slow) and all(torch.equal(a, b) for a, b in zip(fast, slow))


@needs_build
def test_a_greedy_chains_verdict_natively_is_the_argmax_verdict():
    """`native.greedy_chain` against `verify_tokens` of the rows' `argmax` (max(-1)'s first maximal index): chains of
    0-6 tokens matching for a while, rows with ties, a NaN, -0.0 beside 0.0 and every element -inf."""
    from speclab.core.sampling import argmax
    from speclab.core.tree import DraftTree
    from speclab.core.verify import verify_tokens

    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        n, V = trial % 7, (8192, 37, 16)[trial % 3]
        logits = torch.randn(n + 1, V, generator=g).round(decimals=trial % 2)  # rounded: many ties
        if trial % 11 == 0:
            logits[trial % (n + 1), (trial * 7) % V] = float("nan")
        if trial % 13 == 0:
            logits[0] = float("-inf")
        if trial % 17 == 0:
            logits[0, :2], logits[0, 2:] = torch.tensor([-0.0, 0.0]), -1.0
        top = argmax(logits)
        m = int(torch.randint(0, n + 1, (1,), generator=g))
        tokens = torch.cat([top[:m], (top[m:n] + 1) % V])  # the first m match
        want = verify_tokens(DraftTree.chain(tokens, torch.ones(n)), top)
        with torch.inference_mode():
            got = native.greedy_chain(logits, tokens)
        assert got == (want.accepted.numel(), want.bonus), trial


@needs_build
def test_block_verification_natively_is_the_python_functions_bits(monkeypatch):
    """`native.block_verify` (a sampled chain's block verification from the target's logits in one call) against
    `verify`'s Python functions on random chains of 0-6 nodes over vocabularies of 16, 300 and 8,192 (none: the
    target's own draw, an AR step's): drafts sampled
    and point masses, a q equal to p (no residual mass left), peaked logits, T = 1, 0.7 with top-p 0.9, 1 with top-k
    20 and 0.5; the same kept nodes, the same target token, the same distributions and the generator in the same
    state."""
    from speclab.core import verify as V
    from speclab.core.sampling import Sampling
    from speclab.core.tree import DraftTree

    g = torch.Generator().manual_seed(0)
    settings = [Sampling(1.0), Sampling(0.7, top_p=0.9), Sampling(1.0, top_k=20), Sampling(0.5)]
    cases = []
    for case in range(240):
        n, vocab, s = case % 7, (16, 300, 8192)[case % 3], settings[case % 4]
        logits = torch.randn(n + 1, vocab, generator=g) * (1 + case % 5)
        if case % 7 == 0:
            logits[:, :3] += 8
        q = torch.softmax(logits[:n] / s.temperature if case % 11 == 0 and n else torch.randn(n, vocab, generator=g),
                          -1)
        x = torch.multinomial(q, 1, generator=g)[:, 0]
        dists = None if case % 5 == 0 else torch.cat([q, torch.zeros(1, vocab)])
        cases.append((DraftTree.chain(x, q[torch.arange(n), x], dists), logits, s))

    def run():
        out = []
        with torch.inference_mode():
            for i, (tree, logits, s) in enumerate(cases):
                gen = torch.Generator().manual_seed(i)
                v = V.verify(tree, logits, s, gen)
                out += [v.accepted, torch.tensor(v.bonus), v.probs, torch.rand(2, generator=gen)]
        return out

    with torch.inference_mode():
        assert all(V.native_block(tree, logits) for tree, logits, _ in cases)
    _same_natively_as_from_python(run, monkeypatch)


@needs_build
@pytest.mark.skipif(native.attention_module() is None, reason="no native attention in this process (no AVX512-BF16)")
@pytest.mark.parametrize("tiles", [True, False])
def test_the_native_attention_is_as_close_as_the_fused_kernel_and_each_rows_alone(tiles):
    """`speclab::attention` (`layers.attend` on a CPU outside autograd), its dot products on AMX tiles (`tiles`,
    where the CPU has them) or in AVX512-BF16: for bf16 calls of 1 to 32 query rows over a cache's strided keys, with
    grouped-query heads, no mask, a causal additive mask and a bool tree mask, every output is within one bf16
    rounding of the exact (fp64) attention, as close as torch's fused kernel is; each row is the same bits alone as
    among the others (bool and additive masks alike; on the tiles a few queries read the keys where they lie, more
    read them transposed: the same sums). fp32, 4-D batches and more than 32 rows are the fused kernel's own bits."""
    if tiles and native.product() != "tiles":
        pytest.skip("no AMX tiles in this process")
    native.build().set_attn_tiles(tiles)
    try:
        _attention_checks()
    finally:
        native.build().set_attn_tiles(True)


def _attention_checks():
    from speclab.core import layers

    def exact(q, k, v, mask):
        m = None if mask is None else (mask if mask.dtype is torch.bool else mask.double())
        return F.scaled_dot_product_attention(q[None].double(), k[None].double(), v[None].double(), attn_mask=m,
                                              scale=0.125, enable_gqa=q.shape[0] != k.shape[0])[0]

    def fused(q, k, v, mask):
        return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=0.125,
                                              enable_gqa=q.shape[0] != k.shape[0])[0]

    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for heads, kv, d in ((8, 4, 64), (4, 4, 32), (6, 2, 128)):
            cache = torch.randn(2, kv, 300, d, generator=g).bfloat16()
            for s, n in ((1, 1), (37, 1), (250, 1), (250, 5), (40, 32), (17, 9)):
                q = torch.randn(heads, n, d, generator=g).bfloat16()
                k, v = cache[0, :, :s], cache[1, :, :s]  # views into a longer cache, as a decode reads it
                see = torch.rand(n, s, generator=g) < 0.7
                see[:, 0] = True
                for mask in (None, layers.causal_mask(n, s, dtype=torch.bfloat16), see):
                    got = torch.ops.speclab.attention(q, k, v, mask, 0.125)
                    ref, ours_err = exact(q, k, v, mask), None
                    ulp = ref.abs().clamp(min=1e-3) * 2**-7  # one bf16 rounding
                    ours_err = (got.double() - ref).abs()
                    assert (ours_err <= ulp).all(), (heads, s, n, ours_err.max())
                    assert ours_err.mean() <= (fused(q, k, v, mask).double() - ref).abs().mean() * 1.1
                    for i in (0, n - 1):  # a row alone
                        alone = torch.ops.speclab.attention(q[:, i : i + 1], k, v,
                                                            None if mask is None else mask[i : i + 1], 0.125)
                        assert torch.equal(alone[:, 0], got[:, i])
                    assert torch.equal(layers.attend(q, k, v, mask, 0.125), got)
                if n > 1:
                    add = torch.zeros(n, s).masked_fill_(~see, float("-inf")).bfloat16()
                    assert torch.equal(torch.ops.speclab.attention(q, k, v, add, 0.125),
                                       torch.ops.speclab.attention(q, k, v, see, 0.125))
        # a key's score is the same bits whether it is summed among 16 keys or alone (AVX: `reduce16`, the pairs of
        # `_mm512_reduce_add_ps` in its order; tiles: each element its own): keys 0 and 16 of 17, the 15 between
        # unseen, against those two alone
        for heads, kv, d in ((8, 4, 64), (6, 2, 128), (4, 4, 32)):
            for _ in range(20):
                q = torch.randn(heads, 3, d, generator=g).bfloat16()
                k, v = (torch.randn(2, kv, 17, d, generator=g) * 3).bfloat16()
                see = torch.zeros(3, 17, dtype=torch.bool)
                see[:, [0, 16]] = True
                two = torch.ops.speclab.attention(q, k[:, [0, 16]], v[:, [0, 16]], None, 0.125)
                assert torch.equal(torch.ops.speclab.attention(q, k, v, see, 0.125), two)
        q, k = torch.randn(8, 40, 64, generator=g), torch.randn(4, 60, 64, generator=g)
        for args in ((q, k, k), (q.bfloat16(), k.bfloat16(), k.bfloat16())):  # fp32; 40 rows
            assert torch.equal(torch.ops.speclab.attention(*args, None, 0.125), fused(*args, None))
        q4, k4 = q[None, :, :3].bfloat16(), k[None].bfloat16()  # a 4-D batch
        assert torch.equal(torch.ops.speclab.attention(q4, k4, k4, None, 0.125),
                           F.scaled_dot_product_attention(q4, k4, k4, scale=0.125, enable_gqa=True))


def _vnni() -> bool:
    from speclab.models import int8_drafters
    return int8_drafters("int8", "cpu")


needs_vnni = pytest.mark.skipif(not _vnni(), reason="no AVX512-VNNI here (the int8 product)")


@needs_build
@needs_vnni
def test_int8_drafter_weights_hold_their_values_exactly_and_multiply_within_a_percent():
    """`layers.quantize_int8`: the bf16 weight becomes exactly its int8 values times a power-of-two scale per output,
    and `layers.linear` multiplies 1 to `INT8_ROWS` rows by them (`speclab::i8_linear`, each row quantized to 8 bits
    at its own scale) within 2% of the fp32 product by that weight, each row's result the same alone or among
    others, with a bias; more rows are F.linear's by the weight itself, bit for bit."""
    from speclab.core import layers as L

    gen = torch.Generator().manual_seed(0)
    for n, k, bias in ((1000, 520, False), (70, 130, True), (64, 4, False), (513, 1537, True)):
        w = torch.randn(n, k, generator=gen).bfloat16()
        b = torch.randn(n, generator=gen).bfloat16() if bias else None
        before = w.clone()
        L.quantize_int8(w)
        _, packed, meta = w._speclab_int8
        scale = meta[0]
        q = w.float() / scale[:, None]
        assert torch.equal(q, q.round()) and q.abs().max() <= 127
        assert torch.equal(torch.log2(scale), torch.log2(scale).round())  # powers of two
        assert float((w.float() - before.float()).norm() / before.float().norm()) < 0.02
        with torch.inference_mode():
            for m in range(1, L.INT8_ROWS + 1):
                x = torch.randn(m, k, generator=gen).bfloat16()
                y = L.linear(x, w, b).float()
                ref = F.linear(x.float(), w.float(), None if b is None else b.float())
                assert float((y - ref).norm() / ref.norm()) < 0.02, (n, k, m)
                alone = torch.cat([L.linear(x[i : i + 1], w, b) for i in range(m)]).float()
                assert torch.equal(y, alone)
            x = torch.randn(L.INT8_ROWS + 1, k, generator=gen).bfloat16()
            assert torch.equal(L.linear(x, w, b), F.linear(x, w, b))


@needs_build
@needs_vnni
@pytest.mark.parametrize("name", ["eagle3", "dflash", "sps"])
def test_int8_drafters_decode_greedy_as_ar_and_leave_the_target_alone(name, deep):
    """A drafter made int8 by `--drafter-weights int8` (`speclab.models.quantize_drafter`): the target's tensors keep
    every bit (DFlash shares the target's head: it stays bf16), the drafter's products read int8, and a greedy
    decode with it equals AR's token for token (bf16, exact mode: the target's rows do not depend on their batch)."""
    from speclab.models import _tensors_of, quantize_drafter

    target = Target.load(deep.name, dtype="bf16", exact=True)
    entry = drafters()[name]
    model = entry.model.random(target, 0)
    kept = [t.clone() for t in _tensors_of(target)]
    assert quantize_drafter(model, target, "int8")
    assert not quantize_drafter(entry.model.random(target, 0), target, "bf16")
    assert all(torch.equal(a, b) for a, b in zip(kept, _tensors_of(target)))
    ar = generate(target, PROMPTS[0], "ar", max_new_tokens=32)
    nodes = []
    spec = generate(target, PROMPTS[0], name, models={entry.model.role: model}, max_new_tokens=32,
                    on_round=lambda ev: nodes.append(len(ev.tree)))
    assert spec.token_ids == ar.token_ids
    assert sum(nodes) > len(nodes)  # it drafted


def test_drafter_weights_out_of_range_are_one_line_before_any_load():
    from speclab.errors import InvalidInput
    from speclab.models import ModelPaths

    with pytest.raises(InvalidInput, match="drafter weights 'int4': choose auto, int8, bf16"):
        ModelPaths(drafter_weights="int4").check()
