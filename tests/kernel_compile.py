"""Compile every Triton kernel for a Hopper GPU (sm_90) on a machine without one: run by
tests/test_kernels.py::test_every_kernel_compiles_for_a_hopper_gpu in a process of its own (TRITON_INTERPRET unset).

Each launcher of kernels/triton_ops.py runs on small CPU tensors with its kernels swapped for recorders, so the
signatures compiled are the argument types the launchers really pass; then triton.compile builds each to a cubin."""
import sys
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels import triton_ops

TRITON_TYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
               torch.int32: "i32", torch.int8: "i8"}


def record_launches(jitted) -> dict:
    """(kernel index, types, constexprs) -> (signature, constexprs) of every launch the launchers make."""
    launches = {}

    class Record:  # stands in for a kernel: `kernel[grid](*args, **constexprs)` records the argument types
        def __init__(self, i):
            self.i = i

        def __getitem__(self, grid):
            def launch(*args, **constexprs):
                names = jitted[self.i].arg_names
                types = [("*" + TRITON_TYPE[a.dtype]) if isinstance(a, torch.Tensor) else
                         "fp32" if isinstance(a, float) else "i32" for a in args]
                sig = {**dict(zip(names, types)), **{k: "constexpr" for k in constexprs}}
                launches[(self.i, tuple(types), tuple(constexprs.items()))] = (
                    sig, {(names.index(k),): v for k, v in constexprs.items()})
            return launch

    triton_ops._kernels = lambda: [Record(i) for i in range(len(jitted))]
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        triton_ops.softmax_entropy(torch.randn(3, 1000, generator=g).to(dtype))
        p = torch.softmax(torch.randn(2, 100, generator=g), -1).to(dtype)
        triton_ops.sampling_accept(p, p, torch.tensor([1, 2]), torch.rand(2, generator=g))
        triton_ops.flash_gather_score(torch.randn(2, 64).to(dtype), torch.randn(12, 64).to(dtype),
                                      torch.arange(12).view(4, 3), torch.tensor([[0, 1], [2, 3]]))
    triton_ops.greedy_accept(torch.tensor([3, 1, 4, 1]), torch.tensor([-1, 0, 0, 1]), torch.zeros(5, dtype=torch.long))
    return launches


def main() -> None:
    assert not triton.knobs.runtime.interpret, "run without TRITON_INTERPRET"
    jitted = triton_ops._kernels()
    launches = record_launches(jitted)
    missing = set(range(len(jitted))) - {i for i, _, _ in launches}
    assert not missing, f"kernels no launcher launched: {missing}"
    for (i, _, _), (sig, constexprs) in launches.items():
        compiled = triton.compile(ASTSource(fn=jitted[i], signature=sig, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32))
        assert compiled.asm["cubin"], (jitted[i].fn.__name__, sig)
    print(f"compiled {len(jitted)} kernels in {len(launches)} signatures for sm_90")


if __name__ == "__main__":
    main()
