"""The embedded default models in data/zoo/: a small target LM, its draft and its EAGLE-3 drafter, trained here
(see data/zoo/README.md and data/zoo/eagle3/README.md)."""
from __future__ import annotations

import os
from pathlib import Path

from speclab.errors import ModelNotFound

REPO_ROOT = Path(__file__).resolve().parent.parent


def zoo_dir() -> Path:
    return Path(os.environ.get("SPECLAB_ZOO", REPO_ROOT / "data" / "zoo"))


def model(name: str) -> Path:
    """The zoo model data/zoo/<name> (a registry entry's default: speclab.drafters.registry.ModelRole.zoo)."""
    p = zoo_dir() / name
    if not (p / "config.json").exists():
        raise ModelNotFound(f"the zoo model '{name}' is missing at {p}; re-create the zoo with `speclab zoo build`, "
                            "or name a model with --model / --draft / --eagle / --dflash / --router-model")
    return p


def default_target() -> Path:
    return model("target")


def default_draft() -> Path:
    return model("draft")


def default_eagle3() -> Path:
    return model("eagle3")


def default_dflash() -> Path:
    return model("dflash")


def default_router() -> Path:
    return model("router")


def tokenizer_dir() -> Path:
    return zoo_dir() / "tokenizer"


def display_path(p) -> str:
    """A model or trace path as people should see it: relative to the repository when inside it, else whole (a
    trace in a temporary folder is not shown as if it lay in the repository); hub names stay as they are."""
    path = Path(str(p))
    if not path.is_absolute():
        return str(p)
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path.resolve())
