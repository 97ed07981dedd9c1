"""The drafter registry: every drafter declares itself once, in its own module, and the rest is generated.

A drafter module holds one `DrafterEntry` named `ENTRY`: its name, the model it drafts with (a `ModelRole`: its
CLI option, how it loads, its zoo default and its card; None for a drafter without a model, like prompt lookup),
the methods it serves and its parameters (each a `Param`: CPU default, bounds, GPU preset, grid), and how the
drafter object is built. `speclab.methods` makes the methods from these entries; the CLI's model and parameter
options, `speclab.models.load_models`, the app's controls and the bench are generated from them.

Adding a drafter = one module with its `ENTRY`, its tests, and one line in `DRAFTER_MODULES` (docs/ARCHITECTURE.md,
"Adding a drafter").
"""
from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from speclab.checks import Bound

DRAFTER_MODULES = (  # one line per drafter
    "speclab.drafters.sps",
    "speclab.drafters.pld",
    "speclab.drafters.eagle3",
    "speclab.drafters.dflash",
    "speclab.drafters.specblock",
    "speclab.drafters.confu",
)


@dataclass(frozen=True)
class Param:
    """One parameter of a drafter or a router: its CPU default (measured on the zoo, see the model cards), the
    values it may take (from the target: a tree no larger than a verification, a draft no longer than the
    context), the papers' GPU setting and the values `speclab grid` sweeps. A None default is an optional float
    (a router's threshold: None = calibrated)."""
    name: str
    default: int | float | str | None
    bound: Callable[[Any], Bound] = lambda target: Bound()  # target -> the allowed values
    gpu: int | float | str | None = None  # the default on CUDA (the papers' setting); None = the CPU default
    grid: tuple = ()  # the values `speclab grid` sweeps by default
    help: str = ""
    choices: tuple[str, ...] = ()  # a named choice (FlashHead's `head`: dense | flash) instead of a number

    @property
    def kind(self) -> type:
        return float if self.default is None else type(self.default)

    def default_on(self, target) -> int | float | None:
        """The default for `target`: the GPU preset on CUDA (where there is one), else the CPU default."""
        on_cuda = getattr(target.device, "type", "cpu") == "cuda"
        return self.gpu if on_cuda and self.gpu is not None else self.default


@dataclass(frozen=True)
class ModelRole:
    """A model a method needs, by role: the command-line option that names it, how it loads (public layout), its
    default in the zoo (data/zoo/<zoo>) and its model card."""
    role: str  # "draft", "eagle3", "dflash", "router": the key of the models dict every method is built from
    option: str  # "--eagle"
    title: str  # "EAGLE-3", in load lines
    noun: str  # "an EAGLE-3 drafter", in messages
    load: Callable  # (path, target, paths: speclab.models.ModelPaths) -> the model
    zoo: str  # the zoo's default: data/zoo/<zoo>
    card: str = ""  # the model card, relative to the repository
    help: str = ""

    @property
    def dest(self) -> str:
        """The argparse attribute of `option`."""
        return self.option.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class DrafterEntry:
    """What one drafter module declares: the drafter `name` (its method's name and the name rounds record), the
    model it drafts with, the methods it serves (name -> description), its parameters, and
    `build(target, model, **params) -> Drafter` (every parameter given: the defaults live here, not in the
    drafter's constructor). `check(params, target)` refuses combinations the bounds cannot (InvalidInput);
    `same_decode(params)` maps parameter sets that decode alike to one (parameter grids run each once)."""
    name: str
    build: Callable
    params: tuple[Param, ...]
    methods: dict[str, str]
    model: ModelRole | None = None
    check: Callable | None = None
    same_decode: Callable | None = None


@functools.cache
def drafters() -> dict[str, DrafterEntry]:
    """Every registered drafter by name, in registration order."""
    entries = [importlib.import_module(m).ENTRY for m in DRAFTER_MODULES]
    return {e.name: e for e in entries}


def build_drafter(name: str, target, models: dict, **params):
    """Drafter `name` built for `target` from `models` (by role), the given parameters over its defaults (the
    GPU ones on CUDA)."""
    e = drafters()[name]
    full = {**{p.name: p.default_on(target) for p in e.params}, **params}
    return e.build(target, models.get(e.model.role) if e.model else None, **full)
