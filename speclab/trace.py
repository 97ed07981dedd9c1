"""The trace store: every run, round, draft node, token and router decision in one DuckDB file.

Writes go through Arrow batches (row inserts run at ~1k rows/s here, Arrow at ~200k rows/s). One writer
per process (DuckDB's file lock); readers in the same process use cursors of the same connection.
A run is inserted as `running` and marked `done` / `failed`; each flush is one transaction, so a crash
mid-run never touches earlier runs. Runs still `running` when a writer opens the file were cut off by a
dead process and are marked `interrupted`.

Read API (all return pandas DataFrames): `runs`, `rounds`, `tokens`, `draft_nodes`, `router_decisions`,
`query`. Metrics are defined once, in SQL, in `speclab.metrics`.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from speclab.errors import TraceError

SCHEMA_VERSION = 1

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key VARCHAR PRIMARY KEY, value VARCHAR);
CREATE SEQUENCE IF NOT EXISTS run_id_seq START 1;
CREATE TABLE IF NOT EXISTS runs (
    run_id BIGINT PRIMARY KEY, started_at TIMESTAMP, finished_at TIMESTAMP, method VARCHAR, target VARCHAR,
    drafters VARCHAR, router VARCHAR, params_json VARCHAR, prompt_id VARCHAR, category VARCHAR, device VARCHAR,
    dtype VARCHAR, status VARCHAR, schema_version INTEGER, prompt_text VARCHAR, prompt_tokens INTEGER,
    new_tokens INTEGER, rounds INTEGER, target_calls INTEGER, elapsed_s DOUBLE, output_text VARCHAR,
    error VARCHAR, bench_id VARCHAR, output_hash VARCHAR, peak_mem_mb DOUBLE);
CREATE TABLE IF NOT EXISTS benches (
    bench_id VARCHAR PRIMARY KEY, started_at TIMESTAMP, suite VARCHAR, methods VARCHAR, config_json VARCHAR,
    device VARCHAR, trace_overhead DOUBLE, peak_rss_mb DOUBLE, status VARCHAR);
CREATE TABLE IF NOT EXISTS rounds (
    run_id BIGINT, round INTEGER, drafter VARCHAR, n_drafted INTEGER, n_accepted INTEGER, committed INTEGER,
    entropy DOUBLE, t_route_ms DOUBLE, t_catchup_ms DOUBLE, t_draft_ms DOUBLE, t_verify_ms DOUBLE,
    t_commit_ms DOUBLE, backlog INTEGER, target_calls INTEGER);
CREATE TABLE IF NOT EXISTS tokens (
    run_id BIGINT, pos INTEGER, round INTEGER, token_id INTEGER, text VARCHAR, source VARCHAR, depth INTEGER,
    draft_prob DOUBLE, target_prob DOUBLE, entropy DOUBLE);
CREATE TABLE IF NOT EXISTS draft_nodes (
    run_id BIGINT, round INTEGER, node INTEGER, parent INTEGER, depth INTEGER, token_id INTEGER,
    draft_prob DOUBLE, target_prob DOUBLE, accepted BOOLEAN);
CREATE TABLE IF NOT EXISTS router_decisions (
    run_id BIGINT, round INTEGER, policy VARCHAR, signal DOUBLE, threshold DOUBLE, choice VARCHAR);
"""
TABLES = ("meta", "runs", "rounds", "tokens", "draft_nodes", "router_decisions", "benches")


def _connect(path: str, read_only: bool):
    import duckdb

    try:
        return duckdb.connect(path, read_only=read_only)
    except duckdb.Error as e:
        msg = str(e)
        if "lock" in msg.lower():
            raise TraceError(f"trace database {path} is locked by another process ({msg.split(':', 1)[-1].strip()}); "
                             "close that program or use another --db file") from e
        if "not a valid DuckDB database" in msg:
            raise TraceError(f"{path} is not a DuckDB database (speclab traces are DuckDB files); "
                             "the file was left untouched: choose another --db path") from e
        raise TraceError(f"cannot open trace database {path}: {msg}") from e


