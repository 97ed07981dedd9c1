"""The trace store: every run, round, draft node, token and router decision in one DuckDB file.

Writes go through Arrow batches (row inserts run at ~1k rows/s here, Arrow at ~200k rows/s). One writer
per process (DuckDB's file lock); readers in the same process use cursors of the same connection.
A run is inserted as `running` and marked `done` / `failed`; each flush is one transaction, so a crash
mid-run never touches earlier runs. Runs still `running` when a writer opens the file were cut off by a
dead process and are marked `interrupted`.

The bulk appends and the closing update of a run go, in order, to one background thread (`speclab-trace`):
an insert costs ~10 ms whatever its size, DuckDB releases the GIL while it runs, and decoding goes on
meanwhile. Every read and every other write first waits for the queue (`drain`), so readers always see
whole runs; `close` and interpreter exit drain it too. A failed write belongs to its run: that run's writes queued
behind it are dropped and its closing update marks it `failed` with the system's reason (or, when not even that
fits, it stays `running`, then `interrupted`), never `done` with rows missing. The error is raised to that run
alone: by its next append, or by its `finish_run`, which waits for the run's writes to land; never by the writes of
the next run, which go on (and fail by themselves if the disk is full).

Read API (pandas DataFrames): `runs`, `rounds`, `tokens`, `draft_nodes`, `router_decisions`, `query`; and what the
app's pages read, each query named once: `run`, `run_ids`, `run_list`, `decoded_with`, `rounds_of`,
`tokens_with_decisions`, `phase_ms`, `text_before`, `round_drafter`. Metrics are defined once, in SQL, in
`speclab.metrics`.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import queue
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas  # noqa: F401  (pyarrow imports it on its first array: here, not inside a run's first flush)
import pyarrow as pa
import torch

from speclab.core.engine import PHASES
from speclab.errors import TraceError
from speclab.files import check_writable

SCHEMA_VERSION = 12

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key VARCHAR PRIMARY KEY, value VARCHAR);
CREATE SEQUENCE IF NOT EXISTS run_id_seq START 1;
CREATE TABLE IF NOT EXISTS runs (
    run_id BIGINT PRIMARY KEY, started_at TIMESTAMP, finished_at TIMESTAMP, method VARCHAR, target VARCHAR,
    drafters VARCHAR, router VARCHAR, params_json VARCHAR, prompt_id VARCHAR, category VARCHAR, device VARCHAR,
    dtype VARCHAR, status VARCHAR, schema_version INTEGER, prompt_text VARCHAR, prompt_tokens INTEGER,
    new_tokens INTEGER, rounds INTEGER, target_calls INTEGER, elapsed_s DOUBLE, output_text VARCHAR,
    error VARCHAR, bench_id VARCHAR, output_hash VARCHAR, peak_mem_mb DOUBLE, prefill_ms DOUBLE, wall_s DOUBLE,
    model_ms DOUBLE, diverges_at INTEGER, top2_gap DOUBLE, tie_tolerance DOUBLE, logits_dtype VARCHAR,
    exact BOOLEAN, cpu VARCHAR, eager BOOLEAN, engine VARCHAR, engine_version VARCHAR, source VARCHAR,
    decode_group VARCHAR, arrival_s DOUBLE, first_token_s DOUBLE, done_s DOUBLE, node VARCHAR, worker VARCHAR);
CREATE TABLE IF NOT EXISTS benches (
    bench_id VARCHAR PRIMARY KEY, started_at TIMESTAMP, suite VARCHAR, methods VARCHAR, config_json VARCHAR,
    device VARCHAR, trace_overhead DOUBLE, peak_rss_mb DOUBLE, status VARCHAR, cluster VARCHAR, retries INTEGER);
CREATE TABLE IF NOT EXISTS rounds (
    run_id BIGINT, round INTEGER, drafter VARCHAR, n_drafted INTEGER, n_accepted INTEGER, committed INTEGER,
    entropy DOUBLE, t_route_ms DOUBLE, t_catchup_ms DOUBLE, t_draft_ms DOUBLE, t_verify_ms DOUBLE,
    t_commit_ms DOUBLE, backlog INTEGER, target_calls INTEGER, t_record_ms DOUBLE, step INTEGER, t_s DOUBLE);
CREATE TABLE IF NOT EXISTS tokens (
    run_id BIGINT, pos INTEGER, round INTEGER, token_id INTEGER, text VARCHAR, source VARCHAR, depth INTEGER,
    draft_prob DOUBLE, target_prob DOUBLE, entropy DOUBLE, accept_prob DOUBLE);
CREATE TABLE IF NOT EXISTS draft_nodes (
    run_id BIGINT, round INTEGER, node INTEGER, parent INTEGER, depth INTEGER, token_id INTEGER,
    draft_prob DOUBLE, target_prob DOUBLE, accepted BOOLEAN, block INTEGER, bucket INTEGER, in_cands INTEGER,
    sampled_p DOUBLE, sampled_q DOUBLE);
CREATE TABLE IF NOT EXISTS router_decisions (
    run_id BIGINT, round INTEGER, policy VARCHAR, signal DOUBLE, threshold DOUBLE, choice VARCHAR);
CREATE TABLE IF NOT EXISTS adaptation (
    run_id BIGINT, stream VARCHAR, category VARCHAR, query INTEGER, policy VARCHAR, action VARCHAR, signal DOUBLE,
    pred_head DOUBLE, pred_full DOUBLE, trained VARCHAR, update_ms DOUBLE, observed_gain DOUBLE, v_head DOUBLE,
    v_full DOUBLE, reverted BOOLEAN, tau DOUBLE, tokens_per_s DOUBLE);
CREATE TABLE IF NOT EXISTS profile_sets (bench_id VARCHAR, params_json VARCHAR, prompts INTEGER);
CREATE TABLE IF NOT EXISTS profiles (
    bench_id VARCHAR, prompt_id VARCHAR, category VARCHAR, pos INTEGER, drafter VARCHAR, accepted INTEGER,
    width INTEGER, draft_ms DOUBLE);
CREATE TABLE IF NOT EXISTS profile_positions (
    bench_id VARCHAR, prompt_id VARCHAR, category VARCHAR, pos INTEGER, token_id INTEGER, entropy DOUBLE,
    prompt_tokens INTEGER, max_new_tokens INTEGER, hidden FLOAT[]);
CREATE TABLE IF NOT EXISTS engine_totals (
    run_id BIGINT, steps BIGINT, accepted BIGINT, drafted BIGINT, committed BIGINT, max_draft INTEGER);
CREATE TABLE IF NOT EXISTS engine_steps (run_id BIGINT, drafted INTEGER, accepted INTEGER, steps BIGINT);
CREATE TABLE IF NOT EXISTS steps (
    session VARCHAR, step INTEGER, t_s DOUBLE, policy VARCHAR, requests INTEGER, rows INTEGER, drafted INTEGER,
    accepted INTEGER, target_calls INTEGER, drafter_calls INTEGER, admitted INTEGER, t_prefill_ms DOUBLE,
    t_policy_ms DOUBLE, t_draft_ms DOUBLE, t_verify_ms DOUBLE, t_commit_ms DOUBLE);
"""
# columns added since schema 1 (a version-1 file opened for writing gets them; its old rows keep NULLs unless a
# step fills them in)
MIGRATIONS = {2: ["ALTER TABLE runs ADD COLUMN IF NOT EXISTS prefill_ms DOUBLE",
                  "ALTER TABLE runs ADD COLUMN IF NOT EXISTS wall_s DOUBLE",
                  "ALTER TABLE runs ADD COLUMN IF NOT EXISTS model_ms DOUBLE",
                  "ALTER TABLE runs ADD COLUMN IF NOT EXISTS diverges_at INTEGER",
                  "ALTER TABLE runs ADD COLUMN IF NOT EXISTS top2_gap DOUBLE",
                  "ALTER TABLE runs ADD COLUMN IF NOT EXISTS tie_tolerance DOUBLE",
                  "ALTER TABLE rounds ADD COLUMN IF NOT EXISTS t_record_ms DOUBLE"],
              3: [],  # schema 3 only adds tables (the profiles of speclab.routing.replay), made by SCHEMA itself
              4: ["ALTER TABLE runs ADD COLUMN IF NOT EXISTS logits_dtype VARCHAR",  # how the run computed
                  "ALTER TABLE runs ADD COLUMN IF NOT EXISTS exact BOOLEAN",  # (speclab.core.precision)
                  "ALTER TABLE runs ADD COLUMN IF NOT EXISTS cpu VARCHAR"],
              # whether the run's router caught every drafter up every round (Router.eager); older runs: from their
              # method parameters (a routed method's `eager`), false for every other run
              5: ["ALTER TABLE runs ADD COLUMN IF NOT EXISTS eager BOOLEAN",
                  "UPDATE runs SET eager = coalesce(TRY_CAST(json_extract_string(params_json, '$.eager') AS DOUBLE), 0)"
                  " > 0 WHERE eager IS NULL"],
              # per draft node, what a block-iterative drafter knows of it (SpecBlock: the block that drafted it
              # and the rank head's bucket); NULL for other drafters' nodes
              6: ["ALTER TABLE draft_nodes ADD COLUMN IF NOT EXISTS block INTEGER",
                  "ALTER TABLE draft_nodes ADD COLUMN IF NOT EXISTS bucket INTEGER"],
              7: ["ALTER TABLE draft_nodes ADD COLUMN IF NOT EXISTS in_cands INTEGER"],
              # runs imported from a serving engine (speclab.production): which engine, its version and the file;
              # NULL for speclab's own runs (the engine_* tables come with SCHEMA)
              8: ["ALTER TABLE runs ADD COLUMN IF NOT EXISTS engine VARCHAR",
                  "ALTER TABLE runs ADD COLUMN IF NOT EXISTS engine_version VARCHAR",
                  "ALTER TABLE runs ADD COLUMN IF NOT EXISTS source VARCHAR"],
              # sampled decoding: p(x) and q(x) of every node as verification tested them, and each drafted token's
              # acceptance probability min(1, p / q) (NULL at T = 0)
              9: ["ALTER TABLE draft_nodes ADD COLUMN IF NOT EXISTS sampled_p DOUBLE",
                  "ALTER TABLE draft_nodes ADD COLUMN IF NOT EXISTS sampled_q DOUBLE",
                  "ALTER TABLE tokens ADD COLUMN IF NOT EXISTS accept_prob DOUBLE"],
              # the decode that made the run (the app's Decode press, a bench's prompt): the runs decoded beside it
              # (`TraceStore.decoded_with`); NULL for older runs and single decodes (a run alone)
              10: ["ALTER TABLE runs ADD COLUMN IF NOT EXISTS decode_group VARCHAR"],
              # batched serving (`speclab serve-bench`): a request's arrival, first token and completion on its
              # session's clock (the session is its decode_group; NULL for single-stream runs), and per round the
              # batched step it was part of and when it committed (the `steps` table comes with SCHEMA)
              11: ["ALTER TABLE runs ADD COLUMN IF NOT EXISTS arrival_s DOUBLE",
                   "ALTER TABLE runs ADD COLUMN IF NOT EXISTS first_token_s DOUBLE",
                   "ALTER TABLE runs ADD COLUMN IF NOT EXISTS done_s DOUBLE",
                   "ALTER TABLE rounds ADD COLUMN IF NOT EXISTS step INTEGER",
                   "ALTER TABLE rounds ADD COLUMN IF NOT EXISTS t_s DOUBLE"],
              # benches on a Ray cluster (`speclab.cluster`): the node and worker that decoded each run, and per bench
              # the cluster and how many of its tasks were retried after a worker died (NULL: decoded in-process)
              12: ["ALTER TABLE runs ADD COLUMN IF NOT EXISTS node VARCHAR",
                   "ALTER TABLE runs ADD COLUMN IF NOT EXISTS worker VARCHAR",
                   "ALTER TABLE benches ADD COLUMN IF NOT EXISTS cluster VARCHAR",
                   "ALTER TABLE benches ADD COLUMN IF NOT EXISTS retries INTEGER"]}
