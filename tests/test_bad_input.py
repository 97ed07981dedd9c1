"""Bad input gets a clear error and loses nothing."""
import json
import re
import shutil

import duckdb
import pytest

from helpers import PROMPTS, error_lines, run_cli, save_bert
from speclab.core.target import Target
from speclab.errors import InvalidInput, ModelNotFound
from speclab.generate import generate
from speclab.trace import TraceStore


def test_unknown_model_path_says_where_it_looked(tmp_path):
    with pytest.raises(ModelNotFound, match=str(tmp_path / "nope")):
        Target.load(tmp_path / "nope")
    with pytest.raises(ModelNotFound, match="never downloads"):
        Target.load("some-org/some-model-that-is-not-cached")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFound, match=r"config\.json"):
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


def test_a_number_check_names_what_it_got_as_typed():
    """`checks.check_number`: a refused value is shown as typed; an empty box (None, blank text) as "nothing", never
    "None" (app v4, item 10)."""
    from speclab.checks import Bound, check_number
    for value, shown in ((None, "nothing"), ("", "nothing"), ("  ", "nothing"), ("2.5", "2.5"), ("abc", "'abc'"),
                         (0, "0")):
        with pytest.raises(InvalidInput, match=re.escape(f"max new tokens must be an integer from 1 to 64 (got "
                                                          f"{shown})")):
            check_number("max new tokens", value, int, Bound(1, 64))


def test_bad_method_and_parameters(qwen3):
    with pytest.raises(InvalidInput, match="unknown method 'nope'"):
        generate(qwen3, PROMPTS[0], "nope")
    with pytest.raises(InvalidInput, match="needs a draft model"):
        generate(qwen3, PROMPTS[0], "sps")
    with pytest.raises(InvalidInput, match=r"k must be an integer from 1 to 512 .got 0."):
        generate(qwen3, PROMPTS[0], "pld", k=0)
    with pytest.raises(InvalidInput, match="top_p"):
        generate(qwen3, PROMPTS[0], "ar", temperature=1.0, top_p=1.5)
    with pytest.raises(InvalidInput, match="temperature"):
        generate(qwen3, PROMPTS[0], "ar", temperature=float("nan"))


@pytest.mark.slow
def test_cli_json_line_and_trace(model_dir, tmp_path):
    db = tmp_path / "cli.duckdb"
    r = run_cli("generate", "--model", str(model_dir["qwen3"]), "--draft", str(model_dir["qwen3_draft"]), "--method",
                "sps", "--k", "3", "--prompt", PROMPTS[0], "--max-new-tokens", "12", "--db", str(db), "--json")
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1
    summary = json.loads(lines[0])
    assert summary["method"] == "sps" and summary["tokens"] == 12 and summary["tokens_per_s"] > 0
    con = duckdb.connect(str(db), read_only=True)
    assert con.execute("SELECT count(*) FROM tokens").fetchall()[0][0] == 12
    con.close()


@pytest.mark.slow
def test_cli_errors_are_clear_and_touch_nothing(model_dir, tmp_path):
    r = run_cli("generate", "--model", str(tmp_path / "missing"), "--prompt", "hi", "--db", "none")
    assert r.returncode == 2 and "no model directory at" in r.stderr and "Traceback" not in r.stderr
    foreign = tmp_path / "mine.duckdb"
    foreign.write_text("not a database")
    r = run_cli("generate", "--model", str(model_dir["qwen3"]), "--prompt", "hi", "--db", str(foreign))
    assert r.returncode == 2 and "not a DuckDB database" in r.stderr and foreign.read_text() == "not a database"
    r = run_cli("generate", "--model", str(model_dir["qwen3"]), "--prompt", "hi", "--max-new-tokens", "0", "--db",
                "none")
    assert r.returncode == 2 and "at least 1" in r.stderr


# ---- every bad input of `speclab generate`: one clear line, exit code 2, nothing decoded, no run `done` ----