class TraceStore:
    """A speclab trace file. `TraceStore(path)` opens (or creates) it for writing; `read_only=True` to inspect."""

    def __init__(self, path: str | Path, read_only: bool = False, flush_rounds: int = 256, flush_s: float = 2.0):
        self.path = str(Path(path).expanduser())
        self.flush_rounds, self.flush_s = flush_rounds, flush_s  # how often run writers append (crash loses less)
        self.read_only = read_only
        exists = Path(self.path).exists()
        if read_only and not exists:
            raise TraceError(f"no trace database at {self.path}")
        if exists:  # inspect read-only first, so a foreign file is never written to
            probe = _connect(self.path, read_only=True)
            tables = {r[0] for r in probe.execute("SELECT table_name FROM information_schema.tables").fetchall()}
            version = None
            if "meta" in tables:
                row = probe.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchall()
                version = int(row[0][0]) if row else None
            probe.close()
            if tables and version is None:
                raise TraceError(f"{self.path} is a DuckDB file but not a speclab trace (it has tables "
                                 f"{sorted(tables)[:5]} and no speclab schema_version); it was left untouched")
            if version is not None and version > SCHEMA_VERSION:
                raise TraceError(f"{self.path} has trace schema {version}, newer than this speclab ({SCHEMA_VERSION})")
        self.con = _connect(self.path, read_only)
        self._lock = threading.Lock()
        if not read_only:
            with self._lock:
                self.con.execute("BEGIN")
                self.con.execute(SCHEMA)
                self.con.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", [str(SCHEMA_VERSION)])
                self.con.execute("UPDATE runs SET status = 'interrupted' WHERE status = 'running'")
                from speclab.metrics import VIEWS
                for name, sql in VIEWS.items():
                    self.con.execute(f"CREATE OR REPLACE VIEW {name} AS {sql}")
                self.con.execute("COMMIT")

    def close(self) -> None:
        self.con.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- writing ----
    def start_run(self, **meta) -> int:
        if self.read_only:
            raise TraceError("trace opened read-only")
        with self._lock:
            run_id = self.con.execute("SELECT nextval('run_id_seq')").fetchall()[0][0]
            meta = {"params_json": json.dumps(meta.pop("params", {}), sort_keys=True, default=str), **meta}
            cols = ["run_id", "started_at", "status", "schema_version"] + list(meta)
            self.con.execute(
                f"INSERT INTO runs ({', '.join(cols)}) VALUES (?, now(), 'running', ?{', ?' * len(meta)})",
                [run_id, SCHEMA_VERSION, *meta.values()])
        return int(run_id)

    def finish_run(self, run_id: int, status: str = "done", **stats) -> None:
        sets = ", ".join(f"{k} = ?" for k in stats)
        with self._lock:
            self.con.execute(f"UPDATE runs SET status = ?, finished_at = now(){', ' + sets if sets else ''} WHERE run_id = ?",
                             [status, *stats.values(), run_id])

    def execute(self, sql: str, params: list | None = None) -> None:
        if self.read_only:
            raise TraceError("trace opened read-only")
        with self._lock:
            self.con.execute(sql, params or [])

    def append_row(self, table: str, **values) -> None:
        """One row (run and bench bookkeeping only; bulk data goes through `append`)."""
        cols = ", ".join(values)
        self.execute(f"INSERT INTO {table} ({cols}, started_at) VALUES ({', '.join('?' * len(values))}, now())",
                     list(values.values()))

    def append(self, tables: dict[str, pa.Table]) -> None:
        """Append Arrow tables (column names = table columns) in one transaction."""
        with self._lock:
            self.con.execute("BEGIN")
            try:
                for name, tbl in tables.items():
                    if tbl.num_rows:
                        self.con.register("_batch", tbl)
                        self.con.execute(f"INSERT INTO {name} BY NAME SELECT * FROM _batch")
                        self.con.unregister("_batch")
                self.con.execute("COMMIT")
            except Exception:
                self.con.execute("ROLLBACK")
                raise

    def writer(self, run_id: int, tokenizer) -> "RunWriter":
        return RunWriter(self, run_id, tokenizer, self.flush_rounds, self.flush_s)

    # ---- reading ----
    def query(self, sql: str, params: list | None = None):
        with self._lock:
            cur = self.con.cursor()
        try:
            return cur.execute(sql, params or []).df()
        finally:
            cur.close()

    def lock_down(self) -> None:
        """No file or network access from SQL in this database (read_csv, COPY, ATTACH, URLs, extensions), and
        no configuration changes: for SQL typed by users. Irreversible for this connection."""
        with self._lock:
            self.con.execute("SET enable_external_access = false")
            self.con.execute("SET lock_configuration = true")
        self._locked_down = True

    def safe_query(self, sql: str, max_rows: int = 1000, timeout_s: float = 5.0):
        """Run one user-typed SELECT: read-only, no file or network access, at most `max_rows` rows, stopped
        after `timeout_s` seconds. Returns (DataFrame, truncated). Raises TraceError with a clear message."""
        import duckdb
        import pandas as pd

        if not getattr(self, "_locked_down", False):
            self.lock_down()
        sql = (sql or "").strip()
        if not sql:
            raise TraceError("the query is empty")
        try:
            stmts = self.con.extract_statements(sql)
        except duckdb.Error as e:
            raise TraceError(f"invalid SQL: {e}") from e
        if len(stmts) != 1 or stmts[0].type != duckdb.StatementType.SELECT:
            kinds = ", ".join(s.type.name for s in stmts) or "nothing"
            raise TraceError(f"only a single read-only SELECT is allowed here (got {kinds})")
        with self._lock:
            cur = self.con.cursor()
        timer = threading.Timer(timeout_s, cur.interrupt)
        timer.start()
        try:
            cur.execute(sql)
            rows = cur.fetchmany(max_rows + 1)
            cols = [d[0] for d in cur.description]
        except duckdb.InterruptException as e:
            raise TraceError(f"query stopped after {timeout_s:g} s") from e
        except duckdb.Error as e:
            raise TraceError(f"query failed: {str(e).splitlines()[0]}") from e
        finally:
            timer.cancel()
            cur.close()
        return pd.DataFrame(rows[:max_rows], columns=cols), len(rows) > max_rows

    def runs(self, method: str | None = None, category: str | None = None, status: str | None = None):
        where, params = [], []
        for col, val in (("method", method), ("category", category), ("status", status)):
            if val:
                where.append(f"{col} = ?")
                params.append(val)
        w = f"WHERE {' AND '.join(where)}" if where else ""
        return self.query(f"SELECT * FROM runs {w} ORDER BY run_id", params)

    def rounds(self, run_id: int):
        return self.query("SELECT * FROM rounds WHERE run_id = ? ORDER BY round", [run_id])

    def tokens(self, run_id: int):
        return self.query("SELECT * FROM tokens WHERE run_id = ? ORDER BY pos", [run_id])

    def draft_nodes(self, run_id: int, round: int | None = None):
        if round is None:
            return self.query("SELECT * FROM draft_nodes WHERE run_id = ? ORDER BY round, node", [run_id])
        return self.query("SELECT * FROM draft_nodes WHERE run_id = ? AND round = ? ORDER BY node", [run_id, round])

    def router_decisions(self, run_id: int):
        return self.query("SELECT * FROM router_decisions WHERE run_id = ? ORDER BY round", [run_id])