# the trace explorer's run list (`TraceStore.run_list`): the newest runs with their `run_metrics` figures
RUN_LIST_SQL = """
SELECT r.run_id, strftime(r.started_at, '%Y-%m-%d %H:%M:%S') AS started, r.method,
       coalesce(r.engine || coalesce(' ' || r.engine_version, ''), 'speclab') AS engine, r.category, r.status,
       m.new_tokens AS tokens, m.rounds, m.target_calls, round(m.tau, 2) AS tau, round(m.tokens_per_s, 1) AS tok_s,
       round(r.elapsed_s, 3) AS decode_s, r.source
FROM runs r LEFT JOIN run_metrics m USING (run_id) {where} ORDER BY r.run_id DESC LIMIT ?"""

TABLES = ("meta", "runs", "rounds", "tokens", "draft_nodes", "router_decisions", "benches", "profile_sets", "profiles",
          "profile_positions", "adaptation", "engine_totals", "engine_steps")


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


def _check_path(path: str, read_only: bool, create: bool = True) -> bool:
    """Whether the trace file exists, after refusing in one line what cannot be a trace: a directory, a file that
    is not DuckDB (checked by its magic bytes, so nothing is opened, let alone written), an unreadable file, a
    missing file to read, or a folder that cannot be made for a new one (made here when `create`)."""
    if path == ":memory:":
        return False
    p = Path(path)
    if p.is_dir():
        raise TraceError(f"{path} is a directory, not a trace file: give a file path (e.g. {p / 'speclab.duckdb'})")
    if p.exists():
        try:
            with open(p, "rb") as f:
                head = f.read(12)
        except OSError as e:
            raise TraceError(f"cannot read the trace file {path}: {e.strerror}") from e
        if head[8:12] != b"DUCK":
            what = ("an empty file" if not head else "a Parquet file" if head[:4] == b"PAR1"
                    else "a file of another kind")
            raise TraceError(f"{path} is {what}: not a DuckDB database, so not a speclab trace; the file was left "
                             "untouched: choose another --db path")
        return True
    if read_only:
        raise TraceError(f"no trace database at {path}")
    try:
        check_writable(p, "the trace")
        if create:
            p.parent.mkdir(parents=True, exist_ok=True)
    except (OSError, ValueError) as e:
        raise TraceError(f"cannot create the trace {path}: {e}") from e
    return False


