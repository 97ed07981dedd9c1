"""The target and the models a method needs, by role (`speclab.methods.ROLES`, from the drafter registry),
loaded from a `ModelPaths`: what the CLI, the app and the notebooks load."""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

PRECISION_HELP = {
    "device": "cpu | cuda (default: cuda when present)",
    "dtype": "auto | fp32 | bf16 | fp16 (default auto: bf16 on CUDA and on a CPU that computes bf16 natively, as "
             "measured at start; fp32 elsewhere)",
    "logits": "fp32 | model: the final norm and the head's top logits in fp32 (default; no quantised ties in "
              "verification) or logits in the model's dtype",
    "exact": "batch-invariant target forward (lean backend): a row's result never depends on how many rows run "
             "with it, so bf16 speculative output equals bf16 AR",
    "backend": "forward pass: speclab's lean forward (Llama family) or the transformers one (default: lean where "
               "it applies)",
}


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

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> ModelPaths:
        """From the options of `add_model_args`."""
        from speclab.methods import ROLES
        return cls(a.model, {role: getattr(a, r.dest, None) for role, r in ROLES.items()}, a.device, a.dtype,
                   a.logits, a.exact, a.backend)

    def model_path(self, role: str) -> str | Path:
        """The directory the role's model loads from: its option's, or the zoo's."""
        from speclab import zoo
        from speclab.methods import ROLES
        return self.models.get(role) or zoo.model(ROLES[role].zoo)

    def check(self) -> None:
        """The precision options checked before any model is loaded (one line each, InvalidInput)."""
        from speclab.core.precision import check_dtype, check_logits
        from speclab.errors import InvalidInput
        check_device(self.device)
        check_dtype(self.dtype)
        check_logits(self.logits)
        if self.backend not in ("auto", "lean", "hf"):
            raise InvalidInput(f"backend {self.backend!r}: choose auto, lean or hf")
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


def load_models(paths: ModelPaths, roles=("draft", "eagle3", "dflash", "router"), log=None):
    """(target, models by role): the roles asked for (those the methods at hand need), each from `paths` or the
    zoo, in the order of the registry; one line once everything loaded (an error is then the first and only
    line a failed load prints)."""
    import time

    from speclab import zoo
    from speclab.core.precision import auto_choice, precision_label
    from speclab.core.target import Target
    from speclab.methods import ROLES

    paths.check()
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    t0 = time.perf_counter()
    path = paths.target or zoo.default_target()
    target = Target.load(path, device=paths.device, dtype=paths.dtype, backend=paths.backend, logits=paths.logits,
                         exact=paths.exact)
    loaded = [f"target {zoo.display_path(path)}"]
    models = {}
    for role, r in ROLES.items():
        if role in roles:
            path = paths.model_path(role)
            models[role] = r.load(path, target, paths)
            loaded.append(f"{r.title} {zoo.display_path(path)}")
    why = f" ({auto_choice(target.device.type).reason})" if paths.dtype in (None, "auto") else ""
    log(f"loaded {', '.join(loaded)} in {time.perf_counter() - t0:.1f} s; {target.device.type}, "
        f"{precision_label(target)}{why}")
    return target, models