_VOCAB_TEXT: dict[int, np.ndarray] = {}


def vocab_text(tokenizer) -> np.ndarray:
    """The display text of every token id, decoded once per tokenizer (no per-token work while decoding)."""
    key = id(tokenizer)
    if key not in _VOCAB_TEXT:
        n = len(tokenizer)
        _VOCAB_TEXT[key] = np.array(tokenizer.batch_decode([[i] for i in range(n)]), dtype=object)
    return _VOCAB_TEXT[key]


def token_columns(evs, text: np.ndarray) -> dict[str, np.ndarray]:
    """Per committed token of these RoundEvents: pos, round, token_id, text, source (drafter or 'target'),
    depth, draft_prob, target_prob, entropy. Vectorised over rounds; shared by the trace writer and live views."""
    cat = lambda xs: torch.cat(xs).cpu().numpy()  # noqa: E731
    m = np.array([e.committed.numel() for e in evs])
    a = np.array([e.n_accepted for e in evs])
    start = np.repeat(np.cumsum(m) - m, m)
    within = np.arange(m.sum()) - start
    ids = cat([e.committed for e in evs]).astype(np.int32)
    names = np.array([e.drafter or "target" for e in evs], dtype=object)
    return {
        "pos": (np.repeat([e.pos0 for e in evs], m) + within).astype(np.int32),
        "round": np.repeat(np.array([e.round for e in evs], np.int32), m), "token_id": ids, "text": text[ids],
        "source": np.where(within < np.repeat(a, m), np.repeat(names, m), "target"),
        "depth": cat([e.depth for e in evs]).astype(np.int32),
        "draft_prob": cat([e.draft_prob for e in evs]).astype(np.float64),
        "target_prob": cat([e.target_prob for e in evs]).astype(np.float64),
        "entropy": cat([e.entropy for e in evs]).astype(np.float64)}


