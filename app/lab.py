"""What every tab and browser session shares: the target, the drafter models by role, the trace and the token
texts. Model work (decoding, profiling, live confirmation) runs one event at a time (`MODELS`, the event
queue's concurrency group): sessions queue for it and each finishes with its own runs in the trace."""
from __future__ import annotations

import functools
import inspect

import gradio as gr

from speclab.core.precision import precision_label
from speclab.core.target import Target
from speclab.errors import InvalidInput, SpeclabError
from speclab.routing.routers import calibration_path
from speclab.trace import TraceStore, vocab_text
from speclab.zoo import display_path

MODELS = "models"  # concurrency id of every event that runs a model


class Lab:
    def __init__(self, target: Target, models: dict, store: TraceStore):
        self.target, self.models, self.store = target, models, store  # drafter models by role (speclab.methods)
        self.text = vocab_text(target.tokenizer)
        self.calibrators: dict = {}  # bench id -> speclab.routing.calibration.Calibrator (profiles loaded once)

    def header(self) -> str:
        roles = " · ".join(f"{role} `{display_path(getattr(m, 'name', '-'))}`" for role, m in self.models.items())
        return (f"# speclab · speculative decoding lab\ntarget `{display_path(self.target.name)}` · {roles} · "
                f"trace `{display_path(self.store.path)}` · calibration `{display_path(calibration_path())}` (the "
                f"zoo's where it has none) · {self.target.device.type} · {precision_label(self.target)}")

    def warm_up(self) -> None:
        """Decode a few tokens with every method once, untraced, so the first decode a user asks for streams its
        first tokens at once (cold, the first call of each code path costs most of a second on CPU)."""
        from speclab.generate import generate
        from speclab.methods import METHODS
        for name, m in METHODS.items():
            if all(self.models.get(role) is not None for role in m.needs):
                generate(self.target, "The", name, models=self.models, max_new_tokens=4)

    def run_choices(self) -> list[str]:
        return [str(r) for r in self.store.query("SELECT run_id FROM runs ORDER BY run_id DESC LIMIT 200").run_id]


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
