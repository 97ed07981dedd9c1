"""The target and the models a method needs, by role (`speclab.methods.ROLES`, from the drafter registry),
loaded from a `ModelPaths`: what the CLI, the app and the notebooks load."""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

PRECISION_HELP = {
    "device": "cpu | cuda (default: cuda when present)",
    "dtype": "auto | fp32 | bf16 | fp16 (default auto: bf16 on CUDA; on a CPU with native bf16, per method family "
             "(AR, speculative) the dtype this machine measured faster for these models, once, kept in "
             "~/.cache/speclab/dtype-auto.json (`speclab costs dtype` re-measures); fp32 elsewhere)",
    "logits": "fp32 | model: the final norm and the head's top logits in fp32 (default; no quantised ties in "
              "verification) or logits in the model's dtype",
    "exact": "batch-invariant target forward (lean backend): a row's result never depends on how many rows run "
             "with it, so bf16 speculative output equals bf16 AR",
    "backend": "forward pass: speclab's lean forward (Llama family) or the transformers one (default: lean where "
               "it applies)",
    "drafter_weights": "auto | int8 | bf16: the drafters' bf16 weights as int8 values (W8A8 dot products, half the "
                       "bytes a drafter call reads; lossless either way: the target verifies) or as they are "
                       "(default auto: int8 on a CPU with AVX512-VNNI where the native layers run, else bf16)",
}
DRAFTER_WEIGHTS = ("auto", "int8", "bf16")