@dataclass
class RunWriter:
    """Listener for `engine.decode`: keeps each round's tensors and appends them as Arrow batches, one
    transaction per flush (every `flush_rounds` rounds or `flush_s` seconds, and at the end of the run)."""
    store: TraceStore
    run_id: int
    tokenizer: object
    flush_rounds: int = 256
    flush_s: float = 2.0

    def __post_init__(self):
        self.text = vocab_text(self.tokenizer)
        self._events: list = []
        self._last = time.perf_counter()

    def __call__(self, ev) -> None:
        self._events.append(ev)
        if len(self._events) >= self.flush_rounds or time.perf_counter() - self._last > self.flush_s:
            self.flush()

    def flush(self) -> None:
        evs, self._events = self._events, []
        self._last = time.perf_counter()
        if evs:
            self.store.append(self._tables(evs))

    def _tables(self, evs) -> dict[str, pa.Table]:
        cat = lambda xs: torch.cat(xs).cpu().numpy()  # noqa: E731
        n = np.array([len(e.tree) for e in evs])
        m = np.array([e.committed.numel() for e in evs])
        a = np.array([e.n_accepted for e in evs])
        rnd = np.array([e.round for e in evs], np.int32)
        node_off = np.repeat(np.cumsum(n) - n, [e.accepted.numel() for e in evs])
        accepted = np.zeros(n.sum(), dtype=bool)
        accepted[cat([e.accepted for e in evs]).astype(np.int64) + node_off] = True
        nodes = pa.table({
            "run_id": np.full(n.sum(), self.run_id, np.int64), "round": np.repeat(rnd, n),
            "node": (np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)).astype(np.int32),
            "parent": cat([e.tree.parents for e in evs]).astype(np.int32),
            "depth": cat([e.tree.depth for e in evs]).astype(np.int32),
            "token_id": cat([e.tree.tokens for e in evs]).astype(np.int32),
            "draft_prob": pa.array(cat([e.tree.draft_probs.float() for e in evs]).astype(np.float64), from_pandas=True),
            "target_prob": cat([e.node_target_probs for e in evs]).astype(np.float64), "accepted": accepted})
        cols = token_columns(evs, self.text)
        tokens = pa.table({"run_id": np.full(len(cols["pos"]), self.run_id, np.int64),
                           **{k: pa.array(v, from_pandas=True) if k == "draft_prob" else v for k, v in cols.items()}})
        t = {k: np.array([e.timings_ms[k] for e in evs]) for k in ("route", "catchup", "draft", "verify", "commit")}
        rounds = pa.table({
            "run_id": np.full(len(evs), self.run_id, np.int64), "round": rnd,
            "drafter": pa.array([e.drafter for e in evs], pa.string()), "n_drafted": n.astype(np.int32),
            "n_accepted": a.astype(np.int32), "committed": m.astype(np.int32),
            "entropy": np.array([e.root_entropy for e in evs]), **{f"t_{k}_ms": v for k, v in t.items()},
            "backlog": np.array([e.backlog for e in evs], np.int32),
            "target_calls": np.array([e.target_calls for e in evs], np.int32)})
        dec = [e for e in evs if e.decision]
        decisions = pa.table({
            "run_id": np.full(len(dec), self.run_id, np.int64), "round": np.array([e.round for e in dec], np.int32),
            "policy": pa.array([e.decision.get("policy") for e in dec], pa.string()),
            "signal": np.array([e.decision.get("signal", np.nan) for e in dec], np.float64),
            "threshold": np.array([e.decision.get("threshold", np.nan) for e in dec], np.float64),
            "choice": pa.array([e.drafter for e in dec], pa.string())})
        return {"draft_nodes": nodes, "tokens": tokens, "rounds": rounds, "router_decisions": decisions}
