"""The threads of a training: each entry point runs on its config's `threads` and hands the caller's back."""
from __future__ import annotations

import functools

import torch


def own_threads(train):
    """A training entry point runs on its config's `threads` (its set-up sets torch's) and hands the caller's count
    back when it ends, however it ends: after a training inside a long-lived process (a notebook, the tests) that
    process decodes on its own thread count again, not on the training's."""
    @functools.wraps(train)
    def wrapped(*args, **kwargs):
        threads = torch.get_num_threads()
        try:
            return train(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)
    return wrapped
