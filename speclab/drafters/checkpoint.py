"""Drafter checkpoints on disk, whatever the drafter: a directory with `config.json` and `model.safetensors` (or
`pytorch_model.bin`), read strictly and written atomically. EAGLE-3 and DFlash both use it."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from speclab.errors import ModelNotFound
from speclab.files import atomic_dir

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def check_dir(path: str | Path, what: str) -> tuple[Path, dict, Path]:
    """(directory, its config.json, its weights file) of a drafter directory, without reading the weights;
    ModelNotFound naming `what` (e.g. "EAGLE-3 drafter") when the directory, its config or its weights are missing."""
    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        raise ModelNotFound(f"no {what} at {p.resolve()} (a directory with config.json and "
                            f"{' or '.join(WEIGHT_FILES)})")
    try:
        raw = json.loads((p / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ModelNotFound(f"{p.resolve() / 'config.json'} is not valid JSON ({e})") from e
    weights = next((p / f for f in WEIGHT_FILES if (p / f).is_file()), None)
    if weights is None:
        raise ModelNotFound(f"{p.resolve()} has no weights ({' or '.join(WEIGHT_FILES)})")
    return p, raw, weights


def read_checkpoint(path: str | Path, what: str) -> tuple[Path, dict, dict]:
    """(resolved directory, its config.json, its state dict) of a drafter directory (`check_dir`); a truncated or
    corrupt weights file is ModelNotFound naming it."""
    p, raw, weights = check_dir(path, what)
    try:
        if weights.suffix == ".safetensors":
            from safetensors.torch import load_file
            sd = load_file(str(weights))
        else:
            sd = torch.load(weights, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or corrupt file: safetensors' and torch's own errors, named
        raise ModelNotFound(f"{weights.resolve()} is truncated or corrupt ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else 'unreadable'}): the {what} cannot be read") from e
    return p, raw, sd


def load_strict(model: torch.nn.Module, sd: dict, where: Path, what: str, optional: set[str] = frozenset()) -> None:
    """Load `sd` into `model`; a missing (other than `optional`) or unexpected tensor, or a shape that differs from
    the config's, is refused by name."""
    expected = set(model.state_dict())
    missing = sorted(expected - set(sd) - set(optional))
    unexpected = sorted(set(sd) - expected)
    if missing or unexpected:
        bad = ([f"missing {', '.join(missing[:4])}"] if missing else []) + \
              ([f"unexpected {', '.join(unexpected[:4])}"] if unexpected else [])
        raise ModelNotFound(f"the weights in {where.resolve()} are not a {what} for its config.json ({'; '.join(bad)})")
    try:
        model.load_state_dict(sd, strict=False)
    except RuntimeError as e:
        raise ModelNotFound(f"the weights in {where.resolve()} do not match its config.json: "
                            f"{str(e).splitlines()[-1].strip()}") from e


def save_checkpoint(model: torch.nn.Module, config: dict, out_dir: str | Path, dtype=torch.bfloat16,
                    extra_files: dict[str, str] | None = None) -> None:
    """config.json + model.safetensors (floating tensors in `dtype`), written to a temp dir then renamed, so a
    kill never leaves half a drafter."""
    from safetensors.torch import save_file

    sd = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in model.state_dict().items()}
    with atomic_dir(out_dir) as tmp:
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)


def place(model: torch.nn.Module, path, target=None, device=None, dtype=None) -> torch.nn.Module:
    """A loaded drafter named by its path, frozen, in eval mode, on the target's device and dtype (or those given;
    CPU fp32 without a target)."""
    if target is not None:
        device, dtype = device or target.device, dtype or target.dtype
    model.name = str(path)
    return model.to(device=device or "cpu", dtype=dtype or torch.float32).eval().requires_grad_(False)


def check_fits(what: str, where: Path, target, vocab_size: int, width: int, reads: str) -> None:
    """What every drafter checks against its target: the same vocabulary, and the width of what it `reads` from the
    target (ModelNotFound naming both)."""
    if vocab_size != target.vocab_size:
        raise ModelNotFound(f"the {what} in {where} has vocabulary {vocab_size}, the target {target.vocab_size}: it "
                            "was trained for another target")
    if width != target.hidden_size:
        raise ModelNotFound(f"the {what} in {where} reads {reads} of width {width}, the target's are "
                            f"{target.hidden_size}: it was trained for another target")
