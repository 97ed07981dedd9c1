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
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

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
    error VARCHAR, bench_id VARCHAR);
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
TABLES = ("meta", "runs", "rounds", "tokens", "draft_nodes", "router_decisions")


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

    def __init__(self, path: str | Path, read_only: bool = False):
        self.path = str(Path(path).expanduser())
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

    def writer(self, run_id: int, tokenizer, flush_rounds: int = 64) -> "RunWriter":
        return RunWriter(self, run_id, tokenizer, flush_rounds)

    # ---- reading ----
    def query(self, sql: str, params: list | None = None):
        with self._lock:
            cur = self.con.cursor()
        try:
            return cur.execute(sql, params or []).df()
        finally:
            cur.close()

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


@dataclass
class RunWriter:
    """Listener for `engine.decode`: buffers each round as arrays and appends Arrow batches."""
    store: TraceStore
    run_id: int
    tokenizer: object
    flush_rounds: int = 64
    _buf: dict[str, list] = field(default_factory=dict)
    _pending: int = 0

    def __post_init__(self):
        self.text = vocab_text(self.tokenizer)
        self._buf = {t: [] for t in ("rounds", "tokens", "draft_nodes", "router_decisions")}

    def __call__(self, ev) -> None:
        tree = ev.tree
        n, a, m = len(tree), ev.accepted.numel(), ev.committed.numel()
        acc = ev.accepted.cpu().numpy()
        node_tp = ev.node_target_probs.float().cpu().numpy()
        ent = ev.row_entropy.float().cpu().numpy()
        depth = tree.depth.cpu().numpy()
        parents = tree.parents.cpu().numpy()
        dprob = tree.draft_probs.float().cpu().numpy()
        accepted_flag = np.zeros(n, dtype=bool)
        accepted_flag[acc] = True
        r = ev.round
        self._buf["draft_nodes"].append({
            "round": np.full(n, r, np.int32), "node": np.arange(n, dtype=np.int32), "parent": parents.astype(np.int32),
            "depth": depth.astype(np.int32), "token_id": tree.tokens.cpu().numpy().astype(np.int32),
            "draft_prob": dprob.astype(np.float64), "target_prob": node_tp.astype(np.float64), "accepted": accepted_flag})
        # committed tokens: the accepted drafts then the target's own token (possibly cut by EOS / max tokens)
        ids = ev.committed.numpy().astype(np.int32)
        last_row = (acc[-1] + 1) if a else 0
        n_draft = min(a, m)
        src = np.array([ev.drafter or "target"] * n_draft + ["target"] * (m - n_draft), dtype=object)
        tok_depth = np.concatenate([depth[acc][:n_draft], np.full(m - n_draft, a + 1)]).astype(np.int32)
        d_p = np.concatenate([dprob[acc][:n_draft], np.full(m - n_draft, np.nan)])
        bonus_tp = float(ev.bonus_target_prob)
        t_p = np.concatenate([node_tp[acc][:n_draft], np.full(m - n_draft, bonus_tp)])
        t_ent = np.concatenate([ent[parents[acc] + 1][:n_draft], np.full(m - n_draft, ent[last_row])])
        self._buf["tokens"].append({
            "pos": np.arange(ev.pos0, ev.pos0 + m, dtype=np.int32), "round": np.full(m, r, np.int32), "token_id": ids,
            "text": self.text[ids], "source": src, "depth": tok_depth, "draft_prob": d_p.astype(np.float64),
            "target_prob": t_p.astype(np.float64), "entropy": t_ent.astype(np.float64)})
        t = ev.timings_ms
        self._buf["rounds"].append({
            "round": np.array([r], np.int32), "drafter": np.array([ev.drafter], dtype=object),
            "n_drafted": np.array([n], np.int32), "n_accepted": np.array([n_draft], np.int32),
            "committed": np.array([m], np.int32), "entropy": np.array([ent[0]], np.float64),
            **{f"t_{k}_ms": np.array([t[k]], np.float64) for k in ("route", "catchup", "draft", "verify", "commit")},
            "backlog": np.array([ev.backlog], np.int32), "target_calls": np.array([ev.target_calls], np.int32)})
        if ev.decision:
            d = ev.decision
            self._buf["router_decisions"].append({
                "round": np.array([r], np.int32), "policy": np.array([d.get("policy")], dtype=object),
                "signal": np.array([d.get("signal", np.nan)], np.float64),
                "threshold": np.array([d.get("threshold", np.nan)], np.float64),
                "choice": np.array([ev.drafter], dtype=object)})
        self._pending += 1
        if self._pending >= self.flush_rounds:
            self.flush()

    def flush(self) -> None:
        tables = {}
        for name, chunks in self._buf.items():
            if not chunks:
                continue
            cols = {k: np.concatenate([c[k] for c in chunks]) for k in chunks[0]}
            n = len(next(iter(cols.values())))
            arrays = {"run_id": pa.array(np.full(n, self.run_id, np.int64))}
            for k, v in cols.items():
                arrays[k] = pa.array(v, from_pandas=True)  # NaN -> NULL for probabilities a drafter lacks
            tables[name] = pa.table(arrays)
            chunks.clear()
        self._pending = 0
        if tables:
            self.store.append(tables)
