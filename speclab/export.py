"""Trace data as files, for the app's download buttons: a SQL result or a whole run as CSV or Parquet, a figure as
standalone HTML.

A run is one zip holding one file per table (`runs`, `rounds`, `tokens`, `draft_nodes`, `router_decisions`) and a
README naming the run and its trace. Every file is written to a temporary name in the destination folder and
renamed into place, so a failed export leaves nothing half-written behind.

Figures: one HTML page, plotly.js embedded (viewable offline). PNG comes from the camera button of plotly's
toolbar in the browser; a static PNG from Python would need kaleido, which speclab does not install.
"""
from __future__ import annotations

import io
import re
import zipfile
from pathlib import Path

import pandas as pd

from speclab.errors import InvalidInput
from speclab.files import atomic_path

FORMATS = ("csv", "parquet")

# a run's tables: the order of their rows, and what each holds (for the zip's README)
RUN_TABLES = {
    "runs": ("run_id", "the run: method, models, parameters, prompt, output, timings (one row)"),
    "rounds": ("round", "one row per round: drafter, tokens drafted / accepted / committed, phase timings (ms)"),
    "tokens": ("pos", "one row per generated token: text, who produced it (source), depth, draft / target probability"),
    "draft_nodes": ("round, node", "one row per drafted node: its parent and depth in the round's tree, accepted?"),
    "router_decisions": ("round", "one row per round: the router's policy, signal, threshold and chosen drafter"),
}


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise InvalidInput(f"unknown export format {fmt!r}: use one of {', '.join(FORMATS)}")


def _for_parquet(df: pd.DataFrame) -> pd.DataFrame:
    """What Parquet refuses, made acceptable: column names as unique strings (a SQL join repeats `run_id`:
    `run_id`, `run_id_2`), and object columns mixing value types (as text; None stays null)."""
    import pyarrow as pa

    names: list[str] = []
    for c in map(str, df.columns):
        name, i = c, 2
        while name in names:
            name, i = f"{c}_{i}", i + 1
        names.append(name)
    df = df.set_axis(names, axis=1)
    for c in [c for c in df.columns if pd.api.types.is_object_dtype(df[c])]:
        try:
            pa.array(df[c], from_pandas=True)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
            df[c] = df[c].map(lambda v: v if v is None or (isinstance(v, float) and v != v) else str(v))
    return df


def write_table(df: pd.DataFrame, path: str | Path | io.BytesIO, fmt: str) -> None:
    """`df` as CSV (no index) or Parquet at `path` (a file path or a binary buffer); not atomic by itself."""
    _check_format(fmt)
    if fmt == "csv":
        if isinstance(path, io.BytesIO):
            path.write(df.to_csv(index=False).encode("utf-8"))
        else:
            df.to_csv(path, index=False)
    else:
        _for_parquet(df).to_parquet(path, index=False)


def run_tables(store, run_id: int) -> dict[str, pd.DataFrame]:
    """The run's rows of every per-run table, by table name, in the order of RUN_TABLES."""
    run_id = int(run_id)
    if not len(store.query("SELECT 1 FROM runs WHERE run_id = ?", [run_id])):
        raise InvalidInput(f"no run {run_id} in the trace")
    return {name: store.query(f"SELECT * FROM {name} WHERE run_id = ? ORDER BY {order}", [run_id])
            for name, (order, _) in RUN_TABLES.items()}


def _readme(store, run_id: int, tables: dict[str, pd.DataFrame], fmt: str) -> str:
    run = tables["runs"].iloc[0]
    lines = [f"speclab run {run_id}: method {run['method']}, target {run['target']}, status {run['status']}",
             f"from the trace {store.path}", "", "Tables (one file each):"]
    lines += [f"  {name}.{fmt} ({len(tables[name])} rows): {about}" for name, (_, about) in RUN_TABLES.items()]
    return "\n".join(lines) + "\n"


def export_run(store, run_id: int, fmt: str, folder: str | Path) -> Path:
    """One zip `run-{id}-{fmt}.zip` in `folder`: a file per table of the run and a README.txt."""
    _check_format(fmt)
    tables = run_tables(store, run_id)
    path = Path(folder) / f"run-{int(run_id)}-{fmt}.zip"
    with atomic_path(path) as tmp, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("README.txt", _readme(store, int(run_id), tables, fmt))
        for name, df in tables.items():
            buf = io.BytesIO()
            write_table(df, buf, fmt)
            z.writestr(f"{name}.{fmt}", buf.getvalue())
    return path


def safe_name(name: str, default: str = "table") -> str:
    """`name` reduced to letters, digits, `_` and `-` (runs of anything else become one `_`)."""
    return re.sub(r"[^A-Za-z0-9_-]+", "_", name).strip("_") or default


def export_frame(df: pd.DataFrame, name: str, fmt: str, folder: str | Path) -> Path:
    """One table (a SQL result) as `{name}.{fmt}` in `folder`, the name sanitized."""
    _check_format(fmt)
    path = Path(folder) / f"{safe_name(name)}.{fmt}"
    with atomic_path(path) as tmp:
        write_table(df, tmp, fmt)
    return path


def export_figures(figs: list, title: str, name: str, folder: str | Path) -> Path:
    """Plotly figures as one standalone page `{name}.html` in `folder` (`speclab.viz.write_html_report`: plotly.js
    embedded once, viewable offline)."""
    from speclab.viz import write_html_report
    return write_html_report(Path(folder) / f"{safe_name(name, 'figures')}.html", title, figs)
