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
from dataclasses import dataclass, field
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
    CPU default at T > 0 where the measurement picked another (`sampled`), the values it may take (from the target:
    a tree no larger than a verification, a draft no longer than the context), the papers' GPU setting and the
    values `speclab grid` sweeps. A None default is an optional value of type `optional` (a router's threshold:
    None = calibrated)."""
    name: str
    default: int | float | str | None
    bound: Callable[[Any], Bound] = lambda target: Bound()  # target -> the allowed values
    gpu: int | float | str | None = None  # the default on CUDA (the papers' setting); None = the CPU default
    sampled: int | float | str | None = None  # the CPU default at T > 0 (measured there); None = `default`
    grid: tuple = ()  # the values `speclab grid` sweeps by default
    help: str = ""
    choices: tuple[str, ...] = ()  # a named choice (FlashHead's `head`: dense | flash) instead of a number
    when: tuple[str, str] | None = None  # (parameter, value): it applies only while that parameter has that value
    # (FlashHead's clusters, probes and margin: with head = flash); the app shows it only then
    many: bool = False  # a '+'-joined list (a routed method's arms): in a method spec, items without '=' after it
    # continue it (`route:arms=eagle3+pld+none`)
    optional: type = float  # the type of an optional value (default None): a calibrated min_match is an int

    @property
    def kind(self) -> type:
        return self.optional if self.default is None else type(self.default)

    def default_on(self, target, sampled: bool = False) -> int | float | str | None:
        """The default for `target`: the GPU preset on CUDA (where there is one), else the CPU default, the one at
        T > 0 for a `sampled` decode (where it differs)."""
        if getattr(target.device, "type", "cpu") == "cuda" and self.gpu is not None:
            return self.gpu
        return self.sampled if sampled and self.sampled is not None else self.default


SCHEMES = ("wor", "iid", "topk")  # how a tree's children are drawn at T > 0 (speclab.core.sampling.draw)


# The parameters of every model drafter that samples its drafts at T > 0 (neither changes a greedy decode): its
# temperature as a factor of the target's (`speclab.core.sampling.draft_probs`; 1 measured best on the zoo) and how
# a tree's siblings are drawn: without replacement ("wor", verified by recursive rejection without replacement),
# i.i.d. ("iid", SpecInfer) or the deterministic top-k ("topk": point masses, the drafts of a greedy decode, kept
# for comparison)
SAMPLING_PARAMS = (
    Param("draft_temp", 1.0, lambda t: Bound(0.05, 4.0),
          help="the drafter's temperature at T > 0, times the target's (its top-k / top-p too)"),
    Param("scheme", "wor", choices=SCHEMES, help="a tree's children at T > 0: wor (drawn without replacement), iid "
          "(SpecInfer) or topk (deterministic, as at T = 0)"))


# Parameters of a drafter's method that its router reads, not the drafter: `pays` and `probe`
# (`speclab.drafters.schedule`: the method stands down where drafting does not pay); `build_drafter` leaves them out
ROUTER_PARAMS = ("pays", "probe")


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
    random: Callable | None = None  # (target, seed, **kw) -> a random model of this role shaped for `target`, in
    # its dtype and on its device (what the conformance suite and smoke tests build; kw: a `Shape`'s `model`)
    call: Callable | None = None  # (target, model, ids, context) -> call(n): one drafter forward of n rows after a
    # `context`-token cache of `ids`, undone after the call, or False where no call has n rows (what
    # `speclab costs roofline | forward --by-dtype` and --dtype auto time: `speclab.bench.costs.drafter_calls`)
    own_dtype: bool = False  # its model computes apart from the target's (token ids in, logits out), so under
    # --dtype auto it runs in whichever dtype its own calls measure faster in (`precision.DtypeDecision.roles`)

    @property
    def dest(self) -> str:
        """The argparse attribute of `option`."""
        return self.option.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class TrainEntry:
    """How a drafter trains online from the frozen target (`speclab train NAME`): the module holding its config
    class, its train function and its `val_table` (named, not imported: the registry sits below `speclab.train`;
    they are imported when the command runs). The command's options are generated from the config's fields that
    `speclab.train.lm.option` declares (`speclab.cli.train`), so every default lives in the config class."""
    module: str  # "speclab.train.eagle3"
    config: str  # its config class: "Eagle3TrainConfig"
    train: str  # its train function: (config, log=) -> summary
    help: str  # the command's one-line help
    init_from: str  # what --init-from holds, as `checkpoint.check_dir` names it ("EAGLE-3 drafter")
    needs_init: str = ""  # non-empty: --init-from is required, and this says why
    check_resume: str = ""  # a function of the module: (init_from, options given) -> None; ValueError when a
    # resumed run's shape differs from the options (ConFu keeps its s, experts and top-k)

    def load(self) -> tuple[type, Callable, Callable]:
        """(config class, train function, val_table) of the module."""
        m = importlib.import_module(self.module)
        return getattr(m, self.config), getattr(m, self.train), m.val_table


@dataclass(frozen=True)
class CostBench:
    """A cost micro-benchmark of a drafter (`speclab costs NAME`): the function of `speclab.bench.costs` that
    times it, `(target, model, <axis>=[values], context=, reps=) -> DataFrame` (named: the bench sits above the
    registry), the axis it sweeps (a comma-separated option, its default and its lowest value), and how
    `bench.costs.cost_curves_report` draws it."""
    command: str  # "catchup": `speclab costs catchup`
    fn: str  # "catchup_costs"
    help: str
    axis: str  # the keyword of `fn` and the option: "backlogs" <- --backlog
    option: str  # "--backlog"
    default: str  # "1,2,4,8,16,32"
    low: int  # the smallest value allowed on the axis
    x: str  # the DataFrame column of the axis
    parts: tuple[str, ...]  # the columns drawn (those present)
    part: str  # the legend's title
    title: str
    ylabel: str  # "{context}" is replaced by --context
    xlabel: str
    low_why: str = ""  # why the axis starts at `low`, in the refusal of a smaller value


@dataclass(frozen=True)
class Shape:
    """One documented shape of a drafter (a chain, a tree, a reduced vocabulary, FlashHead...): what
    tests/test_conformance.py checks for every registered drafter (greedy equals AR in fp32 and bf16, sampling keeps
    the target's distribution, catch-up in one call equals catch-up round by round, `reset` forgets). `params`: the
    method's parameters over its defaults; `model`: the keywords of its `ModelRole.random` (a reduced vocabulary,
    a Markov head, ...)."""
    name: str  # "chain", "tree", "reduced-vocab", "flash"
    params: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)


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
    shapes: tuple[Shape, ...] = ()  # the shapes the conformance suite checks (none: one, the default parameters)
    label: str = ""  # its name in figures and tables ("EAGLE-3"); empty: `name`
    color: str = "#8c564b"  # its colour in every figure (`speclab.viz`)
    train: TrainEntry | None = None  # `speclab train NAME`; None: trained elsewhere, or nothing to train
    trainings: dict[str, TrainEntry] = field(default_factory=dict)  # more `speclab train KEY` runs of its model's
    # parts (DFlash: `dspark`, DSpark's confidence head)
    costs: tuple[CostBench, ...] = ()  # `speclab costs ...` micro-benchmarks of its own
    bench: dict = field(default_factory=dict)  # parameters its methods take in `speclab bench` (over the
    # defaults; a spec's own win), e.g. sps's chain length matched to its transformers peer's
    peer: str = ""  # the transformers implementation `speclab bench` runs beside it ("hf_assisted"), if any
    hooks: bool = False  # its drafter has round hooks (`speclab.core.protocol.RoundHooks`: target work of its own,
    # rows riding in the verification): it drafts alone, never in a merged arm (`speclab.routing.arms`)

    @property
    def title(self) -> str:
        return self.label or self.name


_REGISTERED: dict[str, DrafterEntry] = {}  # drafters registered at run time (`register`), after the modules'


@functools.cache
def _from_modules() -> dict[str, DrafterEntry]:
    entries = [importlib.import_module(m).ENTRY for m in DRAFTER_MODULES]
    return {e.name: e for e in entries}


def drafters() -> dict[str, DrafterEntry]:
    """Every registered drafter by name, in registration order (`DRAFTER_MODULES`, then `register`'s)."""
    return {**_from_modules(), **_REGISTERED}


def register(entry: DrafterEntry) -> DrafterEntry:
    """Register a drafter from outside `DRAFTER_MODULES` (a plug-in, or a test's own drafter): its methods, model
    role, colour and training then appear wherever the registry's do (`speclab.methods` reads the registry on
    every call). A name taken by another drafter, or a method name another drafter serves, is refused."""
    taken = {m for e in drafters().values() if e.name != entry.name for m in (e.name, *e.methods)}
    clash = sorted(taken & {entry.name, *entry.methods})
    if clash:
        raise ValueError(f"drafter {entry.name!r}: {', '.join(clash)} already registered")
    _REGISTERED[entry.name] = entry
    return entry


def unregister(name: str) -> None:
    """Forget a drafter `register` added (a test's cleanup)."""
    _REGISTERED.pop(name, None)


def build_drafter(name: str, target, models: dict, sampled: bool = False, **params):
    """Drafter `name` built for `target` from `models` (by role), the given parameters over its defaults (the
    GPU ones on CUDA; those at T > 0 for a `sampled` decode)."""
    e = drafters()[name]
    full = {**{p.name: p.default_on(target, sampled) for p in e.params}, **params}
    full = {k: v for k, v in full.items() if k not in ROUTER_PARAMS}
    return e.build(target, models.get(e.model.role) if e.model else None, **full)
