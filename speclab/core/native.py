"""The decoder layers' loop in C++ (`native.cpp`), for decode steps on a CPU.

A decode step of the zoo target calls about 300 ATen ops from Python, and on a 2-core CPU each costs a few
microseconds of interpreter and dispatch besides its work: a third of the step (`speclab costs step`). `native.cpp`
runs the same ops, in the same order, from C++: every output is bitwise the Python path's (checked by the tests in
fp32 and bf16), so this is a faster way to call the model code of `speclab.core.layers`, not a second model.
Two of those ops are loops of its own, because ATen runs them as chains of small ops: RMSNorm (about fifteen ops
in ATen's composite; `rms` and `rms_norm` offer it to Python's norms too) and the rotary embedding (four). Each
reproduces ATen's arithmetic element by element and leaves the one reduction to ATen's sum, so it is bitwise
ATen's; `build` checks that once per process (`_fused_ops_agree`) and otherwise keeps ATen's ops.
A decode step's few bf16 rows of one sequence go further (`decode_layers` for the lean forward's layers,
`decode_layer_rows` for a drafter's `DecoderLayer`, where the CPU has AVX512-BF16): the views, copies, elementwise
ops and dispatch of each layer become loops over its rows, with each op's arithmetic per element, the products are
called directly, and only the norms' row sums and the SiLU stay ATen's, so the bits are those of the ops they stand
for (`tests/test_native.py`); `SPECLAB_FAST_LAYERS=0` turns them off (to compare).

It also holds the bf16 product of a decode's few rows on AMX (`tile_pack`, `speclab::tile_linear`) and, on CPUs
with AVX512-BF16 but no AMX, in its dot-product instructions (`dp_pack`, `speclab::dp_linear`), which
`layers.linear` uses through a packed copy of each weight where its products are F.linear's bits (`product_module`).

It is built once per machine and torch version with torch's C++ extension loader (a C++ compiler and ninja; about
40 s; `native.main()` builds it ahead, as `scripts/setup.sh` does) into torch's extensions folder, with OpenMP (so
its `at::parallel_for` loops run on torch's threads; without it they run on one).
Where it cannot be built, or with `SPECLAB_NATIVE=0` in the environment (to compare), everything runs from Python
as before. The layers' loop runs only outside autograd, on the CPU, and never in exact mode (whose fixed-shape
attention is Python's); the tile product wherever `layers.linear` multiplies bf16 on the CPU outside autograd.
"""
from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kernels import ops as kernel_ops
from speclab.core import layers as L

SOURCE = Path(__file__).with_name("native.cpp")
ENABLED = os.environ.get("SPECLAB_NATIVE", "1") != "0"
# the native products (`native.cpp`'s `tile_linear` on AMX, else `dp_linear` on AVX512-BF16) for the bf16 products of
# `layers.linear`, Python's and the native layers' alike; SPECLAB_TILES=0 in the environment (to compare): oneDNN's
TILES = os.environ.get("SPECLAB_TILES", "1") != "0"
# a decode step's layers without ATen's small ops (`native.cpp`'s `decode_layers` and `decode_layer_rows`, bitwise the
# ops they stand for); SPECLAB_FAST_LAYERS=0 in the environment (to compare): those ops, called from C++
FAST_LAYERS = os.environ.get("SPECLAB_FAST_LAYERS", "1") != "0"
_state: dict[str, Any] = {}


def build(verbose: bool = False) -> Any:
    """The compiled module (built on the first call in a process that finds no build; loaded after), or None where
    it cannot be built (the reason is printed once to stderr)."""
    if "module" in _state:
        return _state["module"]
    mod = None
    try:
        from torch.utils.cpp_extension import load

        bindir = str(Path(sys.executable).parent)  # ninja from the environment's own bin folder (the PyPI wheel)
        if bindir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
        mod = load("speclab_native", [str(SOURCE)], extra_cflags=["-O3", "-ffp-contract=off", "-fopenmp"],
                   extra_ldflags=["-fopenmp"], verbose=verbose)  # OpenMP: at::parallel_for on torch's threads
    except Exception as e:  # no compiler, no ninja, a failed build: the Python path, said once
        print(f"speclab: the native CPU layers are not available ({str(e).splitlines()[0] if str(e) else type(e)}"
              "); decoding runs from Python", file=sys.stderr)
    if mod is not None:
        mod.set_fused(_fused_ops_agree(mod))
        mod.set_row_limits(L.TILE_ROWS, L.CHECK_ROWS[-1])
        mod.set_int8_rows(L.INT8_ROWS)
        mod.set_fast_layers(FAST_LAYERS)
    _state["module"] = mod
    if mod is not None:
        attention_module()  # decided now: the native layers' attention (C++) reads it as Python's `layers.attend` does
    return mod


