"""Files speclab writes for people (reports, calibrations, summaries): written whole or not at all.

`write_atomic` writes to a temporary file beside the target and renames it over the target, so an interrupted
or failed write (SIGTERM, a full disk) leaves the old file, or none, never half of a new one.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


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
