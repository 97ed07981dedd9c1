"""The target and the drafter models by role (`speclab.methods.ROLES`), loaded from command-line options or the
zoo: shared by the CLI and the app."""
from __future__ import annotations

import argparse
import sys


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model options every model-loading command shares (the CLI's and the app's)."""
    p.add_argument("--model", help="target model directory or cached hub name (default: the zoo target)")
    p.add_argument("--draft", help="draft model for sps (default: the zoo draft)")
    p.add_argument("--eagle", help="EAGLE-3 drafter directory for eagle3 (public layout; default: the zoo's)")
    p.add_argument("--dflash", help="DFlash drafter directory for dflash (public layout; default: the zoo's)")
    p.add_argument("--router-model", help="neural router directory for whiflash-neural (default: the zoo's)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when present)")
    p.add_argument("--dtype", default="auto", help="auto | fp32 | bf16 | fp16 (default auto: bf16 on CUDA and on a CPU "
                   "that computes bf16 natively, as measured at start; fp32 elsewhere)")
    p.add_argument("--logits", default="fp32", help="fp32 | model: the final norm and the head's top logits in fp32 "
                   "(default; no quantised ties in verification) or logits in the model's dtype")
    p.add_argument("--exact", action="store_true", help="batch-invariant target forward (lean backend): a row's "
                   "result never depends on how many rows run with it, so bf16 speculative output equals bf16 AR")
    p.add_argument("--backend", default="auto", choices=["auto", "lean", "hf"],
                   help="forward pass: speclab's lean forward (Llama family) or the transformers one (default: lean "
                        "where it applies)")


def model_args(**options) -> argparse.Namespace:
    """The model options with their command-line defaults (the zoo, `--dtype auto`, ...), `options` overriding
    some: for `load_models` outside the CLI (the notebooks)."""
    p = argparse.ArgumentParser()
    add_model_args(p)
    a = p.parse_args([])
    for k, v in options.items():
        if not hasattr(a, k):
            raise TypeError(f"model_args: no option {k!r}")
        setattr(a, k, v)
    return a


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
            raise InvalidInput(f"--device {device!r}: this machine has no usable CUDA device (torch {torch.__version__}, "
                               f"{built}); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise InvalidInput(f"--device {device!r}: there are {torch.cuda.device_count()} CUDA device(s)")


def check_model_args(a: argparse.Namespace) -> None:
    """The precision options checked before any model is loaded (one line each, InvalidInput)."""
    from speclab.errors import InvalidInput
    from speclab.core.precision import check_dtype, check_logits
    check_device(a.device)
    check_dtype(a.dtype)
    check_logits(a.logits)
    if a.exact and a.backend == "hf":
        raise InvalidInput("--exact needs speclab's lean forward; it cannot run with --backend hf")


def load_models(a: argparse.Namespace, roles=("draft", "eagle3", "dflash", "router"), log=None):
    """(target, drafter models by role) from the options of `add_model_args`: the roles asked for (those the
    methods at hand need), each from its option or the zoo."""
    import time

    from speclab import zoo
    from speclab.core.target import Target

    check_model_args(a)
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    t0 = time.perf_counter()
    path = a.model or zoo.default_target()
    target = Target.load(path, device=a.device, dtype=a.dtype, backend=a.backend, logits=a.logits, exact=a.exact)
    loaded = [f"target {zoo.display_path(path)}"]
    models = {}
    if "draft" in roles:
        path = a.draft or zoo.default_draft()
        models["draft"] = Target.load(path, device=a.device, dtype=a.dtype, backend=a.backend, logits=a.logits)
        loaded.append(f"draft {zoo.display_path(path)}")
    if "eagle3" in roles:
        from speclab.drafters.eagle3 import load_eagle3
        path = getattr(a, "eagle", None) or zoo.default_eagle3()
        models["eagle3"] = load_eagle3(path, target)
        loaded.append(f"EAGLE-3 {zoo.display_path(path)}")
    if "dflash" in roles:
        from speclab.drafters.dflash import load_dflash
        path = getattr(a, "dflash", None) or zoo.default_dflash()
        models["dflash"] = load_dflash(path, target)
        loaded.append(f"DFlash {zoo.display_path(path)}")
    if "router" in roles:
        from speclab.routing.routers import load_router
        path = getattr(a, "router_model", None) or zoo.default_router()
        models["router"] = load_router(path, target)
        loaded.append(f"router {zoo.display_path(path)}")
    # one line, once everything loaded (an error is then the first and only line a failed load prints)
    from speclab.core.precision import auto_choice, precision_label
    why = f" ({auto_choice(target.device.type).reason})" if a.dtype in (None, "auto") else ""
    log(f"loaded {', '.join(loaded)} in {time.perf_counter() - t0:.1f} s; {target.device.type}, "
        f"{precision_label(target)}{why}")
    return target, models