@dataclass
class ModelPaths:
    """Which models to load and how: the target (None: the zoo's), each role's model (None or absent: the zoo's)
    and the precision options. `ModelPaths()` is the zoo in the default precision (the notebooks' choice)."""
    target: str | None = None
    models: dict[str, str | None] = field(default_factory=dict)  # role -> path (speclab.methods.ROLES)
    device: str | None = None
    dtype: str = "auto"
    logits: str = "fp32"
    exact: bool = False
    backend: str = "auto"
    drafter_weights: str = "auto"  # PRECISION_HELP["drafter_weights"] (`quantize_drafter`)

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> ModelPaths:
        """From the options of `add_model_args`."""
        from speclab.methods import ROLES
        return cls(a.model, {role: getattr(a, r.dest, None) for role, r in ROLES.items()}, a.device, a.dtype,
                   a.logits, a.exact, a.backend, getattr(a, "drafter_weights", "auto"))

    def model_path(self, role: str) -> str | Path:
        """The directory the role's model loads from: its option's, or the zoo's."""
        from speclab import zoo
        from speclab.methods import ROLES
        return self.models.get(role) or zoo.model(ROLES[role].zoo)

    def absolute(self) -> ModelPaths:
        """The same with every path that exists here made absolute (for workers that start elsewhere)."""
        from dataclasses import replace

        def fix(p):
            return str(Path(p).expanduser().resolve()) if p and Path(p).expanduser().exists() else p
        return replace(self, target=fix(self.target), models={r: fix(p) for r, p in self.models.items()})

    def check(self) -> None:
        """The precision options checked before any model is loaded (one line each, InvalidInput)."""
        from speclab.core.precision import check_dtype, check_logits
        from speclab.errors import InvalidInput
        check_device(self.device)
        check_dtype(self.dtype)
        check_logits(self.logits)
        if self.backend not in ("auto", "lean", "hf"):
            raise InvalidInput(f"backend {self.backend!r}: choose auto, lean or hf")
        if self.drafter_weights not in DRAFTER_WEIGHTS:
            raise InvalidInput(f"drafter weights {self.drafter_weights!r}: choose {', '.join(DRAFTER_WEIGHTS)}")
        if self.exact and self.backend == "hf":
            raise InvalidInput("--exact needs speclab's lean forward; it cannot run with --backend hf")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model options every model-loading command shares (the CLI's and the app's): the target, one option per
    role of the registry, the precision."""
    from speclab.methods import ROLES
    p.add_argument("--model", help="target model directory or cached hub name (default: the zoo target)")
    for r in ROLES.values():
        p.add_argument(r.option, dest=r.dest, help=r.help)
    d = ModelPaths()
    p.add_argument("--device", default=d.device, help=PRECISION_HELP["device"])
    p.add_argument("--dtype", default=d.dtype, help=PRECISION_HELP["dtype"])
    p.add_argument("--logits", default=d.logits, help=PRECISION_HELP["logits"])
    p.add_argument("--exact", action="store_true", help=PRECISION_HELP["exact"])
    p.add_argument("--backend", default=d.backend, choices=["auto", "lean", "hf"], help=PRECISION_HELP["backend"])
    p.add_argument("--drafter-weights", default=d.drafter_weights, choices=DRAFTER_WEIGHTS,
                   help=PRECISION_HELP["drafter_weights"])


def check_device(device: str | None) -> None:
    """`--device`: cpu, or cuda (cuda:N) where this torch has a CUDA device; else one line (InvalidInput)."""
    import torch

    from speclab.errors import InvalidInput
    if device is None:
        return
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidInput(f"--device {device!r} is not a device: choose cpu or cuda (cuda:N)") from None
    if dev.type not in ("cpu", "cuda"):
        raise InvalidInput(f"--device {device!r}: speclab runs on cpu or cuda (cuda:N)")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            built = "built without CUDA" if torch.version.cuda is None else "no CUDA device or driver found"
            raise InvalidInput(f"--device {device!r}: this machine has no usable CUDA device (torch "
                               f"{torch.__version__}, {built}); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise InvalidInput(f"--device {device!r}: there are {torch.cuda.device_count()} CUDA device(s)")


def check_model_args(a: argparse.Namespace) -> None:
    """The precision options of a command checked before any model is loaded (`ModelPaths.check`)."""
    ModelPaths.from_args(a).check()


def available_roles(paths: ModelPaths) -> tuple[str, ...]:
    """Every role with a model to load: given by its option, or in the zoo (a drafter the zoo does not ship yet is
    left out, so the app serves the methods it has)."""
    from speclab import zoo
    from speclab.methods import ROLES
    return tuple(r for r, role in ROLES.items()
                 if paths.models.get(r) or (zoo.zoo_dir() / role.zoo / "config.json").exists())


MEASURED_ROLES = ("draft", "eagle3", "dflash")  # the drafters whose calls decide the speculative family's dtype


def resolve_dtype(paths: ModelPaths, fam: str = "speculative", log=None, remeasure: bool = False,
                  roles=()):
    """(dtype name, the `DtypeDecision` behind it or None): `paths.dtype` itself unless it is auto; auto is bf16 on
    CUDA, fp32 on a CPU without native bf16, and elsewhere this machine's decision for these models (the target
    and the drafters of `MEASURED_ROLES` it has, whatever the command loads, so every command on the machine
    agrees), read from the per-user cache or, the first time (or with `remeasure`), measured
    (`speclab.bench.costs.dtype_decision`: a few seconds) and cached. The command's own `roles` load first, so a
    model that cannot load fails in its one line before anything is timed; another role's drafter that does not
    fit this target is left out of the measurement."""
    import time
    from dataclasses import replace

    from speclab import zoo
    from speclab.core import precision as P
    from speclab.core.target import Target, pick_device
    from speclab.errors import SpeclabError
    from speclab.methods import ROLES

    if paths.dtype not in (None, "auto"):
        return paths.dtype, None
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    if pick_device(paths.device).type == "cuda":
        return "bf16", P.fixed_decision("bf16", "CUDA: bf16, the papers' setting")
    if not P.cpu_info()[1]:
        return "fp32", P.fixed_decision("fp32", "this CPU has no native bf16 (no avx512_bf16 / amx_bf16)")
    target_path = paths.target or zoo.default_target()
    measured = [r for r in MEASURED_ROLES if r in available_roles(paths)]
    keys = {"target": P.model_key(target_path), **{r: P.model_key(paths.model_path(r)) for r in measured}}
    key = P.decision_key(keys)
    d = None if remeasure else _DECIDED.get(key) or P.cached_decision(key, warn=log)
    if d is not None and d.provisional and key not in _DECIDED and P.other_load() <= P.BUSY_CORES:
        log("--dtype auto: the cached choice was measured while the machine was busy; measuring it again now that "
            "it is quiet")
        d = None
    if d is not None:
        _DECIDED[key] = d
        return d.dtype(fam), d

    def load(dt):
        p = replace(paths, dtype=dt, exact=False)
        t = Target.load(target_path, device=p.device, dtype=dt, backend=p.backend, logits=p.logits)
        models = {}
        own = [r for r in ROLES if r in roles]  # the command's own first, measured or not: their errors are its,
        # before anything is timed
        for r in own + [r for r in measured if r not in roles]:
            try:
                m = ROLES[r].load(paths.model_path(r), t, p)
            except (SpeclabError, ValueError, RuntimeError, OSError):
                if r in roles:
                    raise
                continue
            if r in measured:
                models[r] = m
        return t, models

    from speclab.bench.costs import dtype_decision
    busy = P.other_load()
    costs, samples = dtype_decision(load)
    busy = max(busy, P.other_load())
    fams = {f: c for f, c in costs.items() if f in P.FAMILIES}
    roles = {r: c for r, c in costs.items() if r not in P.FAMILIES}  # the own-dtype drafter models: a tie keeps
    # the speculative family's dtype (no reason to run apart from the target)
    role_dt = {r: fams["speculative"]["dtype"] if c["verdict"] == "tie" else c["dtype"] for r, c in roles.items()}
    d = P.DtypeDecision({f: c["dtype"] for f, c in fams.items()}, {f: _why(c) for f, c in fams.items()}, costs,
                        role_dt, {r: _why(c, own=True) for r, c in roles.items()}, key, keys, P.machine(),
                        time.strftime("measured %Y-%m-%d %H:%M"), round(busy, 2), samples=samples)
    P.store_decision(d, warn=log)
    _DECIDED[key] = d
    return d.dtype(fam), d


_DECIDED: dict = {}  # key -> the decision this process resolved: one answer per process, even with a read-only cache


def _why(c: dict, own: bool = False) -> str:
    what = {"bf16": "bf16 faster", "fp32": "fp32 faster",
            "tie": "a tie within 3%, so " + ("the target's dtype" if own else "fp32 (the exact reference)")}
    calls = "its calls of a round" if own else "a round"
    return (f"{what[c['verdict']]}: {calls} {c['bf16_ms']:.2f} ms in bf16 vs {c['fp32_ms']:.2f} in fp32, ratio "
            f"{c['ratio']:.2f} (95% CI {c['lo']:.2f}-{c['hi']:.2f}, {c['reps']} paired reps)")


def load_models(paths: ModelPaths, roles=("draft", "eagle3", "dflash", "router"), log=None,
                fam: str = "speculative"):
    """(target, models by role): the roles asked for (those the methods at hand need), each from `paths` or the
    zoo, in the order of the registry, in the dtype of `paths` (auto: `resolve_dtype` for the method family
    `fam`); one line once everything loaded, saying the dtype and, for auto, why and whether it was measured now
    or read from the cache (an error is then the first and only line a failed load prints)."""
    import time
    from dataclasses import replace

    import torch

    from speclab import zoo
    from speclab.core import pages
    from speclab.core.precision import precision_label
    from speclab.core.target import Target
    from speclab.methods import ROLES

    paths.check()
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    dtype, decision = resolve_dtype(paths, fam, log, roles=roles)
    paths = replace(paths, dtype=dtype)
    t0 = time.perf_counter()
    path = paths.target or zoo.default_target()
    target = Target.load(path, device=paths.device, dtype=paths.dtype, backend=paths.backend, logits=paths.logits,
                         exact=paths.exact)
    target.dtype_choice = decision.line(fam) if decision else None
    loaded = [f"target {zoo.display_path(path)}"]
    models = {}
    own = decision.roles if decision is not None else {}  # --dtype auto: drafter models in their own dtype
    for role, r in ROLES.items():
        if role in roles:
            path = paths.model_path(role)
            dt = own.get(role) if r.own_dtype else None
            models[role] = r.load(path, target, replace(paths, dtype=dt) if dt else paths)
            int8 = role in drafter_roles() and quantize_drafter(models[role], target, paths.drafter_weights)
            if isinstance(models[role], torch.nn.Module):  # its weights on 2 MB pages (`speclab.core.pages`)
                pages.place(models[role])
            loaded.append(f"{r.title} {zoo.display_path(path)}" + (f" ({dt})" if dt and dt != dtype else "")
                          + (" (int8 weights)" if int8 else ""))
    why = f"; {target.dtype_choice}" if target.dtype_choice else ""
    why += "".join(f"; {line}" for line in (decision.role_lines(roles) if decision is not None else []))
    log(f"loaded {', '.join(loaded)} in {time.perf_counter() - t0:.1f} s; {target.device.type}, "
        f"{precision_label(target)}{why}")
    return target, models


def drafter_roles() -> frozenset[str]:
    """The roles whose models draft (the registry's drafters'), not the routers'."""
    from speclab.drafters.registry import drafters
    return frozenset(e.model.role for e in drafters().values() if e.model is not None)