def _probe(path: str, read_only: bool) -> int | None:
    """The schema version of an existing trace, inspected read-only so a foreign file is never written to (a lock
    held by another process, a DuckDB file of another program, a newer schema: one line each)."""
    probe = _connect(path, read_only=True)
    tables = {r[0] for r in probe.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    version = None
    if "meta" in tables:
        row = probe.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchall()
        version = int(row[0][0]) if row else None
    probe.close()
    if tables and version is None:
        raise TraceError(f"{path} is a DuckDB file but not a speclab trace (it has tables "
                         f"{sorted(tables)[:5]} and no speclab schema_version); it was left untouched")
    if version is not None and version > SCHEMA_VERSION:
        raise TraceError(f"{path} has trace schema {version}, newer than this speclab ({SCHEMA_VERSION})")
    if read_only and version is not None and version < SCHEMA_VERSION:
        raise TraceError(f"{path} has trace schema {version}, older than this speclab's ({SCHEMA_VERSION}); "
                         "open it once for writing (e.g. TraceStore(path)) to add the new columns")
    return version


def check_trace(path: str | Path) -> None:
    """Everything `TraceStore(path)` would refuse, checked without creating or writing anything: for a command
    that loads models before it opens its trace (so a refused model leaves no trace file behind)."""
    path = str(Path(path).expanduser())
    if _check_path(path, read_only=False, create=False):
        _probe(path, read_only=False)


class TraceStore:
    """A speclab trace file. `TraceStore(path)` opens (or creates) it for writing; `read_only=True` to inspect."""

    def __init__(self, path: str | Path, read_only: bool = False, flush_rounds: int = 256, flush_s: float = 2.0):
        self.path = str(Path(path).expanduser())
        self.flush_rounds, self.flush_s = flush_rounds, flush_s  # how often run writers append (crash loses less)
        self.read_only = read_only
        version = _probe(self.path, read_only) if _check_path(self.path, read_only) else None
        self.con = _connect(self.path, read_only)
        self._lock = threading.Lock()
        self._jobs: queue.Queue | None = None  # the background writer's queue (started on the first append)
        self._error: BaseException | None = None  # a failed write of no run: raised by the store's next call
        self._failed: dict[int, BaseException] = {}  # run -> its first failed write: its later rows dropped, its
        # end written 'failed' with this reason (until its finish_run)
        self._run_errors: dict[int, BaseException] = {}  # a run's first failed write, until raised to that run
        if not read_only:
            with self._lock:
                self.con.execute("BEGIN")
                self.con.execute(SCHEMA)
                for v, steps in MIGRATIONS.items():
                    if version is not None and version < v:
                        for step in steps:
                            self.con.execute(step)
                self.con.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", [str(SCHEMA_VERSION)])
                self.con.execute("UPDATE runs SET status = 'interrupted' WHERE status = 'running'")
                from speclab.metrics import VIEWS
                for name, sql in VIEWS.items():
                    self.con.execute(f"CREATE OR REPLACE VIEW {name} AS {sql}")
                self.con.execute("COMMIT")

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self._stop_writer()
            self.con.close()

    def _stop_writer(self) -> None:
        if self._jobs is not None:
            jobs, self._jobs = self._jobs, None
            jobs.put((None, (), None, None))
            jobs.join()

    # ---- the background writer ----
    def _later(self, fn, *args, run: int | None = None, done: threading.Event | None = None) -> None:
        """Queue a write for the background writer thread (applied in order): of run `run` when it is one of a
        run's; `done` is set once it is through. An earlier failed write of the same run (or of no run) is raised
        here first, except to the run's `finish_run` (`done` given), which reports it after marking the run."""
        self._raise_error(run, runs=False, own=done is None)
        if self._jobs is None:
            self._jobs = queue.Queue()
            threading.Thread(target=self._work, args=(self._jobs,), name="speclab-trace", daemon=True).start()
            _OPEN.add(self)
        self._jobs.put((fn, args, run, done))

    def _work(self, jobs: queue.Queue) -> None:
        while True:
            fn, args, run, done = jobs.get()
            try:
                if fn is None:
                    return
                if self._error is not None:  # after a failed write of no run, every queued one is dropped
                    continue
                if run is None or run not in self._failed:
                    fn(*args)
                elif fn == self._finish_now:  # the end of a run whose rows did not all land: never 'done'
                    e = self._failed[run]
                    self._finish_now(run, "failed", {"error": f"{type(e).__name__}: {e}"})
                # (else: a later append of a failed run, dropped)
            except BaseException as e:  # kept, and raised to its run (or, of no run, by the next call)
                if run is None:
                    self._error = e
                else:
                    self._failed.setdefault(run, e)
                    self._run_errors.setdefault(run, e)
            finally:
                jobs.task_done()
                if done is not None:
                    done.set()

    def drain(self) -> None:
        """Wait until every queued write has landed (reads and synchronous writes call this first); a failed write
        not yet raised to its run is raised here."""
        if self._jobs is not None:
            self._jobs.join()
        self._raise_error()

    def _raise_error(self, run: int | None = None, runs: bool = True, own: bool = True) -> None:
        """Raise a failed write, once: of no run; else of `run` (when `own`); else of any run (when `runs`)."""
        if self._error is not None:
            e, self._error = self._error, None
        elif run is not None and own and run in self._run_errors:
            e = self._run_errors.pop(run)
        elif runs and self._run_errors:
            e = self._run_errors.pop(next(iter(self._run_errors)))
        else:
            return
        raise TraceError(f"writing the trace {self.path} failed: {e}") from e

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

    def add_finished_runs(self, metas: list[dict], tables: list[dict[str, pa.Table]]) -> list[int]:
        """Finished runs made elsewhere (imports), each a `runs` row and its tables (without run_id), in one
        transaction: all land or none. -> their run ids."""
        if self.read_only:
            raise TraceError("trace opened read-only")
        self.drain()
        ids = []
        with self._transaction():
            for meta, tbls in zip(metas, tables):
                run_id = int(self.con.execute("SELECT nextval('run_id_seq')").fetchall()[0][0])
                cols = ["run_id", "started_at", "finished_at", "status", "schema_version", *meta]
                self.con.execute(f"INSERT INTO runs ({', '.join(cols)}) VALUES (?, now(), now(), 'done', ?"
                                 f"{', ?' * len(meta)})", [run_id, SCHEMA_VERSION, *meta.values()])
                for name, tbl in tbls.items():
                    self._insert(name, tbl.add_column(0, "run_id", pa.array(np.full(tbl.num_rows, run_id, np.int64))))
                ids.append(run_id)
        return ids

    def merge_runs(self, parts: list[dict[str, pa.Table]], bench: dict | None = None) -> list[int]:
        """Runs made in other traces (a cluster's workers: `export_runs` of each), each part a table name -> Arrow
        table holding `run_id`, in one transaction with the `benches` row `bench`: all land or none, the trace as it
        was. Run ids are given anew here, in each part's order of its run ids; -> the new ids."""
        if self.read_only:
            raise TraceError("trace opened read-only")
        self.drain()
        ids: list[int] = []
        with self._transaction():
            if bench is not None:
                self.con.execute(*_row_insert("benches", bench))
            for part in parts:
                old = np.sort(np.asarray(part["runs"].column("run_id").to_numpy(), np.int64))
                new = np.array([r[0] for r in self.con.execute(
                    "SELECT nextval('run_id_seq') FROM range(?)", [len(old)]).fetchall()], np.int64)
                for name, tbl in part.items():
                    rid = np.asarray(tbl.column("run_id").to_numpy(), np.int64)
                    at = np.minimum(np.searchsorted(old, rid), len(old) - 1)
                    if len(rid) and (not len(old) or (old[at] != rid).any()):
                        raise TraceError(f"merging runs: {name} holds rows of a run the part does not have")
                    self._insert(name, tbl.set_column(tbl.schema.get_field_index("run_id"), "run_id",
                                                      pa.array(new[at], pa.int64())))
                ids += new.tolist()
        return ids

    def run_tables(self) -> list[str]:
        """The tables that hold rows of runs (a `run_id` column), `runs` among them."""
        self.drain()
        with self._lock:
            return sorted(r[0] for r in self.con.execute(
                "SELECT DISTINCT table_name FROM information_schema.columns WHERE column_name = 'run_id' "
                "AND table_name IN (SELECT table_name FROM information_schema.tables WHERE table_type = 'BASE TABLE')"
            ).fetchall())

    def export_runs(self) -> dict[str, pa.Table]:
        """Every run of this trace and its rows, table by table (`run_tables`), for `merge_runs`."""
        return {n: self.query_arrow(f"SELECT * FROM {n}") for n in self.run_tables()}

    def record_divergence(self, run_id: int, div) -> None:
        """Where a run's output first differs from AR's and the target's top-2 logit gap there
        (`speclab.equality.Divergence`), so `metrics` can tell a near-tie from a bug."""
        self.execute("UPDATE runs SET diverges_at = ?, top2_gap = ?, tie_tolerance = ? WHERE run_id = ?",
                     [div.pos, None if div.top2_gap != div.top2_gap else div.top2_gap, div.tolerance, run_id])

    def finish_run(self, run_id: int, status: str = "done", **stats) -> None:
        """Mark a run finished, queued after its rows (the status never runs ahead of them), and wait for those to
        land: a write of this run that failed makes it `failed` with the system's reason instead, and is raised
        here, to this run, not to the next run written (a run already ending with its own exception, any status
        but done, is only marked: the caller is raising that exception)."""
        if self.read_only:
            raise TraceError("trace opened read-only")
        done = threading.Event()
        self._later(self._finish_now, run_id, status, stats, run=run_id, done=done)
        done.wait()
        e = self._run_errors.pop(run_id, None)
        self._failed.pop(run_id, None)
        if e is not None and status == "done":
            raise TraceError(f"writing the trace {self.path} failed: {e}") from e

    def _finish_now(self, run_id: int, status: str, stats: dict) -> None:
        sets = ", ".join(f"{k} = ?" for k in stats)
        with self._lock:
            self.con.execute(f"UPDATE runs SET status = ?, finished_at = now(){', ' + sets if sets else ''} "
                             "WHERE run_id = ?", [status, *stats.values(), run_id])

    def execute(self, sql: str, params: list | None = None) -> None:
        if self.read_only:
            raise TraceError("trace opened read-only")
        self.drain()
        with self._lock:
            self.con.execute(sql, params or [])

    def append_row(self, table: str, **values) -> None:
        """One row (run and bench bookkeeping only; bulk data goes through `append`)."""
        self.execute(*_row_insert(table, values))

    def append(self, tables: dict[str, pa.Table | dict], run_id: int | None = None) -> None:
        """Append Arrow tables (column names = table columns; or a run writer's columns, made Arrow there) in one
        transaction, on the background writer; the rows of run `run_id` when given (a failure is then that run's:
        see `finish_run`)."""
        self._later(self._append_now, tables, run=run_id)

    def _append_now(self, tables: dict[str, pa.Table | dict]) -> None:
        tables = {name: to_arrow(t) if isinstance(t, dict) else t for name, t in tables.items()}
        with self._transaction():
            for name, tbl in tables.items():
                self._insert(name, tbl)

    @contextlib.contextmanager
    def _transaction(self):
        """One transaction under the store's lock: committed when the block ends, rolled back when it raises."""
        with self._lock:
            self.con.execute("BEGIN")
            try:
                yield
                self.con.execute("COMMIT")
            except Exception:
                # a COMMIT that failed (a full disk) has rolled back already: keep its error, not this one's
                with contextlib.suppress(Exception):
                    self.con.execute("ROLLBACK")
                raise

    def _insert(self, name: str, tbl: pa.Table) -> None:
        """Arrow table `tbl` appended to table `name` by column name (inside a `_transaction`)."""
        if tbl.num_rows:
            self.con.register("_batch", tbl)
            self.con.execute(f"INSERT INTO {name} BY NAME SELECT * FROM _batch")
            self.con.unregister("_batch")

    def writer(self, run_id: int, tokenizer) -> RunWriter:
        return RunWriter(self, run_id, tokenizer, self.flush_rounds, self.flush_s)

    # ---- reading ----
    def query(self, sql: str, params: list | None = None):
        self.drain()
        with self._lock:
            cur = self.con.cursor()
        try:
            return cur.execute(sql, params or []).df()
        finally:
            cur.close()

    def query_arrow(self, sql: str, params: list | None = None):
        """A query's result as an Arrow table (list columns such as profile hidden states without pandas)."""
        self.drain()
        with self._lock:
            cur = self.con.cursor()
        try:
            rel = cur.sql(sql, params=params or None)
            return rel.to_arrow_table() if hasattr(rel, "to_arrow_table") else rel.arrow()  # duckdb 2 / 1
        finally:
            cur.close()

    def lock_down(self) -> None:
        """No file or network access from SQL in this database (read_csv, COPY, ATTACH, URLs, extensions), and
        no configuration changes: for SQL typed by users. Irreversible for this connection."""
        self.drain()
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
        self.drain()
        sql = (sql or "").strip()
        if not sql:
            raise TraceError("the query is empty")
        try:
            with self._lock:  # the connection is shared with the trace's writer thread: one user at a time
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

    # ---- what the app's pages read (each query named once, here; unit-tested in tests/test_run_queries.py) ----
    def _value(self, sql: str, params: list):
        """The first column of the first row, None when there is no row or it is NULL."""
        import pandas as pd
        df = self.query(sql, params)
        return None if df.empty or pd.isna(df.iloc[0, 0]) else df.iloc[0, 0]

    def run(self, run_id: int):
        """The run's row (a pandas Series), None when the trace has no such run."""
        df = self.query("SELECT * FROM runs WHERE run_id = ?", [run_id])
        return None if df.empty else df.iloc[0]

    def run_ids(self, limit: int = 200) -> list[int]:
        """The newest runs' ids, newest first."""
        return [int(r) for r in self.query("SELECT run_id FROM runs ORDER BY run_id DESC LIMIT ?", [limit]).run_id]

    def run_list(self, method: str | None = None, category: str | None = None, limit: int = 500):
        """The newest runs with their figures from the `run_metrics` view (tokens, rounds, target calls, tau,
        tokens/s; rounded) and where they came from (`engine`: speclab or the imported engine and its version).
        A method name matches its specs too (`whiflash-neural` lists `whiflash-neural:threshold=0.45`)."""
        where, params = [], []
        if method:
            where.append("(r.method = ? OR split_part(r.method, ':', 1) = ?)")
            params += [str(method).strip()] * 2
        if category:
            where.append("r.category = ?")
            params.append(str(category).strip())
        return self.query(RUN_LIST_SQL.format(where=f"WHERE {' AND '.join(where)}" if where else ""),
                          [*params, limit])

    def decoded_with(self, run_id: int) -> list[int]:
        """The runs decoded with `run_id`: those of its decode group (`runs.decode_group`: one Decode press of the
        app, one prompt of a bench), itself included, in order; [run_id] for a run decoded alone (no group: a
        single decode, or a trace from before groups), never guessed from prompts or times."""
        return self.query("""SELECT o.run_id FROM runs r JOIN runs o ON o.decode_group = r.decode_group
                             WHERE r.run_id = ? ORDER BY o.run_id""", [run_id]).run_id.tolist() or [run_id]

    def rounds_of(self, run_ids: list[int]):
        """The rounds of several runs, by run and round."""
        marks = ",".join("?" * len(run_ids))
        return self.query(f"SELECT * FROM rounds WHERE run_id IN ({marks}) ORDER BY run_id, round", list(run_ids))

    def tokens_with_decisions(self, run_id: int):
        """The run's tokens, each with its round's router decision: `drafter` (the choice), `signal`, `threshold`."""
        return self.query("""SELECT t.*, d.choice AS drafter, d.signal, d.threshold FROM tokens t
                             LEFT JOIN router_decisions d USING (run_id, round) WHERE t.run_id = ? ORDER BY t.pos""",
                          [run_id])

    def phase_ms(self, run_id: int) -> dict[str, float]:
        """The run's time in each engine phase, ms summed over its rounds (0 for a run without rounds)."""
        return self.query("SELECT " + ", ".join(f"sum(t_{p}_ms) AS {p}" for p in PHASES)
                          + " FROM rounds WHERE run_id = ?", [run_id]).iloc[0].fillna(0.0).to_dict()

    def text_before(self, run_id: int, round: int) -> str | None:
        """The text of the last token committed before `round` (the root of its draft tree); None before any."""
        return self._value("SELECT text FROM tokens WHERE run_id = ? AND round < ? ORDER BY pos DESC LIMIT 1",
                           [run_id, round])

    def round_drafter(self, run_id: int, round: int) -> str | None:
        """The drafter that drafted `round` of the run; None for a round without one (or no such round)."""
        return self._value("SELECT drafter FROM rounds WHERE run_id = ? AND round = ?", [run_id, round])


_OPEN: weakref.WeakSet[TraceStore] = weakref.WeakSet()  # stores with a background writer


def _row_insert(table: str, values: dict) -> tuple[str, list]:
    """(SQL, parameters) of one bookkeeping row of `table` with `values`, started now."""
    return (f"INSERT INTO {table} ({', '.join(values)}, started_at) VALUES ({', '.join('?' * len(values))}, now())",
            list(values.values()))


@atexit.register
def _drain_open_stores() -> None:
    for store in list(_OPEN):
        try:
            store.drain()
            store._stop_writer()  # release DuckDB objects before the interpreter finalizes
        except Exception:  # exiting: nothing left to tell
            pass


_VOCAB_TEXT: dict[int, np.ndarray] = {}


def vocab_text(tokenizer) -> np.ndarray:
    """The display text of every token id, decoded once per tokenizer (no per-token work while decoding)."""
    key = id(tokenizer)
    if key not in _VOCAB_TEXT:
        n = len(tokenizer)
        _VOCAB_TEXT[key] = np.array(tokenizer.batch_decode([[i] for i in range(n)]), dtype=object)
    return _VOCAB_TEXT[key]


def _cat(xs) -> np.ndarray:
    return torch.cat(xs).cpu().numpy()


def token_columns(evs, text: np.ndarray, sampled: tuple[np.ndarray, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Per committed token of these RoundEvents: pos, round, token_id, text, source (drafter or 'target'),
    depth, draft_prob, target_prob, entropy, accept_prob (a drafted token under sampling: min(1, p(x) / q(x)), the
    probability it passed its test as its node's first candidate, token by token; block verification, a sampled
    chain's default, keeps at least as many tokens in expectation; NaN otherwise). Vectorised over rounds (one host
    copy per tensor kind, no Python per token); shared by the trace writer and live views.

    Token j < a of a round is its j-th accepted node: its target prob is the node's, its entropy that of the
    row that verified it. The target's own token (j = a, when the round was not cut before it) was drawn at
    the row after the last accepted node (row 0 without one)."""
    m = np.array([e.committed.numel() for e in evs])
    a = np.array([e.n_accepted for e in evs])
    n = np.array([len(e.tree) for e in evs])
    node_off, row_off = np.cumsum(n) - n, np.cumsum(n + 1) - (n + 1)
    start = np.repeat(np.cumsum(m) - m, m)
    within = np.arange(m.sum()) - start
    drafted = within < np.repeat(a, m)
    ids = _cat([e.committed for e in evs]).astype(np.int32)
    names = np.array([e.drafter or "target" for e in evs], dtype=object)
    node_logp, parents = _cat([e.node_logp for e in evs]), _cat([e.tree.parents for e in evs])
    entropy, bonus_logp = _cat([e.row_entropy for e in evs]), _cat([e.bonus_logp for e in evs])
    acc = _cat([e.accepted for e in evs]).astype(np.int64) + np.repeat(node_off, a)  # global node index
    has_bonus = m > a
    last_acc = np.append(acc, 0)[np.where(a > 0, np.cumsum(a) - 1, acc.size)]  # each round's last accepted node
    last = np.where(a > 0, last_acc - node_off + 1, 0)  # local row that drew the target's token
    bonus_row = (row_off + last)[has_bonus]
    target_prob, ent, draft_prob = np.empty(m.sum()), np.empty(m.sum()), np.full(m.sum(), np.nan)
    target_prob[drafted], target_prob[~drafted] = np.exp(node_logp[acc]), np.exp(bonus_logp[bonus_row])
    ent[drafted] = entropy[parents[acc] + 1 + np.repeat(row_off, a)]
    ent[~drafted] = entropy[bonus_row]
    draft_prob[drafted] = _cat([e.tree.draft_probs.float() for e in evs])[acc]
    accept_prob = np.full(m.sum(), np.nan)
    p, q = sampled if sampled is not None else _node_sampled(evs)  # the writer passes what it read for the nodes
    accept_prob[drafted] = np.minimum(1.0, p[acc] / q[acc])
    return {
        "pos": (np.repeat([e.pos0 for e in evs], m) + within).astype(np.int32),
        "round": np.repeat(np.array([e.round for e in evs], np.int32), m), "token_id": ids, "text": text[ids],
        "source": np.where(drafted, np.repeat(names, m), "target"), "depth": (within + 1).astype(np.int32),
        "draft_prob": draft_prob, "target_prob": target_prob, "entropy": ent, "accept_prob": accept_prob}


def _node_sampled(evs) -> tuple[np.ndarray, np.ndarray]:
    """p(x) and q(x) of every node of these RoundEvents under the decode's sampling (`RoundEvent.node_p` / `node_q`;
    NaN for rounds decoded greedily)."""
    def col(key: str) -> np.ndarray:
        return np.concatenate([np.full(len(e.tree), np.nan) if getattr(e, key) is None
                               else getattr(e, key).float().cpu().numpy().astype(np.float64) for e in evs] or [[]])
    return col("node_p"), col("node_q")


def decision_columns(evs) -> dict[str, np.ndarray]:
    """Per committed token of these RoundEvents, its round's router decision: drafter chosen, signal, threshold
    (what the token view shows on hover for routed runs)."""
    m = np.array([e.committed.numel() for e in evs])
    d = [e.decision for e in evs]
    return {"drafter": np.repeat(np.array([x.choice if x else None for x in d], dtype=object), m),
            "signal": np.repeat(np.array([x.signal if x else np.nan for x in d], np.float64), m),
            "threshold": np.repeat(np.array([x.threshold if x else np.nan for x in d], np.float64), m)}


# per-node integers a drafter may attach to its tree (`DraftTree.extra`): SpecBlock's block and rank bucket; with a
# FlashHead, 1 when the target's token was among the node's retrieved candidates (the engine sets it)
NODE_EXTRAS = ("block", "bucket", "in_cands")


def _node_extra(evs, key: str) -> Column:
    """An integer per draft node from the trees' `extra` (negative or absent: NULL); all NULL at once when no tree
    of the batch has it (every drafter but SpecBlock)."""
    if not any(key in e.tree.extra for e in evs):
        n = sum(len(e.tree) for e in evs)
        return Column(np.zeros(n, np.int32), np.ones(n, bool), pa.int32())
    v = np.concatenate([e.tree.extra[key].cpu().numpy().astype(np.int64) if key in e.tree.extra
                        else np.full(len(e.tree), -1, np.int64) for e in evs])
    return Column(v.astype(np.int32), v < 0, pa.int32())


class Column(NamedTuple):
    """A column a run writer hands over as numpy, made an Arrow array by the background writer (`to_arrow`): the
    decode's thread does no Arrow work. `mask` marks NULLs."""
    values: np.ndarray | list
    mask: np.ndarray | None = None
    type: pa.DataType | None = None


def to_arrow(columns: dict) -> pa.Table:
    """An Arrow table from a run writer's columns (numpy arrays and `Column`s)."""
    return pa.table({k: pa.array(v.values, type=v.type, mask=v.mask) if isinstance(v, Column) else v
                     for k, v in columns.items()})


def _nullable(v: np.ndarray) -> Column:
    """Float column with NaN stored as NULL."""
    return Column(v, np.isnan(v))


@dataclass
class RunWriter:
    """Listener for `engine.decode`: keeps each round's tensors and appends them, one transaction per flush (every
    `flush_rounds` rounds or `flush_s` seconds, and at the end of the run). A flush makes numpy columns on the
    decode's thread; the store's writer thread makes them Arrow batches and inserts them (a run's last flush, right
    after its decode, cost 15-25 ms of cold pyarrow calls a run of 128 AR tokens on the decode's thread, 2 ms warm)."""
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
        # flush the rounds already kept, then keep this one: its "record" time is still running (the engine
        # completes it after the listeners return), so it is written with the next batch
        if len(self._events) >= self.flush_rounds or (self._events and time.perf_counter() - self._last > self.flush_s):
            self.flush()
        self._events.append(ev)

    def flush(self) -> None:
        evs, self._events = self._events, []
        self._last = time.perf_counter()
        if evs:
            self.store.append(self._columns(evs), run_id=self.run_id)

    def _columns(self, evs) -> dict[str, dict]:
        """The tables' columns of these rounds, in numpy (`to_arrow` makes them Arrow on the writer's thread)."""
        n = np.array([len(e.tree) for e in evs])
        m = np.array([e.committed.numel() for e in evs])
        a = np.array([e.n_accepted for e in evs])
        rnd = np.array([e.round for e in evs], np.int32)
        node_off = np.repeat(np.cumsum(n) - n, [e.accepted.numel() for e in evs])
        accepted = np.zeros(n.sum(), dtype=bool)
        accepted[_cat([e.accepted for e in evs]).astype(np.int64) + node_off] = True
        sampled = _node_sampled(evs)
        nodes = {
            "run_id": np.full(n.sum(), self.run_id, np.int64), "round": np.repeat(rnd, n),
            "node": (np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)).astype(np.int32),
            "parent": _cat([e.tree.parents for e in evs]).astype(np.int32),
            "depth": _cat([e.tree.depth for e in evs]).astype(np.int32),
            "token_id": _cat([e.tree.tokens for e in evs]).astype(np.int32),
            "draft_prob": _nullable(_cat([e.tree.draft_probs.float() for e in evs]).astype(np.float64)),
            "target_prob": np.exp(_cat([e.node_logp for e in evs]).astype(np.float64)), "accepted": accepted,
            **{key: _node_extra(evs, key) for key in NODE_EXTRAS},
            **{k: _nullable(v) for k, v in zip(("sampled_p", "sampled_q"), sampled)}}
        cols = token_columns(evs, self.text, sampled)
        tokens = {"run_id": np.full(len(cols["pos"]), self.run_id, np.int64),
                  **{k: _nullable(v) if k in ("draft_prob", "accept_prob") else v for k, v in cols.items()}}
        t = {k: np.array([e.timings_ms[k] for e in evs]) for k in PHASES}
        rounds = {
            "run_id": np.full(len(evs), self.run_id, np.int64), "round": rnd,
            "drafter": Column([e.drafter for e in evs], type=pa.string()),
            "n_drafted": n.astype(np.int32),
            "n_accepted": a.astype(np.int32), "committed": m.astype(np.int32),
            "entropy": _cat([e.row_entropy[:1] for e in evs]).astype(np.float64),
            **{f"t_{k}_ms": v for k, v in t.items()},
            "backlog": np.array([e.backlog for e in evs], np.int32),
            "target_calls": np.array([e.target_calls for e in evs], np.int32),
            "step": Column([e.step for e in evs], type=pa.int32()),
            "t_s": Column([e.t_s for e in evs], type=pa.float64())}
        dec = [e for e in evs if e.decision is not None]
        decisions = {
            "run_id": np.full(len(dec), self.run_id, np.int64), "round": np.array([e.round for e in dec], np.int32),
            "policy": Column([e.decision.policy for e in dec], type=pa.string()),
            "signal": _nullable(np.array([e.decision.signal for e in dec], np.float64)),
            "threshold": _nullable(np.array([e.decision.threshold for e in dec], np.float64)),
            "choice": Column([e.decision.choice for e in dec], type=pa.string())}
        return {"draft_nodes": nodes, "tokens": tokens, "rounds": rounds, "router_decisions": decisions}