@pytest.fixture(scope="module")
def bad_models(tmp_path_factory, model_dir):
    """A small BERT (not a causal LM), a draft whose weights do not match its config, and a DFlash drafter that
    fits the tiny target (so its own parameters are what is refused)."""
    d = tmp_path_factory.mktemp("bad_models")
    save_bert(d / "bert", model_dir["qwen3"])
    shutil.copytree(model_dir["qwen3_draft"], d / "mismatched")
    cfg = json.loads((d / "mismatched" / "config.json").read_text())
    cfg["intermediate_size"] *= 2
    (d / "mismatched" / "config.json").write_text(json.dumps(cfg))
    from speclab.drafters.dflash import DFlashConfig, DFlashModel
    t = json.loads((model_dir["qwen3"] / "config.json").read_text())
    DFlashModel(DFlashConfig(hidden_size=t["hidden_size"], intermediate_size=t["intermediate_size"],
                             num_hidden_layers=1, num_attention_heads=t["num_attention_heads"],
                             num_key_value_heads=t["num_key_value_heads"],
                             head_dim=t["head_dim"], vocab_size=t["vocab_size"], target_layer_ids=(0, 1),
                             mask_token_id=2)).save(d / "dflash")
    from speclab.drafters.eagle3 import Eagle3Config, Eagle3Model
    Eagle3Model(Eagle3Config(hidden_size=t["hidden_size"], intermediate_size=t["intermediate_size"],
                             num_attention_heads=t["num_attention_heads"], num_key_value_heads=t["num_key_value_heads"],
                             head_dim=t["head_dim"], vocab_size=t["vocab_size"], draft_vocab_size=t["vocab_size"],
                             target_hidden_size=t["hidden_size"], layer_ids=(1, 1, 1))).save(d / "eagle3")
    return {"bert": d / "bert", "mismatched": d / "mismatched", "dflash": d / "dflash", "eagle3": d / "eagle3"}


FILES = {"empty": b"", "blank": b"\n  \n", "binary": bytes(range(256)) * 4,
         "bad_json": b'{"prompt": "a"}\n{oops\n', "no_field": b'{"prompt": "a"}\n{"id": 3}\n',
         "empty_prompt": b'{"prompt": "a"}\n\n{"prompt": "  "}\n'}