def int8_drafters(choice: str, device) -> bool:
    """Whether `--drafter-weights` `choice` makes a drafter's bf16 weights int8 on `device`: int8 where the native
    layers and their int8 product run (a CPU with AVX512-VNNI), auto the same, bf16 never."""
    from speclab.core import native
    if choice == "bf16" or str(device).split(":")[0] != "cpu":
        return False
    mod = native.build() if native.ENABLED else None
    return mod is not None and bool(mod.vnni_ok())


def quantize_drafter(model, target, choice: str = "auto") -> bool:
    """A drafter model's bf16 weights as int8 (`speclab.core.layers.quantize_int8`) where `int8_drafters` says so:
    its nn.Linear weights (EAGLE-3, DFlash, SpecBlock, ConFu) or, for a draft model (`Target`), its lean layers'
    products and head (and so its embedding, where the two are one table); never a tensor it shares with the target
    (DFlash's head is the target's). -> whether any weight was made int8."""
    import torch

    from speclab.core import layers as L
    from speclab.core.target import Target
    from speclab.drafters.flashhead import head_fingerprint
    device = getattr(model, "device", None) or next((p.device for p in model.parameters()), "cpu")
    if not int8_drafters(choice, device):
        return False
    skip = frozenset(t.data_ptr() for t in _tensors_of(target))
    if isinstance(model, Target):
        if model.lean is None:
            return False
        ws = [w for f in model.lean.layers for w in (f.qkv_w, f.o, f.gate_up, f.down)] + [model.lean.lm.weight]
        # a head tied to the embedding (the zoo draft's) is that table: its rows then read the same int8 values
    elif isinstance(model, torch.nn.Module):
        ws = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    else:
        return False
    ws = [w for w in ws if isinstance(w, torch.Tensor) and w.dtype is torch.bfloat16 and w.dim() == 2
          and w.device.type == "cpu" and w.data_ptr() not in skip]
    for w in ws:
        w._speclab_fingerprint = head_fingerprint(w)  # a FlashHead index built for it still serves it
        L.quantize_int8(w)
    return bool(ws)


