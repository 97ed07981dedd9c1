"""Files speclab writes for people (reports, calibrations, summaries): written whole or not at all.

`write_atomic` writes to a temporary file beside the target and renames it over the target, so an interrupted
or failed write (SIGTERM, a full disk) leaves the old file, or none, never half of a new one.
"""
from __future__ import annotations

import os
import tempfile
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


def write_atomic(path: str | Path, text: str) -> Path:
    """Write `text` (UTF-8) to `path` via a temporary file in the same folder and one rename."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
