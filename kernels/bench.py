"""Torch twin vs Triton kernel, per op and size: median microseconds per call. On CUDA both run; elsewhere the
kernels could only run under Triton's interpreter (correctness, not speed), so only the twins are timed."""
from __future__ import annotations

import statistics
import time

import torch

from kernels import reference

# rows x vocabulary (the zoo's 8,192; Qwen3's 151,936), tree nodes, positions x vocabulary
SIZES = {"softmax_entropy": [(1, 8192), (9, 8192), (61, 8192), (9, 151936)],
         "greedy_accept": [(8,), (60,), (256,)],
         "sampling_accept": [(4, 8192), (16, 8192), (8, 151936)]}


def _inputs(op: str, size: tuple, device: str):
    g = torch.Generator().manual_seed(0)
    if op == "softmax_entropy":
        return (torch.randn(*size, generator=g).to(device),)
    if op == "greedy_accept":
        n = size[0]
        parents = torch.tensor([-1] + [int(torch.randint(max(-1, i - 4), i, (1,), generator=g)) for i in range(1, n)])
        tokens = torch.randint(0, 2, (n,), generator=g)
        return tokens.to(device), parents.to(device), torch.randint(0, 2, (n + 1,), generator=g).to(device)
    B, V = size
    p = torch.softmax(torch.randn(B, V, generator=g), -1)
    q = torch.softmax(torch.randn(B, V, generator=g), -1)
    return p.to(device), q.to(device), torch.randint(0, V, (B,), generator=g).to(device), torch.rand(B, generator=g).to(device)


def _time_us(fn, args, reps: int, device: str) -> float:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        fn(*args)
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(*args)
        sync()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def run(device: str | None = None, reps: int = 50, on_step=None) -> list[dict]:
    """Rows {op, size, device, torch_us, triton_us, speedup}; triton_us is None without CUDA."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    use_triton = device == "cuda"
    if use_triton:
        from kernels import triton_ops
    todo = [(op, s) for op, sizes in SIZES.items() for s in sizes]
    rows = []
    for i, (op, size) in enumerate(todo):
        args = _inputs(op, size, device)
        # the twin as speclab calls it: a tree's ancestor mask is already there (the verification built its mask)
        twin_args = args + (reference.ancestor_mask(args[1]),) if op == "greedy_accept" else args
        t = _time_us(getattr(reference, op), twin_args, reps, device)
        k = _time_us(getattr(triton_ops, op), args, reps, device) if use_triton else None
        rows.append({"op": op, "size": "x".join(map(str, size)), "device": device, "torch_us": round(t, 1),
                     "triton_us": None if k is None else round(k, 1), "speedup": None if k is None else round(t / k, 2)})
        if on_step:
            on_step(i + 1, len(todo), op)
    return rows
