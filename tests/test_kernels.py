"""The Triton kernels (kernels/triton_ops.py) equal their torch twins (kernels/reference.py) under Triton's
interpreter on CPU tensors, on small shapes: vocabularies that are not powers of two, bf16 and fp16 inputs,
chains, trees and empty trees. Dispatch never picks Triton on CPU; forced onto the kernels (interpreted), the
engine decodes the same tokens."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import DEVICE

if DEVICE == "cpu":  # on a GPU run (SPECLAB_TEST_DEVICE=cuda) the CUDA kernels compile
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are first built: before any test here runs them
try:
    import triton  # noqa: F401
except ImportError:
    if os.environ.get("CI"):
        raise RuntimeError("triton is missing: the set-up (scripts/setup.sh) installs it") from None
    pytest.skip("triton is not installed (make test installs it)", allow_module_level=True)

from kernels import ops, reference, triton_ops


@pytest.mark.parametrize("V", [7, 1000, 4099, 8192])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_softmax_entropy_equals_twin(V, dtype):
    g = torch.Generator().manual_seed(V)
    x = (torch.randn(5, V, generator=g) * 4).to(dtype)
    x[0, : V // 2] = -1e4  # a row with a dead half
    (lse_r, ent_r), (lse_t, ent_t) = reference.softmax_entropy(x), triton_ops.softmax_entropy(x)
    assert lse_t.dtype == ent_t.dtype == torch.float32
    torch.testing.assert_close(lse_t, lse_r, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent_t, ent_r, atol=2e-5, rtol=1e-5)
    # and the twin is the textbook definition
    logp = torch.log_softmax(x.float(), -1)
    torch.testing.assert_close(ent_r, -(logp.exp() * logp).sum(-1), atol=2e-5, rtol=1e-5)


def _trees(seed: int):
    g = torch.Generator().manual_seed(seed)
    yield torch.tensor([], dtype=torch.long), torch.tensor([0])  # empty tree: the target's token alone
    for n in (1, 4, 9, 23, 60):
        chain = torch.arange(-1, n - 1)
        yield chain, None
        yield torch.tensor([-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, n)]), None


def _walked_ancestors(parents: torch.Tensor) -> torch.Tensor:
    """The ancestor matrix by walking each node's parents up to the root, in Python (the independent reference)."""
    n = parents.numel()
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = int(parents[j])
    return anc


@pytest.mark.parametrize("seed", range(4))
def test_ancestor_mask_is_the_path_to_the_root(seed):
    """The one ancestor matrix (kernels.reference.ancestor_mask), also what a DraftTree verifies with, is each
    node's walk up to the root: chains, random trees, one node and none."""
    from speclab.core.tree import DraftTree
    for parents, _ in _trees(seed):
        want = _walked_ancestors(parents)
        assert torch.equal(reference.ancestor_mask(parents), want), parents.tolist()
        tree = DraftTree(torch.zeros_like(parents), parents, torch.ones(parents.numel()))
        assert torch.equal(tree.ancestors, want)


@pytest.mark.parametrize("seed", range(4))
def test_greedy_accept_equals_twin(seed):
    g = torch.Generator().manual_seed(100 + seed)
    seen_accepts = 0
    for parents, arg in _trees(seed):
        n = parents.numel()
        tokens = torch.randint(0, 3, (n,), generator=g)
        if arg is None:  # the target agrees with some child at most rows (so paths get deep), not at all of them
            arg = torch.randint(0, 3, (n + 1,), generator=g)
            for i in torch.randperm(n, generator=g).tolist():
                if float(torch.rand(1, generator=g)) < 0.8:
                    arg[parents[i] + 1] = tokens[i]
        want = reference.greedy_accept(tokens, parents, arg)
        fast = reference.greedy_accept(tokens, parents, arg, _walked_ancestors(parents))
        got = triton_ops.greedy_accept(tokens, parents, arg)
        for other in (fast, got):
            assert other[0] == want[0] and other[1] == want[1] and torch.equal(other[2], want[2])
        seen_accepts += want[0] >= 0
    assert seen_accepts >= 5  # the cases exercise accepted paths, not only rejections


