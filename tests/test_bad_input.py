"""Bad input gets a clear error and loses nothing."""
import json
import subprocess
import sys

import duckdb
import pytest

from conftest import PROMPTS
from speclab.errors import InvalidInput, ModelNotFound
from speclab.generate import generate
from speclab.target import Target
from speclab.trace import TraceStore


def test_unknown_model_path_says_where_it_looked(tmp_path):
    with pytest.raises(ModelNotFound, match=str(tmp_path / "nope")):
        Target.load(tmp_path / "nope")
    with pytest.raises(ModelNotFound, match="never downloads"):
        Target.load("some-org/some-model-that-is-not-cached")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFound, match="config.json"):
        Target.load(tmp_path / "empty")


def test_prompt_longer_than_context_fails_before_compute(qwen3):
    calls = qwen3.calls
    with pytest.raises(InvalidInput, match="context of 512 tokens"):
        generate(qwen3, "word " * 600, "ar", max_new_tokens=4)
    with pytest.raises(InvalidInput, match="exceeds"):
        generate(qwen3, "word " * 100, "ar", max_new_tokens=500)
    assert qwen3.calls == calls


@pytest.mark.parametrize("prompt", ["", "   \n"])
def test_empty_prompt(qwen3, prompt):
    with pytest.raises(InvalidInput, match="empty"):
        generate(qwen3, prompt, "ar")


@pytest.mark.parametrize("n", [0, -3])
def test_max_new_tokens_must_be_positive(qwen3, n, tmp_path):
    s = TraceStore(tmp_path / "t.duckdb")
    with pytest.raises(InvalidInput, match="at least 1"):
        generate(qwen3, PROMPTS[0], "ar", max_new_tokens=n, trace=s)
    assert len(s.runs()) == 0  # bad input leaves no run behind
    s.close()


def test_bad_method_and_parameters(qwen3):
    with pytest.raises(InvalidInput, match="unknown method 'nope'"):
        generate(qwen3, PROMPTS[0], "nope")
    with pytest.raises(InvalidInput, match="needs a draft model"):
        generate(qwen3, PROMPTS[0], "sps")
    with pytest.raises(ValueError, match="k >= 1"):
        generate(qwen3, PROMPTS[0], "pld", k=0)
    with pytest.raises(InvalidInput, match="top_p"):
        generate(qwen3, PROMPTS[0], "ar", temperature=1.0, top_p=1.5)


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "speclab.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_cli_json_line_and_trace(model_dir, tmp_path):
    db = tmp_path / "cli.duckdb"
    r = _cli("generate", "--model", str(model_dir["qwen3"]), "--draft", str(model_dir["qwen3_draft"]), "--method", "sps",
             "--k", "3", "--prompt", PROMPTS[0], "--max-new-tokens", "12", "--db", str(db), "--json")
    assert r.returncode == 0, r.stderr
    lines = [l for l in r.stdout.splitlines() if l.startswith("{")]
    assert len(lines) == 1
    summary = json.loads(lines[0])
    assert summary["method"] == "sps" and summary["tokens"] == 12 and summary["tokens_per_s"] > 0
    con = duckdb.connect(str(db), read_only=True)
    assert con.execute("SELECT count(*) FROM tokens").fetchall()[0][0] == 12
    con.close()


def test_cli_errors_are_clear_and_touch_nothing(model_dir, tmp_path):
    r = _cli("generate", "--model", str(tmp_path / "missing"), "--prompt", "hi", "--db", "none")
    assert r.returncode == 2 and "no model directory at" in r.stderr and "Traceback" not in r.stderr
    foreign = tmp_path / "mine.duckdb"
    foreign.write_text("not a database")
    r = _cli("generate", "--model", str(model_dir["qwen3"]), "--prompt", "hi", "--db", str(foreign))
    assert r.returncode == 2 and "not a DuckDB database" in r.stderr and foreign.read_text() == "not a database"
    r = _cli("generate", "--model", str(model_dir["qwen3"]), "--prompt", "hi", "--max-new-tokens", "0", "--db", "none")
    assert r.returncode == 2 and "at least 1" in r.stderr
