"""Numeric precision: which dtype a decode runs in, and logits that never tie by quantisation.

Three decisions live here, one concept: how precisely the models compute.

- **The dtype** (`pick_dtype`). `auto` (the default) is bf16 on CUDA, and on a CPU bf16 where the CPU computes
  it natively (`avx512_bf16` or `amx_bf16` in its flags) *and* a quick measurement confirms that a bf16 matmul
  of a decode's shape is faster there than fp32; fp32 elsewhere. `auto_choice()` says what was found and why.
- **Logits in fp32** (`head_logits`). In bf16 the LM head's outputs carry 8 mantissa bits, so near the top of
  the distribution two logits often tie exactly, and a 1-row AR step and an n-row verification break the tie
  differently. Here the final norm runs in fp32 on the bf16 hidden state, the head matmul runs in bf16 (the
  CPU has no bf16 x bf16 -> fp32 matmul in torch, and an fp32 head costs 3-4x as much), and the `REFINE_K`
  largest logits of every row are then recomputed exactly in fp32 (bf16 weights are exact in fp32). A row
  whose unrefined logits might still reach the refined maximum (by a bound on the bf16 error: output rounding
  plus |w| * |h - bf16(h)|) gets its whole row in fp32. So the argmax, the top-k and every logit that could
  matter for a tie are fp32 values; the far tail keeps bf16 precision.
- **Exact mode** lives in `speclab/core/lean.py` (`LeanDecoder(exact=True)`): every call on one fixed row tile, so
  per-row results do not depend on how many rows run together. `LOGITS` and `exact` are recorded on each run.
"""
from __future__ import annotations

import functools
import platform
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from speclab.errors import InvalidInput

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", "fp32", "bf16", "fp16")
LOGITS = ("fp32", "model")  # logits in fp32 (refined) or in the model's dtype
REFINE_K = 16  # logits of each row recomputed in fp32
BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def dtype_option(name: str) -> str:
    """The --dtype value that selects the dtype called `name` ('bfloat16' -> 'bf16'); `name` when none does."""
    return next((k for k in DTYPE_CHOICES if k in DTYPES and DTYPES[k] is DTYPES.get(name)), name)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_dtype(name):
    """`name` if it names a dtype speclab runs in ('auto' included), else InvalidInput."""
    if isinstance(name, torch.dtype):
        return name
    if name is None or str(name) in DTYPE_CHOICES or str(name) in DTYPES:
        return name
    raise InvalidInput(f"--dtype {name!r} is not a dtype speclab runs in: choose one of {', '.join(DTYPE_CHOICES)}")


def check_logits(name: str) -> str:
    if name not in LOGITS:
        raise InvalidInput(f"--logits {name!r}: choose fp32 (the final norm and head's top logits in fp32) or model "
                           "(logits in the model's dtype)")
    return name


