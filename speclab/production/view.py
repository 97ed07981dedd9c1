"""Imported runs read back from the trace, beside speclab's own: their figures in speclab's terms (tau, acceptance
rate, the accept-length histogram, per-position acceptance), the conversions each went through, and the report of
`speclab import`. Every figure is read with the SQL of `speclab.metrics`, the same for both kinds of run."""
from __future__ import annotations

import json

import pandas as pd

from speclab import viz
from speclab.metrics import ACCEPT_HISTOGRAM_SQL, POSITION_ACCEPTANCE_SQL, RUN_METRICS_SQL
from speclab.viz import Report

IMPORTED_SQL = f"""
SELECT r.run_id, r.engine, coalesce(r.engine_version, 'unknown') AS version, r.source, r.target AS model,
       json_extract_string(r.params_json, '$.scope') AS scope, CAST(m.rounds AS BIGINT) AS steps, m.tau,
       m.acceptance_rate,
       json_extract_string(r.params_json, '$.reported') AS reported, r.new_tokens, r.category
FROM runs r JOIN ({RUN_METRICS_SQL}) m USING (run_id) WHERE r.run_id IN ({{ids}}) ORDER BY r.run_id"""


def _ids(run_ids) -> str:
    return ", ".join(str(int(i)) for i in run_ids) or "NULL"


def labels(store, run_ids) -> dict[int, str]:
    """'vllm #12', 'eagle3 #3': a run's method (an import's engine) and id."""
    df = store.query(f"SELECT run_id, method FROM runs WHERE run_id IN ({_ids(run_ids)})")
    return {int(i): f"{m} #{i}" for i, m in zip(df.run_id, df.method)}


def imported_table(store, run_ids) -> pd.DataFrame:
    """One row per imported run: engine, version, file, scope, steps, speclab's tau and acceptance rate, and the
    engine's own figures as it reported them."""
    return store.query(IMPORTED_SQL.format(ids=_ids(run_ids)))


def conversions(store, run_ids) -> list[str]:
    """Every conversion the runs went through, each once, with its engine."""
    df = store.query(f"SELECT engine, params_json FROM runs WHERE run_id IN ({_ids(run_ids)}) AND engine IS NOT NULL "
                     "ORDER BY run_id")
    seen: dict[str, None] = {}
    for engine, params in zip(df.engine, df.params_json):
        for note in json.loads(params or "{}").get("conversions", []):
            seen.setdefault(f"{engine}: {note}", None)
    return list(seen)


def histogram_frame(store, run_ids) -> pd.DataFrame:
    """Per run label and accepted count: steps and their share (`accept_histogram`)."""
    df = store.query(f"""SELECT run_id, accepted, sum(steps) AS steps FROM ({ACCEPT_HISTOGRAM_SQL})
                         WHERE run_id IN ({_ids(run_ids)}) GROUP BY ALL ORDER BY run_id, accepted""")
    df["label"] = df.run_id.map(labels(store, run_ids))
    df["share"] = df.steps / df.groupby("run_id").steps.transform("sum")
    return df


def position_frame(store, run_ids) -> pd.DataFrame:
    """Per run label and depth: speclab's per-position acceptance (`position_acceptance`)."""
    df = store.query(f"SELECT * FROM ({POSITION_ACCEPTANCE_SQL}) WHERE run_id IN ({_ids(run_ids)}) "
                     "ORDER BY run_id, depth")
    df["method"] = df.run_id.map(labels(store, run_ids))
    return df


def figures(store, run_ids) -> list:
    """The accept-length histogram and per-position acceptance of the runs, side by side in each figure."""
    return [viz.accept_histogram(histogram_frame(store, run_ids)),
            viz.position_acceptance(position_frame(store, run_ids))]


def report(store, run_ids, compare=(), db: str = "") -> Report:
    """What `speclab import` shows: the imported runs in speclab's terms, the conversions, the SQL that reads them
    back, and the figures beside the `compare` runs (speclab's own)."""
    tbl = imported_table(store, run_ids)
    ids = _ids(run_ids)
    text = "\n\n".join([
        f"## Imported into {db}\n\n" + tbl.to_markdown(index=False, floatfmt=".3f"),
        "## Conversions to speclab's definitions\n\n" + "\n".join(f"- {c}" for c in conversions(store, run_ids)),
        "## Read them back\n\n```sql\n"
        f"SELECT r.run_id, r.engine, r.engine_version, r.source, m.tau, m.acceptance_rate\n"
        f"FROM runs r JOIN run_metrics m USING (run_id) WHERE r.run_id IN ({ids});\n"
        f"SELECT * FROM accept_histogram WHERE run_id IN ({ids}) ORDER BY run_id, accepted;\n"
        f"SELECT * FROM position_acceptance WHERE run_id IN ({ids}) ORDER BY run_id, depth;\n```"])
    summary = tbl.drop(columns=["reported"]).to_markdown(index=False, floatfmt=".3f")
    return Report("speclab import", text, figures(store, [*run_ids, *compare]), summary=summary)