@contextmanager
def dispatched():
    """For the duration, every native product and attention through its operator (the fast layers off, `FAST_LAYERS`):
    what a dispatch mode sees (`speclab.bench.roofline.call_bytes` counts the bytes the ops read: the fast layers read
    the same bytes, by the same arithmetic)."""
    mod = build() if ENABLED else None
    if mod is None:
        yield
        return
    mod.set_fast_layers(False)
    try:
        yield
    finally:
        mod.set_fast_layers(FAST_LAYERS)


def product_module():
    """The compiled module where one of its bf16 products runs in this process (`layers.NATIVE_SOURCE`: its
    `native_pack` and the operator it packs for, `speclab::tile_linear` on AMX, else `speclab::dp_linear` on
    AVX512-BF16; `product()` names it), else None: `SPECLAB_NATIVE=0` or `SPECLAB_TILES=0`, no build, a CPU with
    neither, or AMX whose tile registers the kernel refuses and no AVX512-BF16. Fixed for the process once asked, so
    that every packed copy is of one kind (a test that turns `ENABLED` off later still multiplies alike)."""
    if "product" not in _state:
        mod = build() if ENABLED and TILES else None
        kind = mod.product_init() if mod is not None else ""
        _state["product"] = (mod, kind) if kind else (None, "")
    return _state["product"][0]


def product() -> str:
    """The native product `layers.linear` multiplies bf16 by in this process: "tiles", "dp" or "" (none)."""
    product_module()
    return _state["product"][1]


# `native.cpp`'s attention of a decode's few bf16 query rows (`speclab::attention`) for `layers.attend`, Python's and
# the native layers' alike; SPECLAB_ATTENTION=0 in the environment (to compare): torch's fused kernel
ATTENTION = os.environ.get("SPECLAB_ATTENTION", "1") != "0"


def attention_module():
    """The compiled module where its attention (`speclab::attention`: bf16 3-D calls of up to 32 query rows, the
    rest torch's fused kernel as before) runs in this process (`layers.ATTENTION_SOURCE`), else None:
    `SPECLAB_NATIVE=0` or `SPECLAB_ATTENTION=0`, no build, a CPU without AVX512-BF16. Fixed for the process once
    asked, like `product_module`, so that Python's layers and the native ones attend alike."""
    if "attention" not in _state:
        mod = build() if ENABLED and ATTENTION else None
        _state["attention"] = mod if mod is not None and mod.attn_init() else None
    return _state["attention"]


def tile_module():
    """`product_module()` where its product is the AMX tiles', else None."""
    return product_module() if product() == "tiles" else None


L.NATIVE_SOURCE = product_module
L.ATTENTION_SOURCE = attention_module