@functools.lru_cache(maxsize=1)
def cpu_info() -> tuple[str, tuple[str, ...]]:
    """(CPU model name, its bf16 flags) from /proc/cpuinfo (empty flags where it cannot be read)."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name":
                    name = value.strip()
                elif key == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return name, tuple(f for f in BF16_FLAGS if f in flags)


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str  # one line: what was found
    cpu: str  # CPU model and its bf16 capability (recorded on each run)


def cpu_label() -> str:
    name, flags = cpu_info()
    return f"{name} ({', '.join(flags) if flags else 'no native bf16'})"


def precision_label(target) -> str:
    """'bfloat16, fp32 logits, exact' and the like: how a target computes, in a few words (headers, reports)."""
    p = target.precision
    return (f"{p['dtype']}" + (", fp32 logits" if p["logits_dtype"] == "float32" and p["dtype"] != "float32" else "")
            + (", exact" if p["exact"] else ""))


def measure_bf16(rows: int = 8, d: int = 512, reps: int = 30) -> tuple[float, float]:
    """ms of a [rows, d] x [d, 3d] matmul in fp32 and in bf16 on this CPU (a decode's shape; ~50 ms): the fastest of
    `reps` calls each, the two dtypes taking turns, so a busy machine (another process preempting one block of
    calls) cannot make one dtype look slower than it is (measured: seven processes on 2 cores once gave bf16 a
    20 ms median against fp32's 0.18 ms when each dtype was timed in its own block)."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(3 * d, d, generator=g), torch.randn(rows, d, generator=g)
    args = {dt: (x.to(dt), w.to(dt)) for dt in (torch.float32, torch.bfloat16)}
    for xd, wd in args.values():
        for _ in range(5):
            F.linear(xd, wd)
    best = {dt: float("inf") for dt in args}
    for _ in range(reps):
        for dt, (xd, wd) in args.items():
            t0 = time.perf_counter()
            F.linear(xd, wd)
            best[dt] = min(best[dt], time.perf_counter() - t0)
    return best[torch.float32] * 1e3, best[torch.bfloat16] * 1e3


@functools.lru_cache(maxsize=4)
def auto_choice(device_type: str = "cpu") -> DtypeChoice:
    """What `--dtype auto` means on this machine, and why (measured once per process)."""
    if device_type == "cuda":
        return DtypeChoice(torch.bfloat16, "CUDA: bf16", cpu_label())
    _, flags = cpu_info()
    if not flags:
        return DtypeChoice(torch.float32, "this CPU has no native bf16 (no avx512_bf16 / amx_bf16): fp32", cpu_label())
    fp32_ms, bf16_ms = measure_bf16()
    if bf16_ms >= fp32_ms:
        return DtypeChoice(torch.float32, f"the CPU has {flags[0]} but a bf16 matmul measured slower than fp32 "
                           f"({bf16_ms:.3f} vs {fp32_ms:.3f} ms): fp32", cpu_label())
    return DtypeChoice(torch.bfloat16, f"the CPU computes bf16 natively ({flags[0]}; a decode-shaped matmul "
                       f"{bf16_ms:.3f} ms in bf16 vs {fp32_ms:.3f} ms in fp32): bf16", cpu_label())


def pick_dtype(device: torch.device, dtype: str | torch.dtype | None = None) -> torch.dtype:
    """The dtype a model runs in: a name, a torch dtype, or None / 'auto' (`auto_choice`)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype and dtype != "auto":
        return DTYPES[check_dtype(dtype)]
    return auto_choice(device.type).dtype


# ---- logits in fp32 -------------------------------------------------------------------------------------------

def rms_norm32(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32 of a (bf16) hidden state: the input of an fp32 head."""
    return F.rms_norm(h.float(), h.shape[-1:], weight.float(), eps)


class Head:
    """An LM head `weight` [V, d] whose logits are fp32 where it matters (`logits='fp32'`) or in the weight's dtype
    upcast (`logits='model'`). Per row the result depends on that row only (exact mode relies on it)."""

    def __init__(self, weight: torch.Tensor, logits: str = "fp32", k: int = REFINE_K):
        self.weight, self.logits, self.k = weight, check_logits(logits), min(k, weight.shape[0])
        self.refine = logits == "fp32" and weight.dtype != torch.float32
        # the largest row norm of the head: bounds a logit's error from rounding the hidden state to bf16
        self.w_norm = float(weight.detach().float().norm(dim=-1).max()) if self.refine else 0.0

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits [..., V] of hidden states h [..., d] (fp32 from `rms_norm32`, or the model's dtype)."""
        w = self.weight
        low = F.linear(h.to(w.dtype), w).float()
        if not self.refine:
            return low
        shape = low.shape
        low, h = low.reshape(-1, shape[-1]), h.reshape(-1, h.shape[-1]).float()
        top = low.topk(self.k, -1)
        exact = (w[top.indices].float() * h[:, None, :]).sum(-1)  # [rows, k] fp32 dot products
        out = low.scatter_(-1, top.indices, exact)
        if self.k < shape[-1]:  # could an unrefined logit reach the refined maximum? then that row in full fp32
            kth = top.values[:, -1]
            err = kth.abs() * 2.0 ** -7 + self.w_norm * (h - h.to(w.dtype).float()).norm(dim=-1) + 1e-3
            unsafe = (kth + err >= exact.max(-1).values).nonzero().flatten().tolist()
            if unsafe:  # rare; one row at a time, so a row's result never depends on the others
                w32 = w.float()
                for r in unsafe:
                    out[r] = F.linear(h[r : r + 1], w32)[0]
        return out.view(shape)
