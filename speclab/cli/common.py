"""What every command shares: argparse with one-line errors (`_Parser`), bounded numbers (`_num`), SIGTERM as
Ctrl-C, writable paths, prompt files, and the one report writer (`write_report`)."""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from speclab.errors import SpeclabError
from speclab.viz import Report

DEFAULT_DB = "traces/speclab.duckdb"


PROMPT_FIELDS = ("prompt", "turns", "question", "text", "problem")


def _positive_ints(text: str, option: str) -> list[int]:
    """'1,5,9' -> [1, 5, 9]; anything else is a SpeclabError naming the option (before any model is loaded)."""
    try:
        vals = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise SpeclabError(f"{option} must be positive integers separated by commas (got {text!r})")
    if twice := repeated(vals):  # one figure or one table row a value: a repeat would only measure it twice
        raise SpeclabError(f"{option} lists {', '.join(map(str, twice))} more than once (got {text!r})")
    return vals


def repeated(values: list) -> list:
    """The values a list option names more than once, sorted (a method, policy, load or row count is one row of a
    table under its name: twice would measure it twice under that name, or pool both runs as one)."""
    return sorted({v for v in values if values.count(v) > 1})


def _num(kind: type = int, lo=None, hi=None, hi_open: bool = False):
    """argparse type: a number of `kind` within [lo, hi] (finite; `speclab.checks`), else argparse's one-line error
    naming the option, the value and what is allowed."""
    from speclab.checks import Bound, check_number
    bound = Bound(lo, hi, hi_open)

    def parse(text: str):
        try:
            return check_number("value", text, kind, bound)
        except SpeclabError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {bound.describe(kind)}") from None
    parse.__name__ = kind.__name__  # argparse names the type in its own messages
    return parse


_positive_int = _num(int, 1)


def add_ray_args(p: argparse.ArgumentParser, what: str) -> None:
    """`--ray [ADDRESS]`, `--workers`, `--worker-threads`: the command's work on a Ray cluster (`speclab.cluster`)."""
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help=f"spread the work over a Ray cluster: 'local' (the default with no address) starts one on this "
                   f"machine, host:port (ray://host:port) joins a running one; {what}, and the results are merged "
                   "into one trace / table at the end")
    p.add_argument("--workers", type=_positive_int, default=None,
                   help="with --ray: how many workers (default: as many as the cluster's CPUs allow)")
    p.add_argument("--worker-threads", type=_positive_int, default=1,
                   help="with --ray: the CPUs (torch threads) of each worker (default 1)")


def cluster_args(a: argparse.Namespace):
    """The `speclab.cluster.Cluster` of `--ray` (None without it), the address checked (one line if nothing
    answers there); --workers / --worker-threads without --ray are refused."""
    if getattr(a, "ray", None) is None:
        if getattr(a, "workers", None) is not None or getattr(a, "worker_threads", 1) != 1:
            raise SpeclabError("--workers and --worker-threads go with --ray")
        return None
    from speclab.cluster import Cluster, check_address
    check_address(a.ray)
    return Cluster(a.ray, a.workers, a.worker_threads)


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors as one line, like every other error of the command line (exit code 2)."""

    def error(self, message: str):
        print(f"speclab: error: {self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


@contextlib.contextmanager
def _sigterm_interrupts():
    """Within the block SIGTERM (a scheduler, `kill`) ends a command the way Ctrl-C does: runs are marked
    interrupted, a bench too, a training run saves its weights; the caller's own handler comes back after."""
    import signal
    import threading

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _check_writable(path: str, option: str) -> None:
    """A file `path` can be written at the end of the command (nothing is created now)."""
    from speclab.files import check_writable
    try:
        check_writable(path, option)
    except ValueError as e:
        raise SpeclabError(f"{option} {path}: {e}") from e


def _read_prompts(path: str) -> list[dict]:
    """Prompts from a file: JSON Lines (field prompt / turns / question / text / problem) or one prompt per line.
    Every record is checked before anything is decoded; a bad one is reported by its line number."""
    p = Path(path)
    if not p.is_file():
        raise SpeclabError(f"no prompts file at {p.resolve()}")
    try:
        lines = p.read_bytes().decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise SpeclabError(f"{p}: not UTF-8 text (byte {e.start} cannot be decoded); prompts files are .jsonl or "
                           "plain text, one prompt per line") from e
    rows = []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if p.suffix == ".jsonl":
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise SpeclabError(f"{p} line {i}: not valid JSON ({e.msg} at column {e.colno})") from e
            text = next((r[k] for k in PROMPT_FIELDS if k in r), None) if isinstance(r, dict) else None
            text = text[0] if isinstance(text, list) and text else text
            if not isinstance(text, str) or not text.strip():
                raise SpeclabError(f"{p} line {i}: no prompt (a non-empty string in one of the fields "
                                   f"{', '.join(PROMPT_FIELDS)}); nothing was decoded")
            rows.append({"prompt": text, "prompt_id": str(r.get("id", r.get("question_id", i))),
                         "category": r.get("category"), "line": i})
        else:
            rows.append({"prompt": line, "prompt_id": str(i), "category": None, "line": i})
    if not rows:
        raise SpeclabError(f"{p} holds no prompt (it is empty or blank)")
    from speclab.generate import check_text
    for r in rows:  # text a tokenizer cannot take, before any model is loaded
        try:
            check_text(r["prompt"])
        except SpeclabError as e:
            raise SpeclabError(f"{p} line {r['line']}: {e}") from e
    return rows


def write_report(report: Report, path: str | Path | None) -> list[Path]:
    """The one way a command shows and writes its result: print its summary (its tables; the whole text when it
    has none), then write the report whole (`speclab.files.write_atomic`): a `.md` path gets the markdown and the
    HTML page beside it, any other path the HTML page (the text and the figures); None writes nothing. Returns
    the files written."""
    from speclab.files import write_atomic
    from speclab.viz import write_html_report
    print(report.summary if report.summary is not None else report.text, flush=True)
    if path is None:
        return []
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    written = []
    if path.suffix == ".md":
        written.append(write_atomic(path, report.text))
        path = path.with_suffix(".html")
    written.append(write_html_report(path, report.title, report.figs, report.text))
    print(f"\nreport: {' and '.join(map(str, written))}", flush=True)
    return written
