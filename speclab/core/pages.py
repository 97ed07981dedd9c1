"""Weights on 2 MB pages: what a forward streams on every call, read through fewer TLB entries.

A decode reads every packed weight (`layers._packed`) once a call. On 4 KB pages the zoo target's 46 MB are 11,000
pages, far more than a core's TLB holds, so each call also walks page tables, and on a virtual machine a miss walks
two levels of them. Placed on transparent huge pages (`on_huge_pages`: a copy into an anonymous mapping advised
MADV_HUGEPAGE, 2 MB aligned), the same weights are 23 pages. Measured on the Intel Xeon with AMX (the README's
"Benchmarks"): the target's call 5-8% faster back to back and 10-14% after 8 ms of other work.

Copies only: a tensor's bits never change, so no decode's output does. The kernel decides whether a page is huge
(`/sys/kernel/mm/transparent_hugepage/enabled` "madvise" or "always"; with "never", or none, nothing is copied:
`ENABLED`). SPECLAB_HUGEPAGES=0 in the environment turns it off, to compare. Memory: the mappings are never freed
piecewise, so a model freed while a later one shares its last mapping keeps that mapping (at most `CHUNK`) alive.
"""
from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path

import torch

HUGE = 2 << 20
CHUNK = 64 << 20  # one mapping's size (a bigger tensor gets its own); untouched tails take no memory
MIN_BYTES = 256 << 10  # smaller tensors stay where they are (a tiny model's weights: not worth a mapping)
THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_mode() -> str:
    """The kernel's THP setting ("always", "madvise" or "never"; "" where it has none)."""
    try:
        text = Path(THP).read_text()
    except OSError:
        return ""
    return text[text.find("[") + 1 : text.find("]")] if "[" in text else ""


ENABLED = (os.environ.get("SPECLAB_HUGEPAGES", "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")
           and _thp_mode() in ("always", "madvise"))


def mapping(nbytes: int) -> torch.Tensor:
    """nbytes of uint8 (uninitialised) at the start of an anonymous mapping of their own, 2 MB aligned and advised
    MADV_HUGEPAGE (the kernel may still give ordinary pages: `ENABLED` says whether it would not); freed with the
    last tensor that views it."""
    mm = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE)
    buf = torch.frombuffer(mm, dtype=torch.uint8)
    off = (-buf.data_ptr()) % HUGE
    return buf[off : off + nbytes]


class _Arena:
    """Bump allocation in 2 MB-aligned anonymous mappings advised MADV_HUGEPAGE. A mapping lives while any tensor
    placed in it does (each holds its buffer); nothing is freed piecewise (packed weights live as long as their
    model)."""

    def __init__(self):
        self.buf: torch.Tensor | None = None
        self.off = self.end = 0
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """nbytes of uint8 in huge-page memory, 64-byte aligned."""
        with self.lock:
            if self.buf is None or self.off + nbytes > self.end:
                self.buf = mapping(max(CHUNK, -(-nbytes // HUGE) * HUGE))
                self.off, self.end = 0, self.buf.numel()
            out = self.buf[self.off : self.off + nbytes]
            self.off += -(-nbytes // 64) * 64
            return out


_ARENA = _Arena()


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` on huge pages where that applies (a dense contiguous CPU tensor of at least `MIN_BYTES`, and
    `ENABLED`), else `t` itself. The copy is bit for bit `t`."""
    nbytes = t.numel() * t.element_size()
    if (not ENABLED or t.device.type != "cpu" or t.layout is not torch.strided  # oneDNN's copies are not strided
            or not t.is_contiguous() or nbytes < MIN_BYTES or t.requires_grad):
        return t
    out = _ARENA.take(nbytes).view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def place(module: torch.nn.Module) -> torch.nn.Module:
    """Every parameter and buffer of `module` big enough (`on_huge_pages`) moved onto huge pages, in place (tied
    weights stay tied: each is one Parameter); returns the module."""
    if ENABLED:
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                t.data = on_huge_pages(t.data)
    return module
