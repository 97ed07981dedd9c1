"""Bad input, round 2 (the classes that apply to every command): a device the machine does not have, an unknown
dtype or logits mode, contradicting options, trace and report paths that cannot be, files of the wrong kind and
text a tokenizer cannot take. Each is one line on stderr, exit code 2, nothing on stdout, no file touched or made,
and it comes before any model is loaded."""
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from helpers import PROMPTS, assert_one_error_line, error_lines, run_cli, save_bert
from speclab.zoo import REPO_ROOT

ZOO = REPO_ROOT / "data" / "zoo"

# every command that loads models, with the options it needs to get as far as its checks
MODEL_COMMANDS = {
    "generate": ["generate", "--prompt", PROMPTS[0], "--max-new-tokens", "4"],
    "bench": ["bench", "--limit", "1", "--max-new-tokens", "4"],
    "grid": ["grid", "--method", "sps", "--grid", "k=2", "--limit", "1"],
    "costs forward": ["costs", "forward"],
    "costs catchup": ["costs", "catchup"],
    "costs switch": ["costs", "switch"],
    "costs block": ["costs", "block"],
    "costs contemplate": ["costs", "contemplate"],
    "costs roofline": ["costs", "roofline"],
    "costs step": ["costs", "step"],
    "costs llamacpp": ["costs", "llamacpp", "--limit", "1", "--tokens", "4"],
    "costs route": ["costs", "route", "--prompts", "1", "--new-tokens", "4"],
    "profile": ["profile"],
    "sweep": ["sweep", "--router", "entropy"],
    "calibrate": ["calibrate"],
    "routing": ["routing"],
    "route-table": ["route-table", "--limit", "1", "--max-new-tokens", "4"],
}
DB_COMMANDS = {**{k: v for k, v in MODEL_COMMANDS.items() if k in ("generate", "bench", "profile", "sweep", "calibrate",
                                                                    "routing")},
               "stats": ["stats"]}
REPORT_COMMANDS = {k: v for k, v in MODEL_COMMANDS.items() if k not in ("generate", "profile")}

no_cuda = "cuda:99" if torch.cuda.is_available() else "cuda"
MODEL_CASES = [  # (case, argv, what the one line says)
    ("device-absent", ["--device", no_cuda], "--device '" + no_cuda + "'"),
    ("device-unknown", ["--device", "tpu9"], "--device 'tpu9' is not a device"),
    ("device-other", ["--device", "meta"], "speclab runs on cpu or cuda"),
    ("dtype-unknown", ["--dtype", "bf17"], "--dtype 'bf17' is not a dtype speclab runs in"),
    ("logits-unknown", ["--logits", "half"], "--logits 'half'"),
    ("exact-with-hf", ["--exact", "--backend", "hf"], "--exact needs speclab's lean forward"),
]
DB_CASES = [
    ("db-directory", "{dir}", "is a directory, not a trace file"),
    ("db-parquet", "{parquet}", "is a Parquet file: not a DuckDB database"),
    ("db-empty", "{empty}", "is an empty file: not a DuckDB database"),
    ("db-binary", "{binary}", "is a file of another kind: not a DuckDB database"),
    ("db-under-a-file", "{binary}/t.duckdb", ("is a file, not a folder", "no trace database at")),
]


@pytest.fixture
def files(tmp_path):
    """A folder, a Parquet file, an empty file and a binary one, and a snapshot of the folder to compare after."""
    (tmp_path / "dir").mkdir()
    pq.write_table(pa.table({"a": [1, 2]}), tmp_path / "t.parquet")
    (tmp_path / "empty.duckdb").write_bytes(b"")
    (tmp_path / "binary.duckdb").write_bytes(bytes(range(256)) * 8)
    names = {"dir": tmp_path / "dir", "parquet": tmp_path / "t.parquet", "empty": tmp_path / "empty.duckdb",
             "binary": tmp_path / "binary.duckdb"}
    return names, _snapshot(tmp_path)