def _tensors_of(target) -> list:
    """Every tensor the target's forwards read: its transformers module's and its lean forward's."""
    import torch
    out = [p for p in target.model.parameters()] if getattr(target, "model", None) is not None else []
    lean = getattr(target, "lean", None)
    if lean is not None:
        out += [t for t in vars(lean).values() if isinstance(t, torch.Tensor)]
        out += [t for f in lean.layers for t in vars(f).values() if isinstance(t, torch.Tensor)]
        out += [lean.lm.weight]
    return out


def load_bench_sets(cfg, paths: ModelPaths):
    """The models of a bench, one set per dtype its methods run in (`plan_dtypes`: --dtype, a spec's @dtype, or
    what --dtype auto chose per method family): sets cfg.methods / dtypes / dtype_why and returns (AR's target, its
    models, {dtype: (target, models)})."""
    from dataclasses import replace

    from speclab.bench.run import plan_dtypes
    from speclab.core.precision import family
    from speclab.methods import get_method

    # the bench's own models load first there: one that does not fit fails in its line before anything is timed
    _, decision = resolve_dtype(paths, roles=tuple({r for m in cfg.methods for r in get_method(m).needs}))
    cfg.methods, cfg.dtypes = plan_dtypes(cfg.methods, lambda f: decision.dtype(f) if decision else paths.dtype)
    ar = next(m for m in cfg.methods if family(m) == "ar")
    sets = {}
    for dt in dict.fromkeys([cfg.dtypes[ar], *cfg.dtypes.values()]):
        on = [m for m in cfg.methods if cfg.dtypes[m] == dt]
        roles = {r for m in on for r in get_method(m).needs} | ({"draft"} if cfg.peers and not sets else set())
        fams = [f for f in ("ar", "speculative") if decision and decision.dtype(f) == dt
                and any(family(m) == f and "@" not in m for m in on)]
        if fams:  # the auto choice of these methods' family: its load line says why
            cfg.dtype_why.update({f: decision.line(f) for f in fams})
            cfg.dtype_why.update({f"{r} model": line for r in sorted(roles) for line in decision.role_lines([r])})
            sets[dt] = load_models(paths, roles=roles, fam=fams[0])
            # a spec pinned to this dtype runs every model in it: its own set where auto put a drafter model in
            # another dtype (sps@bf16 beside sps with an fp32 draft)
            pinned = [m for m in on if "@" in m and any(decision.roles.get(r, dt) != dt for r in get_method(m).needs)]
            if pinned:
                sets[f"{dt}@"] = load_models(replace(paths, dtype=dt), roles={r for m in pinned
                                                                             for r in get_method(m).needs})
                cfg.model_sets.update(dict.fromkeys(pinned, f"{dt}@"))
        else:
            sets[dt] = load_models(replace(paths, dtype=dt), roles=roles)
    return (*sets[cfg.dtypes[ar]], sets)
