"""Files speclab writes for people (reports, calibrations, summaries): written whole or not at all.

`write_atomic` writes to a temporary file beside the target and renames it over the target, so an interrupted
or failed write (SIGTERM, a full disk) leaves the old file, or none, never half of a new one; `atomic_dir` does the
same for a folder of files (drafter checkpoints, FlashHead indexes).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def check_writable(path: str | Path, what: str = "the file") -> None:
    """`path` can be written later, checked without creating anything: not a directory, and its nearest existing
    ancestor is a folder this process may write into. Raises ValueError saying why."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise ValueError(f"{p} is a directory: give a file path for {what}")
    base = next(q for q in [p.parent, *p.parent.parents] if q.exists())
    if not base.is_dir():
        raise ValueError(f"{base} is a file, not a folder")
    if not os.access(base, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ValueError(f"permission denied writing {what} at {p}")


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside `path` for the block to write, renamed over `path` if the block succeeds and
    removed if it fails (the folder is made if missing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """A fresh folder `<path>.tmp` for the block to fill, put in place of `path` (replacing it) once the block
    succeeds: a kill never leaves half a folder at `path`."""
    out = Path(path)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    yield tmp
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def write_atomic(path: str | Path, text: str) -> Path:
    """Write `text` (UTF-8) to `path` via a temporary file in the same folder and one rename."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)
