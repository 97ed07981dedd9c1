"""A small progress line with rate and ETA for long work (training, sweeps, benchmarks).

A caller that shows progress elsewhere (the app's progress bar) listens with `listen(fn)`: every Progress
updated inside that block (in the same thread) also calls fn(label, done, total, eta_s), unthrottled.
"""
from __future__ import annotations

import contextlib
import contextvars
import sys
import time

_listener: contextvars.ContextVar = contextvars.ContextVar("speclab_progress_listener", default=None)


@contextlib.contextmanager
def listen(fn):
    """Within the block, every Progress update also goes to fn(label, done, total, eta_s)."""
    token = _listener.set(fn)
    try:
        yield
    finally:
        _listener.reset(token)


class Progress:
    def __init__(self, total: int, label: str = "", stream=None, min_interval_s: float = 0.5):
        self.total, self.label = total, label
        self.stream = stream or sys.stderr
        self.t0 = time.time()
        self._last = 0.0
        self.min_interval_s = min_interval_s
        self.done = 0

    def update(self, done: int, **info) -> None:
        self.done = done
        now = time.time()
        fn = _listener.get()
        if fn is not None:
            rate = done / (now - self.t0) if now > self.t0 else 0.0
            fn(self.label, done, self.total, (self.total - done) / rate if rate > 0 else float("nan"))
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