def softmax_entropy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.ops.softmax_entropy` (logsumexp and entropy of rows of logits [R, V], fp32): on the CPU where the
    native module runs and the CPU has AVX512F, `native.cpp`'s two passes a row (equal up to rounding, about 6x
    faster on the zoo's vocabulary: most of a traced round's record time), else the kernels' op."""
    if logits.dim() == 2 and active(logits) and _se_ready():
        lse, ent = build().softmax_entropy(logits)
        return lse, ent
    return kernel_ops.softmax_entropy(logits)


def _se_ready() -> bool:
    """Whether `native.cpp`'s softmax-entropy pass runs on this CPU (AVX512F), checked once."""
    if "se" not in _state:
        _state["se"] = bool(build().se_init())
    return _state["se"]


def round_stats(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, bonus: int):
    """A traced round's figures from its verification logits [R, V] in one call where `softmax_entropy` runs
    natively (else None): (each node's log-probability at its parent's row, every row's entropy, the target's token's
    log-probability at every row), the ops' subtractions of `softmax_entropy`'s logsumexp, in fp32."""
    if logits.dim() != 2 or logits.dtype is not torch.float32 or not active(logits) or not _se_ready():
        return None
    return tuple(build().round_stats(logits, rows, tokens, bonus))


def draw_rows(q: torch.Tensor, u: torch.Tensor, to_target: torch.Tensor | None = None, vocab: int = 0):
    """Tokens drawn from rows of probabilities q [R, V] (fp32) at uniforms u [R], by inverse CDF: bitwise
    `speclab.core.sampling.sample`'s, in one call (call where `active(q)`) -> (indices [R], mapped through `to_target`
    [V] where given; q at them [R]; q's rows spread over `vocab` target ids by `to_target`, None without it)."""
    idx, qx, spread = build().draw_rows(q, u, to_target, vocab)
    return idx, qx, spread if to_target is not None else None


def greedy_chain(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[int, int] | None:
    """A greedy chain's verdict from its verification logits [n + 1, V] in one call where `softmax_entropy` runs
    natively (fp32 rows; else None): (the accepted nodes a, the target's token), `verify.verify_tokens`' figures from
    the rows' first maximal indices (`sampling.argmax`), reading the rows up to the first mismatch only."""
    if logits.dim() != 2 or logits.dtype is not torch.float32 or not active(logits) or not _se_ready():
        return None
    return tuple(build().greedy_chain(logits, tokens))


def chain_accept(p: torch.Tensor, q: torch.Tensor, x: torch.Tensor, u: torch.Tensor) -> int:
    """How many nodes of a sampled chain pass speculative sampling's test before the first that does not: node i
    (token x[i] drawn from q [n, V]) passes when u[i] < min(1, p[i, x] / q[i, x]) (p [>= n, V]; all fp32): bitwise
    `kernels.ops.sampling_accept`'s tests, in one call (call where `active(p)`)."""
    return int(build().chain_accept(p, q, x, u))


def block_verify(logits: torch.Tensor, t: float, top_k: int, top_p: float, q: torch.Tensor | None, x: torch.Tensor,
                 u: torch.Tensor, ub: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """A sampled chain's block verification from the target's logits [n + 1, V] in one call (bitwise
    `verify._verify_sampled_chain`'s block rule with `sampling.logits_to_probs`; call where `active(logits)`): q [n,
    V] fp32 the drafts' distributions (None: point masses at x), u [n] the tests' uniforms, ub [1] the bonus draw's
    -> (the target's distributions p [n + 1, V], the nodes kept, the target's token after them)."""
    p, a, tok = build().block_verify(logits, t, top_k, top_p, q, x, u, ub)
    return p, int(a), int(tok)


def _fused_ops_agree(mod) -> bool:
    """Whether the module's one-pass RMSNorm and rotary embedding are bitwise this torch's ops on a few random
    inputs (they follow ATen's composite, which may change between torch versions; where they are not, the module
    runs ATen's ops instead)."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(3, 5, 64, generator=g) * 4).to(dtype)
        w = torch.randn(64, generator=g).to(dtype)
        cos, sin = torch.randn(3, 1, 64, generator=g).to(dtype), torch.randn(3, 1, 64, generator=g).to(dtype)
        same = [(mod.rms_norm(x, w, 1e-6), F.rms_norm(x, (64,), w, 1e-6)),
                (mod.rms_norm(x[:, :3], None, 1e-5), F.rms_norm(x[:, :3], (64,), None, 1e-5)),
                (mod.rope(x, cos, sin), L.apply_rope(x, cos, sin))]
        if not all(torch.equal(a, b) for a, b in same):
            return False
    return True


def active(x: torch.Tensor) -> bool:
    """Whether a forward on x runs natively: enabled, built, on the CPU, outside autograd."""
    if not ENABLED or x.device.type != "cpu" or torch.is_grad_enabled():
        return False
    return build() is not None


def mode() -> str:
    """How the model layers run in this process: "native" (built and enabled) or "python"; for the figures that
    depend on it (`--dtype auto`'s cache key, a bench's config)."""
    return "native" if ENABLED and build() is not None else "python"


def _eps(norm: torch.nn.RMSNorm, dtype: torch.dtype) -> float:
    """The eps an `nn.RMSNorm` applies to inputs of `dtype` (eps=None: the dtype's machine epsilon)."""
    return torch.finfo(dtype).eps if norm.eps is None else norm.eps


def rms(norm: torch.nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """`norm(x)`, in `native.cpp`'s one-pass RMSNorm where x runs natively (bitwise the module's output)."""
    return rms_norm(x, norm.weight, _eps(norm, x.dtype)) if active(x) else norm(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`F.rms_norm` over the last dim, in `native.cpp`'s one pass (bitwise; call where `active(x)`)."""
    return build().rms_norm(x, weight, eps)


def pair_norm(na: torch.nn.RMSNorm, a: torch.Tensor, nb: torch.nn.RMSNorm, b: torch.Tensor) -> torch.Tensor:
    """`torch.cat([na(a), nb(b)], -1)` in one call (bitwise; call where `active(a)`)."""
    return build().pair_norm(a, na.weight, _eps(na, a.dtype), b, nb.weight, _eps(nb, b.dtype))


def head_logp(norm: torch.nn.RMSNorm, head: torch.nn.Linear, h: torch.Tensor) -> torch.Tensor:
    """`torch.log_softmax(head(norm(h)).float(), -1)` (a bias-free `layers.Linear` head) in one call (bitwise; call
    where `active(h)`)."""
    w = head.weight
    return build().head_logp(h, norm.weight, _eps(norm, h.dtype), w, *_copies(w))


def markov_chains(w1: torch.nn.Embedding, w2: torch.nn.Linear, logits: list[torch.Tensor], roots: torch.Tensor):
    """DSpark's Markov head over draft blocks at T = 0, left to right, in one call (`DFlashDrafter._markov_chains`'
    ops, bitwise; call where `active(logits[0])`): each block's row k biased by W2 W1[the token before], its argmax
    the pick -> (each block's picks, their softmax probabilities)."""
    out = build().markov_chains(logits, roots, w1.weight, w2.weight, *_copies(w2.weight))
    return out[: len(logits)], out[len(logits):]


def markov_draws(w1: torch.nn.Embedding, w2: torch.nn.Linear, logits: torch.Tensor, root: torch.Tensor,
                 u: torch.Tensor, temperature: float, top_k: int, top_p: float):
    """DSpark's Markov head over one draft block at T > 0, left to right, in one call (the ops of
    `DFlashDrafter._left_to_right`, bitwise; call where `active(logits)`): row k biased by W2 W1[the token before], its
    token drawn from q_k (`sampling.logits_to_probs` at `temperature`, top_k, top_p) at the uniform u[k] -> (tokens
    [n], q(x) [n], q [n, V])."""
    return tuple(build().markov_draws(logits, root, w1.weight, w2.weight, *_copies(w2.weight), u, temperature, top_k,
                                      top_p))


def eagle3_prefill(layer: L.DecoderLayer, in_norm: torch.nn.RMSNorm, hid_norm: torch.nn.RMSNorm,
                   out_norm: torch.nn.RMSNorm, head: torch.nn.Linear, fc: torch.nn.Linear, embed: torch.Tensor,
                   ids: torch.Tensor, feats: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, start: int,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-3's KV-only catch-up of m tokens (`Eagle3Drafter._prefill`'s ops with a dense head, bitwise; call where
    `active(feats)`): their keys and values at `cache` slots start.., the last row alone through the rest of the layer
    and the head -> (its pre-norm output [1, H], its fp32 logits [1, Vd]). The cache's length is the caller's."""
    return tuple(build().eagle3_prefill(
        ids, embed, feats, fc.weight, *_copies(fc.weight), cos, sin, start, decoder_weights(layer), cache.k, cache.v,
        scale, *_eagle3_norms(layer, in_norm, hid_norm, out_norm, fc.weight.dtype), head.weight,
        *_copies(head.weight)))


def eagle3_chain(layer: L.DecoderLayer, in_norm: torch.nn.RMSNorm, hid_norm: torch.nn.RMSNorm,
                 out_norm: torch.nn.RMSNorm, head: torch.nn.Linear, embed: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, pos0: int, cache, start: int, scale: float, root_logits: torch.Tensor,
                 root_h: torch.Tensor, depth: int, to_target: torch.Tensor, vocab: int, t: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, u: torch.Tensor | None = None):
    """EAGLE-3's chain of `depth` tokens from its root row (`Eagle3Drafter._chain`'s ops with a dense head, bitwise;
    call where `active(root_h)`): the argmax at every depth (t = 0) or a token drawn from q at temperature t, top_k,
    top_p at uniform u[level - 1], and one `decoder_layer` + `head_logp` call after every token but the last, its
    keys and values at `cache` slots start.. -> (tokens [depth] in target ids, log q(x) [depth], q's rows [depth,
    vocab] or None greedy). The cache's length is the caller's to set."""
    w = head.weight
    tokens, logq, q = build().eagle3_chain(
        root_logits, root_h, depth, embed, cos, sin, pos0, decoder_weights(layer), cache.k, cache.v, start, scale,
        *_eagle3_norms(layer, in_norm, hid_norm, out_norm, root_h.dtype), w, *_copies(w), to_target, vocab, t, top_k,
        top_p, u if u is not None else _NO_UNIFORMS)
    return tokens, logq, q if t > 0 else None


_NO_UNIFORMS = torch.zeros(0)


def dflash_block(m, caches: list, known: list[int], feats: torch.Tensor | None, ctx: list[int], cn: list[int],
                 ids: torch.Tensor, ns: list[int], embed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 head: torch.Tensor, scale: float):
    """DFlash's draft forward for the drafters of one `DFlashModel` m (`DFlashDrafter.blocks_logits` with a dense
    head, bitwise; call where `active(embed)`): the backlogs feats [sum cn, F] of drafters ctx (indices into caches,
    cn rows each) into their caches at slots known[j].. (`_absorb`), then the blocks ids [sum ns] after each cache's
    context -> (the mask rows' final-norm states, their fp32 logits); no ids: the backlogs alone -> None. The caches
    reserved, their lengths set after by the caller."""
    c, a0, fc = m.config, m.layers[0].self_attn, m.fc
    dt = fc.weight.dtype
    out = build().dflash_block(
        feats if feats is not None else _NO_UNIFORMS, fc.weight, fc.bias, *_copies(fc.weight, fc.bias),
        m.hidden_norm.weight, _eps(m.hidden_norm, dt), ctx, cn, ids, embed, c.input_embedding_scale, cos, sin,
        [decoder_weights(L) for L in m.layers], [L.input_layernorm.weight for L in m.layers],
        [_eps(L.input_layernorm, dt) for L in m.layers],
        [_eps(L.self_attn.q_norm, dt) if L.self_attn.qk_norm else 0.0 for L in m.layers],
        [_eps(L.self_attn.k_norm, dt) if L.self_attn.qk_norm else 0.0 for L in m.layers],
        [_eps(L.post_attention_layernorm, dt) for L in m.layers], [x.k for x in caches], [x.v for x in caches],
        known, ns, scale, a0.heads, a0.kv_heads, a0.head_dim, m.norm.weight, _eps(m.norm, dt), head, *_copies(head),
        c.output_multiplier)
    return tuple(out) if out else None


def _eagle3_norms(layer: L.DecoderLayer, in_norm, hid_norm, out_norm, dtype) -> list:
    """What `native.cpp`'s EAGLE-3 calls read of its layer and norms after the layer's weights: (qk eps, post-norm
    eps, heads, kv heads, head dim, then each norm's weight and eps: input, hidden, output)."""
    a = layer.self_attn
    return [_eps(a.q_norm, dtype) if a.qk_norm else 0.0, _eps(layer.post_attention_layernorm, dtype), a.heads,
            a.kv_heads, a.head_dim, in_norm.weight, _eps(in_norm, dtype), hid_norm.weight, _eps(hid_norm, dtype),
            out_norm.weight, _eps(out_norm, dtype)]


def source_hash() -> str | None:
    """A short hash of `native.cpp` where the layers run from it (None: from Python), for the figures measured with
    it (`--dtype auto`'s cache key)."""
    if mode() != "native":
        return None
    import hashlib
    return hashlib.sha1(SOURCE.read_bytes()).hexdigest()[:12]


def _copies(w: torch.Tensor, b: torch.Tensor | None = None) -> list:
    """The weight's two packed bf16 copies as `layers.by_packed` takes them: [its packed copy, oneDNN's copy for
    calls above the native product's rows where the first is that product's] (None where `layers.linear` uses
    none)."""
    if L.PACKED and w.dtype is torch.bfloat16 and w.device.type == "cpu":
        packed = L._packed(w, b)  # a drafter's int8 weight (`layers.quantize_int8`): its int8 copy and its scales
        return [packed, L._wide(w, b) if packed is not None and (L.is_native(packed) or packed.dtype is torch.int8)
                else None]
    return [None, None]


def _cached(layer, base_of, make) -> list:
    """`make()`, kept on the layer while none of the tensors `base_of()` names changes in place (not as a module
    attribute: no state-dict entry). The tensors are looked up once and kept with it: a call checks their versions
    only (looking them up through the modules' attributes cost 13 us a call of EAGLE-3's layer, four a round)."""
    held = layer.__dict__.get("_native")
    if held is None or _versions(held[0]) != held[1]:
        base = tuple(base_of())
        held = layer.__dict__["_native"] = (base, _versions(base), make())
    return held[2]


def _versions(base: tuple) -> tuple:
    return tuple(-1 if w is None or w.is_inference() else w._version for w in base)


def fused_weights(layer: L.FusedLayer) -> list:
    """A `FusedLayer`'s weights as `native.cpp`'s `fused_layers` reads them."""
    return _cached(layer, lambda: (layer.in_norm, layer.qkv_w, layer.qkv_b, layer.qk_norm, layer.o, layer.o_bias,
                                   layer.post, layer.gate_up, layer.down), lambda: [
        layer.in_norm, layer.qkv_w, layer.qkv_b, *_copies(layer.qkv_w, layer.qkv_b), layer.qk_norm, layer.o,
        layer.o_bias, *_copies(layer.o, layer.o_bias), layer.post, layer.gate_up, *_copies(layer.gate_up),
        layer.down, *_copies(layer.down)])


def decoder_weights(layer: L.DecoderLayer) -> list:
    """A `DecoderLayer`'s weights as `native.cpp`'s `decoder_layer` reads them."""
    def parts():
        a, m = layer.self_attn, layer.mlp
        return a, m, (a.q_proj, a.k_proj, a.v_proj), (a.q_norm.weight, a.k_norm.weight) if a.qk_norm else (None, None)

    def base():
        a, m, lins, norms = parts()
        return (*[p for lin in (*lins, a.o_proj) for p in (lin.weight, lin.bias)], *norms,
                layer.post_attention_layernorm.weight, m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight)

    def make():
        a, m, lins, norms = parts()
        return [*[t for lin in lins for t in (lin.weight, lin.bias, *_copies(lin.weight, lin.bias))],
                *norms, a.o_proj.weight, a.o_proj.bias, *_copies(a.o_proj.weight, a.o_proj.bias),
                layer.post_attention_layernorm.weight,
                *[t for lin in (m.gate_proj, m.up_proj, m.down_proj) for t in (lin.weight, *_copies(lin.weight))]]
    return _cached(layer, base, make)


def fused_layers(layers: list[L.FusedLayer], h, cos, sin, caches: list, starts: list[int], ns: list[int],
                 masks: list, scale: float, keep=(), con=None):
    """`LeanDecoder._layers` over `KVCache`s (one sequence's: `_mix`; a ragged batch's: `lean.mix_many`; see
    `native.cpp`), `con`: one sequence's extra rows after its plain ones (`lean.ConRows`: ConFu's contemplate rows)
    -> (the last states of every row, {kept layer: its output, every row})."""
    f = layers[0]
    extra = (con.soft_k, con.soft_v, con.mask) if con is not None else (None, None, None)
    out = build().fused_layers(h, cos, sin, [fused_weights(x) for x in layers], [c.k for c in caches],
                               [c.v for c in caches], starts, ns, masks, scale, f.eps, f.H, f.KV, f.D, list(keep),
                               *extra)
    return out[0], dict(zip(sorted(keep), out[1:]))  # in layer order


def decoder_layer(layer: L.DecoderLayer, i: int, x, h, cos, sin, caches: list, starts: list[int], ns: list[int],
                  masks: list, scale: float, q_rows: torch.Tensor | None = None, nqs: list[int] | None = None):
    """A `DecoderLayer`, layer i of the `KVCache`s, after its input norm (x: the attention's input of every row;
    h: the residual of the query rows: `q_rows`, the last nqs[j] rows of sequence j; None: every row) for one
    sequence or a ragged batch (see `native.cpp`) -> the layer's output of the query rows."""
    a = layer.self_attn
    qk_eps = _eps(a.q_norm, x.dtype) if a.qk_norm else 0.0
    return build().decoder_layer(x, h, cos, sin, decoder_weights(layer), i, [c.k for c in caches],
                                 [c.v for c in caches], starts, ns, masks, scale, qk_eps,
                                 _eps(layer.post_attention_layernorm, x.dtype), a.heads, a.kv_heads, a.head_dim,
                                 q_rows, nqs or [])


def context_kv(layer: L.DecoderLayer, i: int, x, cos, sin, caches: list, starts: list[int], ns: list[int]) -> None:
    """A `DecoderLayer`'s keys and values of context rows x alone (`layers.Attention.kv`), written into layer i of
    the `KVCache`s at slots starts[j].. (ns[j] rows of sequence j, in order; see `native.cpp`): DFlash's KV injection
    in one call instead of about twenty-five ops a layer."""
    a = layer.self_attn
    build().context_kv(x, cos, sin, decoder_weights(layer), i, [c.k for c in caches], [c.v for c in caches], starts,
                       ns, _eps(a.k_norm, x.dtype) if a.qk_norm else 0.0, a.kv_heads, a.head_dim)


def lean_forward(dec, ids: list[torch.Tensor], caches: list, layers: tuple[int, ...], last: int | None = None):
    """`LeanDecoder.forward` (one sequence) or `forward_many` (several) of rows at consecutive positions after each
    cache, with causal masks, no contemplate rows and the model's own head, in one call (see `native.cpp`; the caches
    reserved, their lengths set after by the caller) -> (logits, the rows `Head.full_rows` recomputes (None without
    fp32 refinement), the final-norm states, the features or None), every sequence's rows in order."""
    f = dec.layers[0]
    logits, risky, h, feats = build().lean_forward(
        ids, dec.embed, dec.cos, dec.sin, [fused_weights(x) for x in dec.layers], [c.k for c in caches],
        [c.v for c in caches], [c.length for c in caches], dec.scaling, f.eps, f.H, f.KV, f.D, list(layers), last or 0,
        *_head_args(dec))
    return logits, risky if dec.lm.refine else None, h, feats if layers else None


def _head_args(dec) -> list:
    """A `LeanDecoder`'s final norm and head as `native.cpp`'s `lean_forward` reads them: the norm (fp32 with the
    refined head), its eps, the head's weight and packed copies, the refinement's k (0: none) and weight norm."""
    w, refine = dec.lm.weight, dec.lm.refine
    return [dec.norm32() if refine else dec.norm, dec.eps, w, *_copies(w), dec.lm.k if refine else 0, dec.lm.w_norm]


def draft_chain(dec, cache, root_logits: torch.Tensor, depth: int, t: float, top_k: int, top_p: float,
                u: torch.Tensor | None):
    """A standalone draft model's chain (`speclab.drafters.sps.StandaloneDraft._chain`, see `native.cpp`) over the
    `LeanDecoder` dec and its `KVCache` (reserved for the depth - 1 rows it writes from its length on; the caller
    moves the length on) -> (tokens [depth], draft probabilities [depth], q's rows [depth, V] or None when greedy)."""
    f = dec.layers[0]
    toks, probs, q = build().draft_chain(
        root_logits, depth, t, top_k, top_p, u if u is not None else _NO_UNIFORMS, dec.embed, dec.cos,
        dec.sin, [fused_weights(x) for x in dec.layers], cache.k, cache.v, cache.length, dec.scaling, f.eps, f.H,
        f.KV, f.D, *_head_args(dec))
    return toks, probs, q if t > 0 else None


def refined_head(h, w, k: int, w_norm: float):
    """`precision.Head`'s refined fp32 logits (see `native.cpp`) -> (logits, the rows Python recomputes in full)."""
    return build().refined_head(h, w, *_copies(w), k, w_norm)


def main() -> None:
    """Build ahead (`scripts/setup.sh`), saying how long it took."""
    t0 = time.perf_counter()
    ok = build() is not None
    print(f"speclab setup: native CPU layers {'ready' if ok else 'not built: decoding runs from Python'} "
          f"({time.perf_counter() - t0:.0f} s)")
