"""Torch twin vs Triton kernel, per op and size: median microseconds per call. On CUDA both run; elsewhere the
kernels could only run under Triton's interpreter (correctness, not speed), so only the twins are timed.
The timing loop is an argument (`timeit`): speclab passes its one interleaved helper
(`speclab.bench.costs.timeit_interleaved`); kernels/ imports nothing of speclab, so it has a plain default."""
from __future__ import annotations

import statistics
import time

import torch

from kernels import reference

# rows x vocabulary (the zoo's 8,192; Qwen3's 151,936), tree nodes, positions x vocabulary
SIZES = {"softmax_entropy": [(1, 8192), (9, 8192), (61, 8192), (9, 151936)],
         "greedy_accept": [(8,), (60,), (256,)],
         "sampling_accept": [(4, 8192), (16, 8192), (8, 151936)],
         # rows x vocabulary x hidden x cluster size x probes (the zoo's head; Qwen3-0.6B's, as in the FlashHead thesis)
         "flash_gather_score": [(1, 8192, 512, 16, 8), (9, 8192, 512, 16, 8), (9, 151936, 1024, 16, 8)]}


def _inputs(op: str, size: tuple, device: str):
    g = torch.Generator().manual_seed(0)
    if op == "softmax_entropy":
        return (torch.randn(*size, generator=g).to(device),)
    if op == "greedy_accept":
        n = size[0]
        parents = torch.tensor([-1] + [int(torch.randint(max(-1, i - 4), i, (1,), generator=g)) for i in range(1, n)])
        tokens = torch.randint(0, 2, (n,), generator=g)
        return tokens.to(device), parents.to(device), torch.randint(0, 2, (n + 1,), generator=g).to(device)
    if op == "flash_gather_score":
        R, V, H, b, P = size
        index = torch.randperm(V, generator=g).view(V // b, b)
        return (torch.randn(R, H, generator=g).to(device), torch.randn(V, H, generator=g).to(device),
                index.to(device), torch.randint(0, V // b, (R, P), generator=g).to(device))
    B, V = size
    p = torch.softmax(torch.randn(B, V, generator=g), -1)
    q = torch.softmax(torch.randn(B, V, generator=g), -1)
    return (p.to(device), q.to(device), torch.randint(0, V, (B,), generator=g).to(device),
            torch.rand(B, generator=g).to(device))


def _timeit(fns: dict, reps: int) -> dict:
    """Median milliseconds per call of each function (no arguments), the functions taking turns every repetition."""
    times: dict = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(v) for name, v in times.items()}


def _synced(fn, args: tuple, sync):
    """fn(*args), then wait for the device."""
    return lambda: (fn(*args), sync())


def run(device: str | None = None, reps: int = 50, on_step=None, timeit=None) -> list[dict]:
    """Rows {op, size, device, torch_us, triton_us, speedup}; triton_us is None without CUDA. `timeit(fns, reps)`
    -> median ms per call of each function (default: `_timeit`); every call is synchronised on CUDA and every
    function called 3 times first (warm-up)."""
    timeit = timeit or _timeit
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    use_triton = device == "cuda"
    if use_triton:
        from kernels import triton_ops
    todo = [(op, s) for op, sizes in SIZES.items() for s in sizes]
    rows = []
    for i, (op, size) in enumerate(todo):
        args = _inputs(op, size, device)
        # the twin as speclab calls it: a tree's ancestor mask is already there (the verification built its mask)
        twin_args = args + (reference.ancestor_mask(args[1]),) if op == "greedy_accept" else args
        fns = {"torch": _synced(getattr(reference, op), twin_args, sync)}
        if use_triton:
            fns["triton"] = _synced(getattr(triton_ops, op), args, sync)
        for fn in fns.values():
            for _ in range(3):
                fn()
        us = {name: ms * 1e3 for name, ms in timeit(fns, reps).items()}
        t, k = us["torch"], us.get("triton")
        rows.append({"op": op, "size": "x".join(map(str, size)), "device": device, "torch_us": round(t, 1),
                     "triton_us": None if k is None else round(k, 1),
                     "speedup": None if k is None else round(t / k, 2)})
        if on_step:
            on_step(i + 1, len(todo), op)
    return rows