WF = ["--eagle", "{eagle3}", "--dflash", "{dflash}"]  # drafters that fit the tiny target
BAD = [  # (case, argv, what the one line must say)
    ("temperature-nan", ["--temperature", "nan"], "temperature must be a finite number from 0 to 10 (got nan)"),
    ("temperature-negative", ["--temperature", "-1"], "temperature must be a finite number from 0 to 10 (got -1.0)"),
    ("temperature-huge", ["--temperature", "1e9"], "from 0 to 10 (got 1000000000.0)"),
    ("temperature-inf", ["--temperature", "inf"], "temperature must be a finite number"),
    ("top-p-zero", ["--temperature", "1", "--top-p", "0"], "top_p must be a finite number above 0"),
    ("top-p-above-1", ["--top-p", "1.5"], "top_p must be a finite number from 0 to 1 (got 1.5)"),
    ("top-k-negative", ["--top-k", "-1"], "top_k must be an integer of at least 0 (got -1)"),
    ("top-k-above-vocab", ["--top-k", "100000"], "top_k must be an integer from 0 to"),
    ("seed-negative", ["--seed", "-1"], "seed must be an integer from 0 to"),
    ("max-new-tokens-0", ["--max-new-tokens", "0"], "max_new_tokens must be an integer of at least 1 (got 0)"),
    ("max-new-tokens-past-context", ["--max-new-tokens", "600"], "exceeds the model's context of 512 tokens"),
    ("unknown-method", ["--method", "nope"], "unknown method 'nope'"),
    ("sps-k-0", ["--method", "sps", "--k", "0"], "k must be an integer from 1 to 512 (got 0)"),
    ("sps-tree-topk-0", ["--method", "sps", "--tree-topk", "0"], "tree_topk must be an integer from 1 to"),
    ("sps-tree-topk-above-vocab", ["--method", "sps", "--tree-topk", "100000"],
     "tree_topk must be an integer from 1 to"),
    ("sps-tree-too-large", ["--method", "sps", "--k", "8", "--tree-topk", "200"], "= 1600 nodes, more than the 512"),
    ("sps-stop-prob-1.5", ["--method", "sps", "--stop-prob", "1.5"],
     "stop_prob must be a finite number from 0 to 1 (excluded)"),
    ("pld-k-0", ["--method", "pld", "--k", "0"], "k must be an integer from 1 to 512 (got 0)"),
    ("head-not-a-choice", ["--method", "sps", "--head", "foo"], "head must be one of dense, flash (got 'foo')"),
    ("head-flash-probes-0", ["--method", "sps", "--head", "flash", "--probes", "0"],
     "probes must be an integer from 1 to"),
    ("head-flash-no-such-index", ["--method", "sps", "--head", "flash", "--clusters", "7"],
     "no FlashHead index of 7 clusters beside"),
    ("eagle3-head-flash-no-index", ["--method", "eagle3", "--eagle", "{eagle3}", "--head", "flash"],
     "no FlashHead index beside"),
    ("method-spec-head-fast", ["--method", "eagle3:head=fast", "--eagle", "{eagle3}"],
     "head must be one of dense, flash (got 'fast')"),
    ("prompts-missing", ["--prompts", "{tmp}/nope.jsonl"], "no prompts file at"),
    ("prompts-empty", ["--prompts", "{file_empty}"], "holds no prompt"),
    ("prompts-blank", ["--prompts", "{file_blank}"], "holds no prompt"),
    ("prompts-binary", ["--prompts", "{file_binary}"], "not UTF-8 text"),
    ("prompts-bad-json", ["--prompts", "{file_bad_json}"], "line 2: not valid JSON"),
    ("prompts-no-field", ["--prompts", "{file_no_field}"], "line 2: no prompt"),
    ("prompts-empty-prompt", ["--prompts", "{file_empty_prompt}"], "line 3: no prompt"),
    ("model-not-causal", ["--model", "{bert}"], "not a causal language model"),
    ("draft-weights-mismatched", ["--method", "sps", "--draft", "{mismatched}"], "do not match its config.json"),
    ("eagle3-missing", ["--method", "eagle3", "--eagle", "{tmp}/nope"], "no EAGLE-3 drafter at"),
    ("eagle3-other-target", ["--method", "eagle3"], "it was trained for another target"),  # the zoo's, on a tiny target
    ("eagle3-not-eagle", ["--method", "eagle3", "--eagle", "{mismatched}"],
     "not an EAGLE-3 drafter (one decoder layer"),
    ("method-spec-unknown-param", ["--method", "eagle3:width=2"], "'width=2' is not param=value with a parameter"),
    ("dflash-missing", ["--method", "dflash", "--dflash", "{tmp}/nope"], "no DFlash drafter at"),
    ("dflash-other-target", ["--method", "dflash"], "it shares the target's embedding and head"),  # the zoo's
    ("dflash-not-dflash", ["--method", "dflash", "--dflash", "{mismatched}"], "is not a DFlash config"),
    ("dflash-block-size-1", ["--method", "dflash", "--dflash", "{dflash}", "--block-size", "1"],
     "block_size must be an integer from 2 to"),
    ("dflash-markov-2", ["--method", "dflash", "--dflash", "{dflash}", "--markov", "2"],
     "markov must be an integer from 0 to 1 (got 2)"),
    ("whiflash-threshold-nan", ["--method", "whiflash-entropy", *WF, "--threshold", "nan"],
     "threshold must be a finite number from 0 to"),
    ("whiflash-spec-threshold-abc", ["--method", "whiflash-entropy:threshold=abc", *WF],
     "threshold must be a finite number from 0 to"),
    ("whiflash-entropy-threshold-negative", ["--method", "whiflash-entropy", *WF, "--threshold", "-0.5"],
     "(got -0.5)"),
    ("whiflash-entropy-threshold-above-ln-v", ["--method", "whiflash-entropy:threshold=99", *WF],
     "(got 99)"),
    ("whiflash-eager-2", ["--method", "whiflash-entropy", *WF, "--eager", "2"],
     "eager must be an integer from 0 to 1 (got 2)"),
    ("whiflash-router-missing", ["--method", "whiflash-neural", *WF, "--router-model", "{tmp}/nope"],
     "no neural router at"),
    ("whiflash-router-other-target", ["--method", "whiflash-neural", *WF],
     "was trained for another target"),  # the zoo's
]


