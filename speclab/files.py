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


def cache_dir() -> Path:
    """speclab's per-user cache folder: $SPECLAB_CACHE_DIR, else $XDG_CACHE_HOME/speclab, else ~/.cache/speclab."""
    base = os.environ.get("SPECLAB_CACHE_DIR") or str(Path(os.environ.get("XDG_CACHE_HOME") or
                                                            Path.home() / ".cache") / "speclab")
    return Path(base).expanduser()


def check_writable(path: str | Path, what: str = "the file") -> None:
    """`path` can be written later: not a directory, its nearest existing ancestor a folder, and a file can really
    be made in its folder. That last is tried (`probe_folder`: the missing folders made, a file created, all removed
    again), since permission bits do not tell: root passes `os.access` everywhere, on a read-only mount or under
    /proc too. Nothing is left behind. Raises ValueError saying why."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise ValueError(f"{p} is a directory: give a file path for {what}")
    base = next(q for q in [p.parent, *p.parent.parents] if q.exists())
    if not base.is_dir():
        raise ValueError(f"{base} is a file, not a folder")
    if p.exists() and not os.access(p, os.W_OK):
        raise ValueError(f"permission denied writing {what} at {p}")
    probe_folder(p.parent, what)


def probe_folder(folder: str | Path, what: str = "the file") -> None:
    """Whether files can be written in `folder`, found by doing it: its missing folders are made, a temporary file
    is created in it and removed, then the folders this made are removed (newest first; one another process filled
    meanwhile stays). Raises ValueError naming the folder and the system's reason (read-only file system, no such
    file or directory under /proc, permission denied, no space left)."""
    folder = Path(folder).expanduser()
    made: list[Path] = []
    try:
        for q in reversed([q for q in [folder, *folder.parents] if not q.exists()]):
            try:
                q.mkdir()
            except FileExistsError:  # made meanwhile by someone else: theirs, not removed here
                continue
            except OSError as e:
                raise ValueError(f"cannot make the folder {q} for {what}: {e.strerror or e}") from e
            made.append(q)
        try:
            fd, tmp = tempfile.mkstemp(prefix=".speclab-probe.", dir=folder)
        except OSError as e:
            raise ValueError(f"cannot write {what} in {folder}: {e.strerror or e}") from e
        os.close(fd)
        os.unlink(tmp)
    finally:
        for q in reversed(made):
            with contextlib.suppress(OSError):
                q.rmdir()


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
