"""A small progress line with rate and ETA for long work (training, sweeps, benchmarks)."""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, label: str = "", stream=None, min_interval_s: float = 0.5):
        self.total, self.label = total, label
        self.stream = stream or sys.stderr
        self.t0 = time.time()
        self._last = 0.0
        self.min_interval_s = min_interval_s

    def update(self, done: int, **info) -> None:
        now = time.time()
        if now - self._last < self.min_interval_s and done < self.total:
            return
        self._last = now
        elapsed = now - self.t0
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - done) / rate if rate > 0 else float("nan")
        extra = " ".join(f"{k}={v}" for k, v in info.items())
        self.stream.write(f"\r{self.label} {done}/{self.total} [{_fmt(elapsed)} elapsed, ETA {_fmt(eta)}] {extra}   ")
        if done >= self.total:
            self.stream.write("\n")
        self.stream.flush()


def _fmt(s: float) -> str:
    if s != s:  # nan
        return "?"
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
