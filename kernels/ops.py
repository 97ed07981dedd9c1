"""The one dispatch point speclab calls for the small hot ops of a round. Triton runs only on CUDA tensors (when
triton is importable); everywhere else the torch twin (`kernels.reference`). SPECLAB_KERNELS=torch forces the
twins; SPECLAB_KERNELS=triton forces the kernels, which without a GPU needs Triton's interpreter
(TRITON_INTERPRET=1): the tests use it to run the kernels on CPU tensors."""
from __future__ import annotations

import functools
import os

import torch

from kernels import reference

ENV = "SPECLAB_KERNELS"


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def backend(t: torch.Tensor) -> str:
    """'triton' or 'torch' for an op on tensor t."""
    forced = os.environ.get(ENV, "")
    if forced == "torch":
        return "torch"
    if forced == "triton":
        if not triton_available():
            raise RuntimeError(f"{ENV}=triton but triton is not installed")
        if t.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(f"{ENV}=triton on {t.device.type} tensors needs TRITON_INTERPRET=1 (Triton's "
                               "interpreter: correctness only, slow)")
        return "triton"
    return "triton" if t.device.type == "cuda" and triton_available() else "torch"


def _impl(t: torch.Tensor):
    if backend(t) == "triton":
        from kernels import triton_ops
        return triton_ops
    return reference


def softmax_entropy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logsumexp [R], entropy [R]) of rows of logits [R, V], fp32 (see reference.softmax_entropy)."""
    return _impl(logits).softmax_entropy(logits)


def greedy_accept(tokens: torch.Tensor, parents: torch.Tensor, target_argmax: torch.Tensor,
                  ancestors: torch.Tensor | None = None):
    """(best node, bonus token, on_path mask) of a draft tree under greedy verification (reference.greedy_accept;
    the torch twin uses `ancestors` when given, the kernel does not need it)."""
    return _impl(tokens).greedy_accept(tokens, parents, target_argmax, ancestors)


def sampling_accept(p: torch.Tensor, q: torch.Tensor, x: torch.Tensor, u: torch.Tensor):
    """(accept [B], residual [B, V]) of a batch of speculative-sampling tests (reference.sampling_accept)."""
    return _impl(p).sampling_accept(p, q, x, u)


def flash_gather_score(h: torch.Tensor, weight: torch.Tensor, index: torch.Tensor, clusters: torch.Tensor,
                       scale: float = 1.0):
    """(candidates [R, P*b], their logits [R, P*b] fp32) of FlashHead's probed clusters
    (reference.flash_gather_score)."""
    return _impl(h).flash_gather_score(h, weight, index, clusters, scale)