@pytest.mark.parametrize("V", [5, 1001, 4099])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sampling_accept_equals_twin(V, dtype):
    g = torch.Generator().manual_seed(V)
    B = 6
    p = torch.softmax(torch.randn(B, V, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(B, V, generator=g) * 2, -1)
    q[1] = torch.nn.functional.one_hot(torch.tensor(2), V).float()  # a deterministic draft: a point mass
    q[2] = p[2]  # q covers p: the residual has no mass, so it is p itself
    p, q = p.to(dtype), q.to(dtype)
    x = torch.randint(0, V, (B,), generator=g)
    x[1] = 2
    u = torch.rand(B, generator=g)
    (acc_r, res_r), (acc_t, res_t) = reference.sampling_accept(p, q, x, u), triton_ops.sampling_accept(p, q, x, u)
    assert torch.equal(acc_r, acc_t)
    torch.testing.assert_close(res_t, res_r, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(res_r.sum(-1), torch.ones(B), atol=1e-5 if dtype == torch.float32 else 4e-3, rtol=0)
    torch.testing.assert_close(res_r[2], p[2].float())


@pytest.mark.parametrize("b,H", [(2, 16), (3, 100), (16, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_flash_gather_score_equals_twin(b, H, dtype):
    """FlashHead's gather-and-score: the probed clusters' token ids and their exact logits (fp32 accumulation),
    clusters of sizes that are not powers of two, a hidden size that is not a multiple of the block, a repeated
    probe (adaptive probes repeat a row's best cluster)."""
    g = torch.Generator().manual_seed(b * H)
    c, R, P = 6, 4, 3
    V = c * b
    weight = torch.randn(V, H, generator=g).to(dtype)
    index = torch.randperm(V, generator=g).view(c, b)
    h = torch.randn(R, H, generator=g).to(dtype)
    clusters = torch.stack([torch.randperm(c, generator=g)[:P] for _ in range(R)])
    clusters[1, 2] = clusters[1, 0]
    (ids_r, lg_r), (ids_t, lg_t) = (reference.flash_gather_score(h, weight, index, clusters, 0.5),
                                    triton_ops.flash_gather_score(h, weight, index, clusters, 0.5))
    assert torch.equal(ids_r, ids_t) and lg_t.dtype == torch.float32
    torch.testing.assert_close(lg_t, lg_r, atol=1e-4, rtol=1e-5)
    dense = (h.float() @ weight.float().T) * 0.5
    torch.testing.assert_close(lg_r, dense.gather(1, ids_r), atol=1e-4, rtol=1e-5)


def test_every_kernel_compiles_for_a_hopper_gpu():
    """Each kernel, with the argument types its launcher passes (logits in fp32, bf16 and fp16), compiles to a cubin
    for sm_90 through Triton's own compiler, here on the CPU (tests/kernel_compile.py, in a process of its own: this
    one is interpreted). The interpreter forgives what the compiler refuses: greedy_accept's path walk once changed a
    loop variable's type, and every tree failed on an H200."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("kernel_compile.py"))], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "compiled 4 kernels" in r.stdout, r.stdout


def test_dispatch_never_picks_triton_on_cpu(monkeypatch):
    monkeypatch.delenv(ops.ENV, raising=False)
    assert ops.backend(torch.zeros(2)) == "torch"
    monkeypatch.setenv(ops.ENV, "triton")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="needs TRITON_INTERPRET=1"):
        ops.backend(torch.zeros(2))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ops.backend(torch.zeros(2)) == "triton"


@pytest.mark.slow
def test_batched_chain_sampling_equals_the_recursion(monkeypatch):
    """Token by token (`SPECLAB_CHAIN_VERIFY=token`; a chain's default is block verification, tests/test_sampling.py),
    a sampled (and a deterministic) chain verified in one batched test equals the recursive rejection, draw for draw
    (same uniforms, same residual, same bonus)."""
    from speclab.core import verify
    from speclab.core.tree import DraftTree
    from speclab.core.verify import verify_sampling
    monkeypatch.setattr(verify, "CHAIN_RULE", "token")
    V, n = 11, 5
    for trial in range(200):
        g = torch.Generator().manual_seed(trial)
        probs = torch.softmax(torch.randn(n + 1, V, generator=g) * 2, -1)
        dists = torch.softmax(torch.randn(n + 1, V, generator=g) * 2, -1)
        tokens = torch.multinomial(dists[:n], 1, generator=g).flatten()
        for sampled in (True, False):
            chain = DraftTree.chain(tokens, dists[torch.arange(n), tokens], dists if sampled else None)
            walk = DraftTree(tokens, torch.arange(-1, n - 1), chain.draft_probs, chain.draft_dists)
            walk._chain = False  # the recursive path
            a = verify_sampling(chain, probs, torch.Generator().manual_seed(trial))
            b = verify_sampling(walk, probs, torch.Generator().manual_seed(trial))
            assert a.accepted.tolist() == b.accepted.tolist() and a.bonus == b.bonus, (trial, sampled)


@pytest.mark.slow
@pytest.mark.parametrize("method,params", [("sps", {"k": 3, "tree_topk": 2}), ("sps", {"k": 4}),
                                           ("pld", {"k": 4})])
def test_engine_output_unchanged_on_the_triton_path(qwen3, qwen3_draft, monkeypatch, method, params):
    """Greedy (tree and chain) and sampled decodes with every op on the interpreted kernels: the same tokens, and
    the same per-token probabilities and entropies in the round events, as on the torch twins."""
    from helpers import PROMPTS
    from speclab.generate import generate
    from speclab.trace import token_columns, vocab_text

    text = vocab_text(qwen3.tokenizer)

    def run(backend, temperature):
        monkeypatch.setenv(ops.ENV, backend)
        evs = []
        res = generate(qwen3, PROMPTS[0], method, models={"draft": qwen3_draft}, max_new_tokens=16,
                       temperature=temperature, seed=3, on_round=evs.append, **params)
        return res.token_ids, token_columns(evs, text)

    for temperature in (0.0, 1.0):
        (ids_t, cols_t), (ids_k, cols_k) = run("torch", temperature), run("triton", temperature)
        assert ids_t == ids_k
        for c in ("target_prob", "entropy"):
            torch.testing.assert_close(torch.tensor(cols_k[c]), torch.tensor(cols_t[c]), atol=1e-4, rtol=1e-4)