def _snapshot(root):
    return {str(p): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("cmd", list(MODEL_COMMANDS))
@pytest.mark.parametrize("case,argv,says", MODEL_CASES, ids=[c[0] for c in MODEL_CASES])
def test_model_options_are_checked_before_anything(cmd, case, argv, says, files, tmp_path, capsys):
    db = ["--db", str(tmp_path / "new.duckdb")] if cmd in DB_COMMANDS else []
    report = ["--report", str(tmp_path / "out" / "r.html")] if cmd in REPORT_COMMANDS else []
    assert_one_error_line(MODEL_COMMANDS[cmd] + db + report + argv, says, capsys)
    assert _snapshot(tmp_path) == files[1]  # no trace, no report folder, nothing


@pytest.mark.parametrize("cmd", list(DB_COMMANDS))
@pytest.mark.parametrize("case,path,says", DB_CASES, ids=[c[0] for c in DB_CASES])
def test_trace_paths_that_cannot_be(cmd, case, path, says, files, tmp_path, capsys):
    names = {k: str(v) for k, v in files[0].items()}
    assert_one_error_line(DB_COMMANDS[cmd] + ["--db", path.format(**names)], says, capsys)
    assert _snapshot(tmp_path) == files[1]  # the foreign files are untouched


@pytest.mark.parametrize("cmd", list(REPORT_COMMANDS))
def test_report_paths_that_cannot_be(cmd, files, tmp_path, capsys):
    names = files[0]
    db = ["--db", str(tmp_path / "new.duckdb")] if cmd in DB_COMMANDS else []
    assert_one_error_line(MODEL_COMMANDS[cmd] + db + ["--report", f"{names['binary']}/r.html"],
                          "is a file, not a folder", capsys)
    assert_one_error_line(MODEL_COMMANDS[cmd] + db + ["--report", str(names["dir"])], "is a directory", capsys)
    assert _snapshot(tmp_path) == files[1]


@pytest.mark.parametrize("how", ["prompt", "prompts-file"])
def test_text_a_tokenizer_cannot_take(how, tmp_path, capsys):
    """A lone surrogate (a JSON escape \\ud800, or bytes that are not UTF-8 on the command line) is one line,
    before any model is loaded."""
    if how == "prompt":
        argv = ["--prompt", "a \udced b"]
        says = "UTF-8 cannot encode"
    else:
        f = tmp_path / "p.jsonl"
        f.write_text('{"prompt": "fine"}\n{"prompt": "a \\ud800 b"}\n')
        argv = ["--prompts", str(f)]
        says = "line 2: the prompt has a character UTF-8 cannot encode"
    assert_one_error_line(["generate", "--db", str(tmp_path / "t.duckdb"), *argv], says, capsys)
    assert not (tmp_path / "t.duckdb").exists()


@pytest.mark.parametrize("role", ["model", "draft", "eagle3", "dflash", "router"])
def test_a_truncated_model_file_is_named_in_one_line(role, model_dir, tmp_path, capsys):
    """A model or drafter whose weights file was cut short (a copy interrupted, a full disk): one line naming the
    file, no traceback."""
    import shutil

    from speclab import zoo
    src = {"model": model_dir["qwen3"], "draft": model_dir["qwen3_draft"], "eagle3": zoo.default_eagle3(),
           "dflash": zoo.default_dflash(), "router": zoo.default_router()}[role]
    bad = tmp_path / role
    shutil.copytree(src, bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    option = {"model": "--model", "draft": "--draft", "eagle3": "--eagle", "dflash": "--dflash",
              "router": "--router-model"}[role]
    method = {"model": "ar", "draft": "sps", "eagle3": "eagle3", "dflash": "dflash", "router": "whiflash-neural"}[role]
    base = ["--model", str(model_dir["qwen3"])] if role not in ("model", "router") else []  # the router: the zoo's
    assert_one_error_line(["generate", "--prompt", PROMPTS[0], "--db", "none", "--method", method, *base, option,
                           str(bad)], ("truncated or corrupt",), capsys)


# numbers out of range, nan, inf or not numbers; specs naming an unknown method, parameter, router or suite; options
# that contradict each other: per command, one line naming the option, the value and what is allowed
CASES = [
    ("serve-bench", ["--concurrency", "0,2"], "--concurrency must be positive integers"),
    ("serve-bench", ["--concurrency", "4,2,4"], "--concurrency lists 4 more than once"),
    ("serve-bench", ["--rate", "2,2"], "--rate lists a rate more than once"),
    ("serve-bench", ["--policy", "none", "--policy", "dspark", "--policy", "none"],
     "--policy none given more than once"),
    ("serve-bench", ["--concurrency", "128"], "--concurrency 128 is above --max-batch 64"),
    ("serve-bench", ["--rate", "2", "--concurrency", "4"], "give one of them"),
    ("serve-bench", ["--rate", "0"], "--rate must be"),
    ("serve-bench", ["--policy", "nope"], "unknown policy 'nope'"),
    ("serve-bench", ["--policy", "fixed:k=-1"], "fixed k must be"),
    ("serve-bench", ["--policy", "table:1-4=2,3-8=1"], "overlaps"),
    ("serve-bench", ["--method", "ar"], "serve-bench batches one drafter per request"),
    ("serve-bench", ["--method", "whiflash-entropy"], "serve-bench batches one drafter per request"),
    ("serve-bench", ["--method", "eagle3:depth=0"], "depth"),
    ("serve-bench", ["--method", "route"], "serve-bench batches one drafter per request"),
    ("generate", ["--prompt", "x", "--method", "route:arms=eagle4+pld"], "'eagle4' (in arm 'eagle4')"),
    ("generate", ["--prompt", "x", "--method", "route:arms=confu.pld"], "confu cannot be merged"),
    ("generate", ["--prompt", "x", "--method", "route:arms=eagle3+dflash+router=rule"], "have no pld arm"),
    ("generate", ["--prompt", "x", "--method", "route:router=best"], "router must be one of learned, rule"),
    ("generate", ["--prompt", "x", "--method", "route", "--min-match", "0"], "min_match must be an integer from 1"),
    ("route-table", ["--arms", "pld+pld"], "pld is listed twice"),
    ("route-table", ["--min-match", "99"], "--min-match"),
    ("train", ["route", "--out", "r", "--arms", "eagle3+eagle4"], "'eagle4' (in arm 'eagle4')"),
    ("train", ["route", "--out", "r", "--arms", "pld"], "at least two arms"),
    ("serve-bench", ["--check", "--temperature", "0.7"], "--check compares greedy outputs"),
    ("serve-bench", ["--max-new-tokens", "0"], "argument --max-new-tokens"),
    ("serve-bench", ["--method", "pld", "--policy", "dspark"], "--policy dspark schedules by DSpark's confidence head"),
    ("serve-bench", ["--policy", "dspark:k=0"], "dspark k must be"),
    ("serve-bench", ["--policy", "dspark:k=8,measured=2"], "dspark measured must be an integer from 0 to 1"),
    ("serve-bench", ["--policy", "dspark:k=8,release=yes"], "dspark release must be an integer"),
    ("bench", ["--limit", "0"], "argument --limit: '0' is not an integer of at least 1"),
    ("bench", ["--methods", "ar,eagle3,ar"], "--methods lists ar more than once"),
    ("bench", ["--limit", "abc"], "argument --limit: 'abc' is not an integer"),
    ("bench", ["--max-new-tokens", "-5"], "argument --max-new-tokens: '-5' is not an integer of at least 1"),
    ("bench", ["--stop-prob", "nan"], "argument --stop-prob: 'nan' is not a finite number from 0 to 1"),
    ("bench", ["--stop-prob", "1"], "argument --stop-prob: '1' is not a finite number from 0 to 1 (excluded)"),
    ("bench", ["--tree-topk", "1.5"], "argument --tree-topk: '1.5' is not an integer"),
    ("bench", ["--temperature", "-1"], "argument --temperature: '-1' is not a finite number from 0 to 100"),
    ("bench", ["--methods", "ar,nope"], "unknown method 'nope'"),
    ("bench", ["--methods", "ar,eagle3:width=2"], "'width=2' is not param=value with a parameter of eagle3"),
    ("bench", ["--methods", "sps,pld"], "a benchmark needs 'ar' among its methods"),
    ("bench", ["--suite", "nope"], "unknown suite 'nope'"),
    ("bench", ["--backend", "nope"], "argument --backend: invalid choice: 'nope'"),
    ("grid", ["--method", "nope"], "unknown method 'nope'"),
    ("grid", ["--method", "sps", "--grid", "width=1"], "'width' is not a parameter of sps"),
    ("grid", ["--method", "sps", "--grid", "k=2;k=4"], "grid names k twice"),
    ("grid", ["--method", "sps", "--grid", "k=abc"], "--grid k='abc': the values of k are numbers"),
    ("grid", ["--method", "sps", "--grid", "k"], "is not param=v1,v2"),
    ("grid", ["--method", "sps", "--extra", "{oops"], "--extra must be a JSON object"),
    ("grid", ["--method", "sps", "--suite", "nope"], "unknown suite 'nope'"),
    ("grid", ["--limit", "inf"], "argument --limit: 'inf' is not an integer"),
    ("grid", ["--temperature", "-0.5"], "argument --temperature: '-0.5' is not"),
    ("grid", ["--seed", "-1"], "argument --seed: '-1' is not"),
    ("costs", ["forward", "--n", "0,1"], "--n must be positive integers"),
    ("costs", ["contemplate", "--nodes", "0,2"], "--nodes must be positive integers"),
    ("costs", ["roofline", "--rows", "0,1"], "--rows must be positive integers"),
    ("costs", ["roofline", "--rows", "1,8,1"], "--rows lists 1 more than once"),
    ("costs", ["roofline", "--large-mb", "-5"], "--large-mb -5: a size in MB"),
    ("costs", ["roofline", "--small-mb", "nan"], "--small-mb nan: a size in MB"),
    ("costs", ["roofline", "--gaps", "1,-2"], "--gaps must be milliseconds from 0 to 100"),
    ("costs", ["roofline", "--gaps", "1e9"], "--gaps must be milliseconds from 0 to 100"),
    ("costs", ["roofline", "--gap-rows", "4,0"], "--gap-rows must be positive integers"),
    ("costs", ["step", "--methods", "ar,nope"], "unknown method 'nope'"),
    ("costs", ["step", "--methods", " , "], "--methods: name at least one method"),
    ("costs", ["step", "--tokens", "0"], "tokens"),
    ("costs", ["step", "--temperature", "-1"], "temperature"),
    ("costs", ["step", "--prompt", "  "], "prompt"),
    ("costs", ["route", "--prompts", "0"], "argument --prompts: '0' is not an integer of at least 1"),
    ("costs", ["route", "--corpus", "/nonexistent/corpus"], "--corpus /nonexistent/corpus: no such folder"),
    ("bench", ["--methods", "ar,confu:schedule=fast"], "schedule must be one of wide, after (got 'fast')"),
    # sampled drafting's parameters, before any model loads (checked against the target's config.json alone)
    ("bench", ["--methods", "ar,eagle3:draft_temp=0"], "draft_temp must be a finite number from 0.05 to 4 (got 0)"),
    ("bench", ["--methods", "ar,sps:scheme=beam"], "scheme must be one of wor, iid, topk (got 'beam')"),
    ("bench", ["--methods", "ar,pld:scheme=wor"], "'scheme=wor' is not param=value with a parameter of pld"),
    ("grid", ["--method", "dflash", "--grid", "draft_temp=0.5,9"], "draft_temp must be a finite number from 0.05"),
    ("generate", ["--method", "specblock", "--prompt", "hi", "--draft-temp", "-1"], "draft_temp must be a finite"),
    ("generate", ["--method", "eagle3", "--prompt", "hi", "--depth", "0"], "depth must be an integer from 1 to"),
    ("train", ["confu", "--out", "run", "--minutes", "5"], "train confu starts from a trained EAGLE-3 drafter"),
    ("train", ["confu", "--out", "run", "--minutes", "5", "--init-from", "data/zoo/eagle3", "--experts", "0"],
     "argument --experts: '0' is not an integer from 1 to 4096"),
    ("train", ["confu", "--out", "run", "--minutes", "5", "--init-from", "data/zoo/eagle3", "--replicate", "-1"],
     "argument --replicate: '-1' is not an integer"),
    ("train", ["confu", "--out", "run", "--minutes", "5", "--init-from", str(ZOO / "confu"), "--soft-prompts", "4"],
     f"--soft-prompts 4: the ConFu run at {ZOO / 'confu'} has 16 (a resumed run keeps its shape"),
    ("costs", ["forward", "--reps", "0"], "argument --reps: '0' is not an integer of at least 1"),
    ("costs", ["forward", "--context", "nan"], "argument --context: 'nan' is not an integer"),
    ("costs", ["forward", "--by-dtype", "--dtypes", "fp32,bf17"], "--dtype 'bf17' is not a dtype"),
    ("costs", ["forward", "--by-dtype", "--dtypes", "auto"], "name the dtypes to compare"),
    ("costs", ["catchup", "--backlog", "a"], "--backlog must be positive integers"),
    ("costs", ["block", "--reps", "-1"], "argument --reps: '-1' is not an integer of at least 1"),
    ("costs", ["block", "--block-size", "1,2"], "--block-size: a block is the root and at least one mask"),
    ("costs", ["switch", "--reps", "x"], "argument --reps: 'x' is not an integer"),
    ("costs", ["switch", "--context", "0"], "--context must be positive integers"),
    ("costs", ["kernels", "--reps", "0"], "argument --reps: '0' is not an integer of at least 1"),
    ("costs", ["kernels", "--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    ("costs", ["nope"], "argument costs_cmd: invalid choice: 'nope'"),
    ("costs", ["llamacpp", "--dtypes", "fp8"], "--dtypes 'fp8': comma-separated, of fp32, bf16, fp16"),
    ("costs", ["llamacpp", "--pld-k", "0"], "--pld-k must be positive integers"),
    ("costs", ["llamacpp", "--sps-k", "2,40"], "draft lengths of at most 32"),
    ("costs", ["llamacpp", "--tokens", "0"], "argument --tokens: '0' is not an integer of at least 1"),
    ("bench", ["--llamacpp-pld-k", "0"], "argument --llamacpp-pld-k: '0' is not an integer from 1 to 32"),
    ("bench", ["--llamacpp-sps-k", "x"], "argument --llamacpp-sps-k: 'x' is not an integer"),
    ("export", ["gguf", "--type", "q4_0"], "argument --type: invalid choice: 'q4_0'"),
    ("export", ["gguf", "--model", str(ZOO / "eagle3")], "architecture LlamaForCausalLMEagle3 is not one the export"),
    ("export", ["gguf", "--model", str(ZOO / "nope")], "is not a folder"),
    ("export", ["gguf", "--out", "t.bin"], "t.bin: the output file must end in .gguf"),
    ("export", ["gguf", "--out", "/proc/speclab/t.gguf"], "for the GGUF file: No such file or directory"),
    ("export", ["onnx"], "argument format: invalid choice: 'onnx'"),
    ("stats", ["--last", "0"], "argument --last: '0' is not an integer of at least 1"),
    ("sweep", ["--router", "nope"], "--router must be entropy or neural"),
    ("sweep", ["--router", "entropy", "--grid=1:0:2"], "--grid must be thresholds"),
    ("train", ["eagle3", "--minutes", "inf"], "argument --minutes: 'inf' is not a finite number"),
    ("train", ["dflash", "--minutes", "5", "--block-size", "1"],
     "argument --block-size: '1' is not an integer from 2 to 64"),
    ("train", ["eagle3", "--minutes", "5", "--lr", "-1"], "argument --lr: '-1' is not a finite number"),
    ("zoo", ["build", "--target-minutes", "nan"], "argument --target-minutes: 'nan' is not a finite number"),
    ("train", ["specblock", "--minutes", "5", "--without", "poetry"], "argument --without: invalid choice"),
    ("train", ["specblock", "--minutes", "5", "--rank-warmup", "-1"], "argument --rank-warmup: '-1' is not an integer"),
    ("adapt", ["--policies", "static,greedy"], "--policies static,greedy: each one of bandit, osd, static"),
    ("adapt", ["--max-new-tokens", "0"], "argument --max-new-tokens: '0' is not an integer of at least 1"),
    ("adapt", ["--lr", "nan"], "argument --lr: 'nan' is not a finite number"),
    ("flashhead", ["build", "--drafter", "pld", "--clusters", "4"], "--drafter pld: one of draft, eagle3, dflash"),
    ("flashhead", ["build", "--drafter", "specblock", "--clusters", "0"],
     "argument --clusters: '0' is not an integer of at least 1"),
    ("flashhead", ["build", "--drafter", "eagle3"], "the following arguments are required: --clusters"),
    ("flashhead", ["costs", "--drafter", "eagle3", "--probes", "0,2"], "--probes 0,2: comma-separated whole numbers"),
    ("flashhead", ["agreement", "--drafter", "eagle3", "--margins", "0,-1"],
     "--margins 0,-1: comma-separated numbers from 0"),
    ("flashhead", ["agreement", "--drafter", "eagle3", "--clusters", "256,x"],
     "--clusters 256,x: comma-separated whole numbers from 0"),
    ("flashhead", ["agreement", "--drafter", "eagle3", "--clusters", "512"],
     "no FlashHead index of 512 clusters beside"),
    ("flashhead", ["tables", "--drafters", "eagle3,pld"], "--drafters eagle3,pld: 'all' or comma-separated roles"),
    ("flashhead", ["tables", "--probes", "300"], "--probes 300: at most the 256 clusters of the eagle3 index"),
    ("flashhead", ["tables", "--suite", "nope"], "suite 'nope'"),
    ("flashhead", ["nope"], "argument flashhead_cmd: invalid choice: 'nope'"),
    ("nope", [], "argument cmd: invalid choice: 'nope'"),
]


@pytest.mark.parametrize("cmd,argv,says", CASES, ids=[f"{c[0]}-{' '.join(c[1])}" for c in CASES])
def test_options_are_checked_in_one_line_before_any_work(cmd, argv, says, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # reports and traces would land here: nothing may
    db = ["--db", str(tmp_path / "t.duckdb")] if cmd in DB_COMMANDS else []
    assert_one_error_line([cmd, *argv, *db], says, capsys)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def locked_trace(tmp_path_factory):
    """A real speclab trace held open for writing by another process (DuckDB's file lock)."""
    import subprocess
    import sys

    from speclab.trace import TraceStore
    path = tmp_path_factory.mktemp("locked") / "t.duckdb"
    TraceStore(path).close()
    hold = "import duckdb, sys, time; c = duckdb.connect(sys.argv[1]); print('held', flush=True); time.sleep(600)"
    holder = subprocess.Popen([sys.executable, "-c", hold, str(path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    yield path
    holder.kill()
    holder.wait()


@pytest.mark.parametrize("cmd", list(DB_COMMANDS))
def test_a_trace_another_process_holds_is_one_line(cmd, locked_trace, capsys):
    before = locked_trace.read_bytes()
    assert_one_error_line(DB_COMMANDS[cmd] + ["--db", str(locked_trace)], "is locked by another process", capsys)
    assert locked_trace.read_bytes() == before


# ---- the app's start-up: the same classes, one line, before any model or file ----

@pytest.mark.slow
def test_app_start_up_refuses_bad_options_in_one_line(files, tmp_path):
    """Every case a real start of the app (`python -m app`), all started at once (each mostly waits on its
    imports): one line each, exit code 2."""
    import socket
    import subprocess
    import sys

    names = files[0]
    held, free = socket.socket(), socket.socket()
    for s in (held, free):
        s.bind(("127.0.0.1", 0))
    held.listen()
    port, free_port = held.getsockname()[1], free.getsockname()[1]
    free.close()  # the other cases start on a free port: they must stop before binding it
    cases = {"port-taken": ([], f"--port {port} on 127.0.0.1 is taken"),
             "dtype": (["--dtype", "bf17"], "--dtype 'bf17' is not a dtype"),
             "device": (["--device", "tpu9"], "--device 'tpu9' is not a device"),
             "db-parquet": (["--db", str(names["parquet"])], "is a Parquet file"),
             "db-under-a-file": (["--db", f"{names['binary']}/app.duckdb"], "is a file, not a folder"),
             "calibration-under-a-file": (["--calibration", f"{names['binary']}/cal.json"], "--calibration"),
             "costs-missing": (["--costs", str(tmp_path / "nope.json")], "no such file")}
    procs = {}
    for case, (argv, _) in cases.items():
        db = [] if case.startswith("db") else ["--db", str(tmp_path / f"{case}.duckdb")]
        p = port if case == "port-taken" else free_port
        procs[case] = subprocess.Popen([sys.executable, "-m", "app", "--port", str(p), *db, *argv],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    try:
        for case, proc in procs.items():
            out, err = proc.communicate(timeout=180)
            lines = [ln for ln in (out + err).splitlines() if ln.strip() and "opening trace" not in ln]
            says = cases[case][1]
            assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("speclab app: error:") \
                and says in lines[0], (case, out, err)
    finally:
        held.close()
        for proc in procs.values():
            proc.kill()
    assert _snapshot(tmp_path) == files[1]  # no trace made, the foreign files untouched


# ---- faults ----

def test_reports_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """A write that fails at the rename (a full disk, a kill) leaves the old report and no temporary file."""
    import os

    from speclab import files
    path = tmp_path / "report.md"
    files.write_atomic(path, "old")
    monkeypatch.setattr(files.os, "replace", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(OSError, match="No space left"):
        files.write_atomic(path, "new" * 1000)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["report.md"]


def _sigterm_when(proc, ready, within_s: float) -> str:
    """Read the process's stderr as it comes; once `ready(stderr so far)` (or after `within_s`), send SIGTERM and
    check it exits with 130, as Ctrl-C does. Returns all it wrote to stderr."""
    import signal
    import threading
    import time
    seen = []

    def read():
        while chunk := proc.stderr.read1(256):
            seen.append(chunk.decode(errors="replace"))
    threading.Thread(target=read, daemon=True).start()
    deadline = time.time() + within_s
    while not ready("".join(seen)) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 130, "".join(seen)
    return "".join(seen)


@pytest.mark.slow
def test_sigterm_in_the_middle_of_a_bench_marks_it_interrupted(model_dir, tmp_path):
    """SIGTERM (a scheduler, `kill`) ends a bench as Ctrl-C does: exit 130, every run done or interrupted (none left
    running), the bench row interrupted, no report written."""
    import re
    import subprocess
    import sys

    from speclab.trace import TraceStore
    db, report = tmp_path / "b.duckdb", tmp_path / "r" / "bench.md"
    proc = subprocess.Popen([sys.executable, "-m", "speclab.cli", "bench", "--model", str(model_dir["qwen3"]),
                             "--draft", str(model_dir["qwen3_draft"]), "--methods", "ar,sps,pld", "--suite", "zoo",
                             "--limit", "8", "--max-new-tokens", "96", "--db", str(db), "--report", str(report)],
                            stderr=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO_ROOT)
    log = _sigterm_when(proc, lambda err: max(map(int, re.findall(r"bench zoo (\d+)/", err)), default=0) >= 6, 120)
    assert "speclab: interrupted" in log
    with TraceStore(db, read_only=True) as s:
        runs = s.runs()
        bench = s.query("SELECT status FROM benches")
    assert len(runs) >= 6 and set(runs.status) <= {"done", "interrupted"}
    assert bench.status.tolist() == ["interrupted"]
    assert not report.exists() and not report.with_suffix(".html").exists()


@pytest.mark.slow
def test_a_full_disk_keeps_earlier_runs_and_marks_the_failed_one(model_dir, tmp_path):
    """The trace cannot grow (RLIMIT_FSIZE, as a full disk does to a write): the command ends with one line naming
    the trace and the system's reason, earlier runs keep every token, and the run being written is `failed` (or,
    when not even its status can be written, `interrupted` at the next open)."""
    import resource
    import signal

    from speclab.core.target import Target
    from speclab.generate import generate
    from speclab.trace import TraceStore
    db = tmp_path / "t.duckdb"
    target = Target.load(model_dir["qwen3"], dtype="fp32")
    with TraceStore(db) as s:
        first = generate(target, PROMPTS[0], "ar", max_new_tokens=8, trace=s).run_id

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (60_000, 60_000))
    r = run_cli("generate", "--model", str(model_dir["qwen3"]), "--dtype", "fp32", "--prompts",
                "data/prompts/demo.jsonl", "--max-new-tokens", "300", "--db", str(db), "--json", preexec_fn=limit)
    errors = error_lines(r.stderr)
    assert r.returncode == 2 and len(errors) == 1 and "writing the trace" in errors[0] \
        and "File too large" in errors[0] and "Traceback" not in r.stderr, r.stderr
    with TraceStore(db, read_only=True) as s:
        runs = s.runs().set_index("run_id")
        assert runs.loc[first, "status"] == "done" and len(s.tokens(first)) == 8  # earlier runs are intact
        # every run the command reported is in the file, done; the run being written when the limit hit is
        # `failed` with the system's reason when its status still fits, stays `running` when not even that write
        # fits (the WAL is at the limit), or has no row when the limit hit its first insert ...
        reported = {json.loads(line)["run_id"] for line in r.stdout.splitlines()}
        assert set(runs.index[runs.status == "done"]) - {first} == reported
        cut = runs[runs.status != "done"]
        assert len(cut) <= 1 and set(cut.status) <= {"failed", "running"}
        assert all("File too large" in e for e in cut.error[cut.status == "failed"])
    with TraceStore(db) as s:  # ... and the next open that can write marks it interrupted: nothing stays running
        assert "running" not in set(s.runs().status)
        assert s.runs().set_index("run_id").loc[first, "status"] == "done"


@pytest.mark.parametrize("cmd", ["generate", "bench", "grid", "costs catchup", "costs block", "costs switch"])
@pytest.mark.parametrize("case", ["not-causal", "other-target"])
def test_models_of_the_wrong_kind_or_for_another_target(cmd, case, model_dir, tmp_path, capsys):
    """A directory that is not a causal LM, or a drafter built for another target (the zoo's EAGLE-3 / DFlash on a
    tiny target): one line naming it, and no trace file made."""
    if case == "not-causal":
        model, says = str(save_bert(tmp_path / "bert", model_dir["qwen3"])), "not a causal language model"
    else:
        model, says = str(model_dir["qwen3"]), "trained for another target"
    method = {"generate": ["--method", "eagle3"], "bench": ["--methods", "ar,eagle3", "--no-peers"],
              "grid": ["--method", "eagle3", "--grid", "depth=2"]}.get(cmd, [])
    if case == "other-target" and cmd == "costs block":
        says = "it shares the target's embedding and head"  # the zoo's DFlash on the tiny target
    db = ["--db", str(tmp_path / "t.duckdb")] if cmd in DB_COMMANDS else []
    report = ["--report", str(tmp_path / "r.html")] if cmd in REPORT_COMMANDS else []
    base = [a for a in MODEL_COMMANDS[cmd] if a != "sps"]
    base = base[: base.index("--method")] + base[base.index("--method") + 1 :] if "--method" in base else base
    assert_one_error_line([*base, *method, "--model", model, *db, *report], says, capsys)
    assert not (tmp_path / "t.duckdb").exists() and not (tmp_path / "r.html").exists()


@pytest.mark.parametrize("what", ["target", "draft", "eagle3", "dflash", "router"])
def test_train_refuses_bad_paths_before_loading(what, files, tmp_path, capsys):
    """A run directory that cannot be made, a teacher or a checkpoint to resume from that is not there: one line,
    before the corpus or any model is loaded, nothing made."""
    names = files[0]
    minutes = [] if what == "router" else ["--minutes", "1"]
    train = ["train", what, *minutes, "--out"]
    assert_one_error_line([*train, f"{names['binary']}/run"], "is a file, not a folder", capsys)
    assert_one_error_line([*train, str(names["binary"])], "it is a file, not a folder", capsys)
    assert_one_error_line([*train, str(tmp_path / "run"), "--teacher", str(tmp_path / "nope")],
                          "no model directory at", capsys)
    if what != "router":
        assert_one_error_line([*train, str(tmp_path / "run"), "--init-from", str(tmp_path / "nope")],
                              ("no model directory at", "drafter at"), capsys)
    assert _snapshot(tmp_path) == files[1]


@pytest.mark.slow
def test_sigterm_in_training_keeps_the_weights_and_resumes(deep, tmp_path):
    """SIGTERM during `speclab train dflash` (a tiny target, a small slice of the corpus): exit 130, the weights so
    far saved whole in OUT/model (a loadable drafter, no temporary folder left), and `--init-from` resumes."""
    import re
    import subprocess
    import sys

    from speclab.drafters.dflash import load_dflash
    from speclab.train.corpus import DOMAINS
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for d in DOMAINS:
        for split in ("train", "val"):
            text = (REPO_ROOT / "data" / "corpus" / f"{d}.{split}.txt").read_text(encoding="utf-8")
            (corpus / f"{d}.{split}.txt").write_text(text[:12_000], encoding="utf-8")
    base = ["train", "dflash", "--teacher", deep.name, "--corpus", str(corpus), "--layers", "1", "--markov-rank", "4",
            "--block-size", "4"]
    proc = subprocess.Popen([sys.executable, "-m", "speclab.cli", *base, "--out", str(tmp_path / "run"), "--minutes",
                             "5"], stderr=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO_ROOT)
    log = _sigterm_when(proc, lambda err: re.search(r"step=[3-9]", err) is not None, 180)
    assert "interrupted: the weights so far are in" in log and "speclab: interrupted" in log and "Traceback" not in log
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["model", "train_log.jsonl"]  # no temporary folder
    load_dflash(tmp_path / "run" / "model", deep)  # whole and loadable
    r = run_cli(*base, "--out", str(tmp_path / "resumed"), "--minutes", "0.02", "--init-from",
                str(tmp_path / "run" / "model"))
    assert r.returncode == 0 and (tmp_path / "resumed" / "model" / "model.safetensors").exists(), r.stderr[-2000:]


@pytest.fixture(scope="module")
def ar_bench(model_dir, tmp_path_factory):
    """A real bench of AR alone on the tiny target: not what the routing commands need."""
    from speclab.bench.run import BenchConfig, run_bench
    from speclab.core.target import Target
    from speclab.trace import TraceStore
    db = tmp_path_factory.mktemp("ar_bench") / "b.duckdb"
    with TraceStore(db) as s:
        run_bench(BenchConfig(limit=1, max_new_tokens=4, methods=["ar"], peers=False, untraced=False),
                  Target.load(model_dir["qwen3"], dtype="fp32"), {}, s, log=lambda *a: None)
    return db


@pytest.mark.parametrize("argv,says", [
    (["profile"], "it was trained for another target"),  # the zoo's drafters on the tiny target
    (["sweep", "--router", "entropy"], "has no traced rounds of both eagle3 and dflash"),
    (["calibrate"], "has no traced rounds of both eagle3 and dflash"),
    (["routing"], "has no traced rounds of both eagle3 and dflash")], ids=["profile", "sweep", "calibrate", "routing"])
def test_bench_reading_commands_refuse_a_bench_or_models_that_do_not_fit(argv, says, ar_bench, model_dir, tmp_path,
                                                                         capsys):
    report = ["--report", str(tmp_path / "r.html")] if argv[0] != "profile" else []
    assert_one_error_line([*argv, "--db", str(ar_bench), "--model", str(model_dir["qwen3"]), *report], says, capsys)
    assert not (tmp_path / "r.html").exists()
    from speclab.trace import TraceStore
    with TraceStore(ar_bench, read_only=True) as s:  # nothing was added to the trace
        assert len(s.query("SELECT * FROM profiles")) == 0


# every command of speclab/cli/train.py that writes a folder, with the options it needs to get as far as its checks
TRAIN_OUT_COMMANDS = {
    **{f"train {what}": ["train", what, "--minutes", "1", "--out"]
       for what in ("target", "draft", "eagle3", "dflash", "specblock", "confu")},
    "train router": ["train", "router", "--out"],
    "train route": ["train", "route", "--out"],
    "train curve": ["train", "curve", "--drafter", "eagle3", "--out"],
    "data regenerate": ["data", "regenerate", "--out"],
    "zoo build": ["zoo", "build", "--work-dir"],
}


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc (no folder can be made in it)")
@pytest.mark.parametrize("cmd", list(TRAIN_OUT_COMMANDS))
@pytest.mark.parametrize("out", ["/proc/speclab-x", "/proc/speclab-x/run"])
def test_train_refuses_an_output_folder_that_cannot_be_made(cmd, out, tmp_path, capsys, monkeypatch):
    """An output folder that cannot be made (under /proc: even root, whom permission bits let write anywhere, gets
    ENOENT) is one line naming the option and the system's reason, exit code 2, before any model is loaded (every
    loader fails the test if called) and with nothing made."""
    import safetensors.torch
    import transformers

    from speclab.core import target
    loaded = []

    def no_load(*args, **kw):
        loaded.append(args)
        raise AssertionError(f"a model was loaded: {args}")
    for owner, name in [(transformers.AutoModelForCausalLM, "from_pretrained"),
                        (transformers.PreTrainedModel, "from_pretrained"), (target.Target, "load"),
                        (target, "load_causal_lm"), (safetensors.torch, "load_file")]:
        monkeypatch.setattr(owner, name, no_load)
    monkeypatch.chdir(tmp_path)  # relative defaults (zoo build's runs) would land here: nothing may
    line = assert_one_error_line([*TRAIN_OUT_COMMANDS[cmd], out], "cannot make the folder /proc/speclab-x", capsys)
    assert f"{TRAIN_OUT_COMMANDS[cmd][-1]} {out}:" in line and "No such file or directory" in line, line
    assert not loaded and list(tmp_path.iterdir()) == []


def test_an_unknown_chain_verification_rule_is_one_line(tmp_path, capsys, monkeypatch):
    """SPECLAB_CHAIN_VERIFY (read when `speclab.core.verify` is imported) names block or token; any other value is
    one line before any model loads, from every command."""
    from speclab.core import verify
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(verify, "CHAIN_RULE", "blocks")
    assert_one_error_line(MODEL_COMMANDS["generate"], "SPECLAB_CHAIN_VERIFY='blocks'", capsys)
    assert list(tmp_path.iterdir()) == []