@pytest.mark.parametrize("case,argv,says", BAD, ids=[c[0] for c in BAD])
def test_cli_refuses_bad_input_in_one_line(case, argv, says, model_dir, bad_models, tmp_path, capsys):
    from speclab.cli import main
    files = {}
    for name, data in FILES.items():
        files[name] = tmp_path / f"{name}.jsonl"
        files[name].write_bytes(data)
    argv = [x.format(tmp=tmp_path, bert=bad_models["bert"], mismatched=bad_models["mismatched"],
                     dflash=bad_models["dflash"], eagle3=bad_models["eagle3"],
                     **{f"file_{k}": v for k, v in files.items()}) for x in argv]
    db = tmp_path / "t.duckdb"
    base = ["generate", "--model", str(model_dir["qwen3"]), "--draft", str(model_dir["qwen3_draft"]),
            "--max-new-tokens", "8", "--db", str(db)] + ([] if "--prompts" in argv else ["--prompt", PROMPTS[0]])
    rc = main(base + argv)  # later options win over the base ones
    out, err = capsys.readouterr()
    lines = error_lines(err)
    assert rc == 2 and len(lines) == 1 and says in lines[0], (rc, err)
    assert out == ""  # nothing decoded
    if db.exists():
        assert (TraceStore(db, read_only=True).runs().status == "done").sum() == 0


def test_cli_json_prints_only_json_lines(model_dir, tmp_path, capsys):
    from speclab.cli import main
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "Once upon a time"}\n{"question": "How many apples?", "id": "q2"}\n')
    rc = main(["generate", "--model", str(model_dir["qwen3"]), "--method", "pld", "--prompts", str(f),
               "--max-new-tokens", "6", "--db", "none", "--json"])
    out = capsys.readouterr().out
    rows = [json.loads(ln) for ln in out.splitlines()]
    assert rc == 0 and len(rows) == 2 and all(r["tokens"] == 6 and isinstance(r["text"], str) for r in rows)


def test_a_decode_closed_mid_way_is_cancelled_with_what_it_committed(qwen3, tmp_path):
    """A page closed mid-decode (the generator closed): the run is `cancelled`, and its row counts the tokens and
    rounds it committed and keeps their text (app v4, item 16: not "tokens -" beside tokens shown)."""
    from speclab.generate import Generation
    s = TraceStore(tmp_path / "c.duckdb")
    it = iter(Generation(qwen3, PROMPTS[0], "ar", max_new_tokens=10, trace=s))
    next(it), next(it)
    it.close()
    r = s.runs().iloc[0]
    assert (r.status, r.new_tokens, r.rounds) == ("cancelled", 2, 2) and len(s.tokens(int(r.run_id))) == 2
    assert r.output_text == qwen3.tokenizer.decode(s.tokens(int(r.run_id)).token_id.tolist(), skip_special_tokens=True)
    s.close()


def test_ctrl_c_marks_the_run_interrupted(qwen3, tmp_path):
    s = TraceStore(tmp_path / "i.duckdb")

    def press_ctrl_c(ev):
        if ev.round == 2:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        generate(qwen3, PROMPTS[0], "ar", max_new_tokens=10, trace=s, on_round=press_ctrl_c)
    runs = s.runs()
    assert runs.status.tolist() == ["interrupted"] and runs.error.isna().all() and len(s.tokens(1)) == 3
    # its row counts what it committed, as its tokens show (app v4, item 16: no "tokens -" beside shown tokens)
    assert runs.new_tokens.tolist() == [3] and runs.rounds.tolist() == [3]
    assert runs.output_text[0] == qwen3.tokenizer.decode(s.tokens(1).token_id.tolist(), skip_special_tokens=True)
    s.close()
