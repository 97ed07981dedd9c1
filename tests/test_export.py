"""Export: a traced run as a zip of CSV / Parquet tables that read back to the trace's rows, SQL results round-trip,
bad requests leave no file, figures are standalone HTML."""
import io
import re
import zipfile

import pandas as pd
import plotly.graph_objects as go
import pytest

from helpers import PROMPTS
from speclab import export
from speclab.errors import InvalidInput
from speclab.generate import generate
from speclab.trace import TraceStore


@pytest.fixture(scope="module")
def traced(qwen3, qwen3_draft, tmp_path_factory):
    """A trace with an AR run and then an SPS tree run (draft nodes, router decisions): (store, the SPS run's id)."""
    store = TraceStore(tmp_path_factory.mktemp("export") / "t.duckdb")
    generate(qwen3, PROMPTS[0], "ar", max_new_tokens=8, trace=store)
    res = generate(qwen3, PROMPTS[3], "sps", models={"draft": qwen3_draft}, max_new_tokens=24, trace=store, k=3,
                   tree_topk=2)
    yield store, res.run_id
    store.close()


def read_back(data: bytes, fmt: str) -> pd.DataFrame:
    return pd.read_csv(io.BytesIO(data)) if fmt == "csv" else pd.read_parquet(io.BytesIO(data))


@pytest.mark.parametrize("fmt", export.FORMATS)
def test_run_zip_holds_every_table_of_that_run_only(traced, fmt, tmp_path):
    store, rid = traced
    path = export.export_run(store, rid, fmt, tmp_path)
    assert path == tmp_path / f"run-{rid}-{fmt}.zip" and sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    with zipfile.ZipFile(path) as z:
        assert sorted(z.namelist()) == sorted([f"{t}.{fmt}" for t in export.RUN_TABLES] + ["README.txt"])
        got = {t: read_back(z.read(f"{t}.{fmt}"), fmt) for t in export.RUN_TABLES}
        readme = z.read("README.txt").decode()
    for table in export.RUN_TABLES:
        want = store.query(f"SELECT * FROM {table} WHERE run_id = ?", [rid])
        assert len(got[table]) == len(want) > 0, table
        assert list(got[table].columns) == list(want.columns) and set(got[table].run_id) == {rid}, table
    assert got["runs"].method[0] == "sps" and got["runs"].new_tokens[0] == 24
    assert got["tokens"].pos.tolist() == list(range(24))
    assert got["tokens"].token_id.tolist() == store.tokens(rid).token_id.tolist()
    nodes = store.draft_nodes(rid)
    assert got["draft_nodes"][["round", "node"]].values.tolist() == nodes[["round", "node"]].values.tolist()
    assert got["draft_nodes"].accepted.sum() == nodes.accepted.sum() == got["rounds"].n_accepted.sum()
    assert got["router_decisions"].choice.tolist() == store.router_decisions(rid).choice.tolist()
    assert f"run {rid}" in readme and "method sps" in readme and store.path in readme


@pytest.mark.parametrize("fmt", export.FORMATS)
def test_sql_result_round_trips(traced, fmt, tmp_path):
    store, _ = traced
    df = store.query("SELECT run_id, method, error, new_tokens, elapsed_s FROM runs ORDER BY run_id")
    assert df.error.isna().all()  # a text column of nulls only
    path = export.export_frame(df, "../my query: runs!", fmt, tmp_path)
    assert path == tmp_path / f"my_query_runs.{fmt}" and [p.name for p in tmp_path.iterdir()] == [path.name]
    back = pd.read_csv(path) if fmt == "csv" else pd.read_parquet(path)
    assert back.run_id.tolist() == df.run_id.tolist() and back.method.tolist() == df.method.tolist()
    assert back.error.isna().all() and back.elapsed_s.tolist() == pytest.approx(df.elapsed_s.tolist())


@pytest.mark.parametrize("fmt", export.FORMATS)
def test_awkward_frames_are_written(fmt, tmp_path):
    """Object columns holding None and mixed types, repeated column names (a SQL join), an empty result."""
    df = pd.DataFrame({"x": [1, 2], "mixed": pd.Series([3.5, "text"], dtype=object),
                       "s": pd.Series(["a", None], dtype=object), "x2": [7, 8]})
    df.columns = ["x", "mixed", "s", "x"]
    path = export.export_frame(df, "odd", fmt, tmp_path)
    back = pd.read_csv(path) if fmt == "csv" else pd.read_parquet(path)
    assert len(back) == 2 and back.iloc[:, 0].tolist() == [1, 2] and back.iloc[:, 3].tolist() == [7, 8]
    assert back.s.isna().tolist() == [False, True] and back.mixed.tolist()[1] == "text"
    empty = pd.DataFrame({"a": pd.Series([], dtype="int64"), "b": pd.Series([], dtype=object)})
    path = export.export_frame(empty, "empty", fmt, tmp_path)
    back = pd.read_csv(path) if fmt == "csv" else pd.read_parquet(path)
    assert list(back.columns) == ["a", "b"] and len(back) == 0


def test_bad_requests_leave_no_file(traced, tmp_path, monkeypatch):
    store, rid = traced
    with pytest.raises(InvalidInput, match="no run 999 in the trace"):
        export.export_run(store, 999, "csv", tmp_path)
    for call in (lambda: export.export_run(store, rid, "xlsx", tmp_path),
                 lambda: export.export_frame(pd.DataFrame({"a": [1]}), "t", "json", tmp_path)):
        with pytest.raises(InvalidInput, match="use one of csv, parquet"):
            call()

    def fail_midway(df, path, fmt):  # a failure after part of the zip is written (a full disk)
        if len(df) > 1:
            raise OSError("no space left on device")
        path.write(b"x")
    monkeypatch.setattr(export, "write_table", fail_midway)
    with pytest.raises(OSError, match="no space"):
        export.export_run(store, rid, "csv", tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_figure_is_standalone_html(tmp_path):
    fig = go.Figure(go.Bar(x=["a", "b"], y=[1, 2]), layout_title_text="Acceptance by depth")
    path = export.export_figures([fig, fig], "run 7", "acceptance by depth", tmp_path)
    html = path.read_text(encoding="utf-8")
    assert path.name == "acceptance_by_depth.html" and "Acceptance by depth" in html and "<h1>run 7</h1>" in html
    assert html.count("Plotly.newPlot") == 2  # both figures, plotly.js once
    # plotly.js is embedded: no script is loaded from anywhere (the bundle itself names cdn.plot.ly only as the
    # default topojsonURL, which geo maps alone fetch)
    assert re.findall(r"<script[^>]*\ssrc=", html) == [] and len(html) > 1_000_000
    assert "cdn.plot.ly/plotly" not in html
