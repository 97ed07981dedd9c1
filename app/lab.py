"""What every tab and browser session shares: the target, the drafter models by role, the trace and the token
texts. Model work (decoding, profiling, live confirmation) runs one event at a time (`Lab.line`, a `ModelLine`):
sessions wait their turn, see how many are ahead of them, and each finishes with its own runs in the trace."""
from __future__ import annotations

import contextlib
import functools
import inspect
import tempfile
import threading
from pathlib import Path

import gradio as gr

from speclab.core.precision import precision_label
from speclab.core.target import Target
from speclab.errors import InvalidInput, SpeclabError
from speclab.routing.routers import calibration_path
from speclab.trace import TraceStore, vocab_text
from speclab.zoo import display_path

WAIT_POLL_S = 0.5  # how often a waiting event looks at its place in line


class ModelLine:
    """The line of events waiting to run a model, first come first served: the first holds the models. A waiting
    event knows how many are ahead of it (the page says so); one that leaves (its page closed) frees its place."""

    def __init__(self):
        self._cv = threading.Condition()
        self._line: list[object] = []

    def join(self) -> object:
        ticket = object()
        with self._cv:
            self._line.append(ticket)
        return ticket

    def ahead(self, ticket, timeout_s: float = WAIT_POLL_S) -> int:
        """Events ahead of `ticket` (0: its turn), after waiting up to `timeout_s` for the line to move."""
        with self._cv:
            if self._line.index(ticket):
                self._cv.wait(timeout_s)
            return self._line.index(ticket)

    def leave(self, ticket) -> None:
        with self._cv:
            self._line.remove(ticket)
            self._cv.notify_all()

    @contextlib.contextmanager
    def hold(self, progress=None):
        """The models for a plain handler: waits its turn, showing "waiting for the models: N ahead" on its
        progress bar (a gr.Progress) meanwhile."""
        ticket = self.join()
        try:
            while n := self.ahead(ticket):
                if progress is not None:
                    progress(0, desc=waiting(n))
            yield
        finally:
            self.leave(ticket)


def waiting(n: int) -> str:
    return f"waiting for the models: {n} ahead (another page is decoding or profiling)"


class Lab:
    def __init__(self, target: Target, models: dict, store: TraceStore, costs=None):
        self.target, self.models, self.store = target, models, store  # drafter models by role (speclab.methods)
        self.costs = costs  # a hardware cost profile the calibration tab replays under (--costs), or None
        self.text = vocab_text(target.tokenizer)
        self.calibrators: dict = {}  # bench id -> speclab.bench.calibration.Calibrator (profiles loaded once)
        self.line = ModelLine()  # every event that runs a model waits its turn here
        self.profiles: dict = {}  # run id -> the greedy profile at its round starts (a routed run's counterfactuals)
        self.exports = Path(tempfile.mkdtemp(prefix="speclab-exports-"))  # files the export buttons hand out

    def header(self) -> str:
        roles = " · ".join(f"{role} `{display_path(getattr(m, 'name', '-'))}`" for role, m in self.models.items())
        return (f"# speclab · speculative decoding lab\ntarget `{display_path(self.target.name)}` · {roles} · "
                f"trace `{display_path(self.store.path)}` · calibration `{display_path(calibration_path())}` (the "
                f"zoo's where it has none) · {self.target.device.type} · {precision_label(self.target)}"
                + (f" · calibration modeled under {self.costs.label}" if self.costs is not None else "")
                + (f"\n\n<small>{self.target.dtype_choice}; every method here runs in this dtype, so the columns "
                   "compare with AR's in one dtype</small>" if self.target.dtype_choice else ""))

    def methods(self) -> list[str]:
        """The registered methods whose models are loaded, in the registry's order."""
        from speclab.methods import METHODS
        return [n for n, m in METHODS.items() if all(self.models.get(r) is not None for r in m.needs)]

    def warm_up(self) -> None:
        """Decode a few tokens with every method once, untraced, so the first decode a user asks for streams its
        first tokens at once (cold, the first call of each code path costs most of a second on CPU)."""
        from speclab.generate import generate
        for name in self.methods():
            generate(self.target, "The", name, models=self.models, max_new_tokens=4)

    def run_choices(self) -> list[str]:
        return [str(r) for r in self.store.run_ids(200)]


def run_id_of(value) -> int:
    try:
        return int(str(value).strip())
    except ValueError:
        raise InvalidInput(f"'{value}' is not a run id") from None


def answers(n_outputs: int):
    """A handler's bad input (any SpeclabError: every check in speclab and the app raises one) becomes one
    warning toast with its message, and every output keeps what it shows: nothing is blanked or marked failed,
    so a typo never loses a decode or a calibration on the page. Works for generators (streams) too."""
    def keep():
        return gr.skip() if n_outputs == 1 else [gr.skip()] * n_outputs

    def wrap(fn):
        if inspect.isgeneratorfunction(fn):
            @functools.wraps(fn)
            def stream(*args, **kw):
                try:
                    yield from fn(*args, **kw)
                except SpeclabError as e:
                    gr.Warning(str(e))
                    yield keep()
            return stream

        @functools.wraps(fn)
        def call(*args, **kw):
            try:
                return fn(*args, **kw)
            except SpeclabError as e:
                gr.Warning(str(e))
                return keep()
        return call
    return wrap
