"""llama.cpp as the CPU peer: the GGUF export (llama.cpp's conventions, the tokenizer's pre-tokenizer mapping, bad
input writing nothing), the tokenizer round trip through llama.cpp (which must be able to fail), and llama.cpp's
logits on exported models against speclab's forward (Qwen3, and Llama, whose q / k rows are permuted)."""
import copy
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from speclab import gguf
from speclab import llamacpp as lc
from speclab.errors import InvalidInput
from speclab.zoo import REPO_ROOT, default_target

needs_llamacpp = pytest.mark.skipif(lc.available() is None, reason="llama-cpp-python is not installed")
ZOO_TOKENIZER = json.loads((default_target() / "tokenizer.json").read_text())


def test_the_setup_installs_the_llamacpp_bindings():
    """`make test`'s set-up builds llama-cpp-python (scripts/setup.sh): its tests skip only where that build
    failed and said so (the marker the set-up leaves), never silently."""
    failed = (REPO_ROOT / ".venv" / ".llamacpp-failed").exists()
    assert lc.available() is not None or failed


def _with_pre(pre: dict | None, normalizer=None, model_type="BPE") -> dict:
    tok = copy.deepcopy(ZOO_TOKENIZER)
    tok["pre_tokenizer"], tok["normalizer"] = pre, normalizer
    tok["model"]["type"] = model_type
    return tok


def _split(pattern: str) -> dict:
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}


def test_the_pre_tokenizer_is_mapped_by_its_regex_or_refused():
    assert gguf.pre_tokenizer(ZOO_TOKENIZER) == "gpt-2"  # ByteLevel's own regex: GPT-2's split
    for pattern, name in gguf.SPLIT_PRE.items():
        assert gguf.pre_tokenizer(_with_pre(_split(pattern))) == name
    refused = [
        (_with_pre(_split(r"\p{L}+|\s+")), "no llama.cpp pre-tokenizer with the same regex"),
        (_with_pre({**ZOO_TOKENIZER["pre_tokenizer"], "add_prefix_space": True}), "no llama.cpp pre-tokenizer"),
        (_with_pre(None), "no llama.cpp pre-tokenizer"),
        (_with_pre(ZOO_TOKENIZER["pre_tokenizer"], normalizer={"type": "NFC"}), "normalizes its text first"),
        (_with_pre(ZOO_TOKENIZER["pre_tokenizer"], model_type="Unigram"), "byte-level BPE tokenizers only"),
    ]
    for tok, why in refused:
        with pytest.raises(InvalidInput, match=why):
            gguf.pre_tokenizer(tok)


def _copy_model(src: Path, dst: Path, tokenizer: dict | None = None) -> Path:
    shutil.copytree(src, dst)
    if tokenizer is not None:
        (dst / "tokenizer.json").write_text(json.dumps(tokenizer))
    return dst


@pytest.mark.parametrize("case, why", [
    ("not a folder", "is not a folder"),
    ("no config", "has no config.json"),
    ("architecture", "is not one the export knows"),
    ("rope", "rope scaling 'llama3': the export writes plain rope only"),
    ("no tokenizer", "has no tokenizer.json"),
    ("no weights", "has no \\*.safetensors weights"),
    ("type", "GGUF type 'q4_0'"),
    ("suffix", "must end in .gguf"),
    ("out is a folder", "is a directory"),
    ("unwritable", "for the GGUF file: No such file or directory"),
])
def test_a_bad_export_is_one_line_and_writes_nothing(case, why, model_dir, tmp_path):
    src = _copy_model(model_dir["qwen3"], tmp_path / "m")
    out, typ = tmp_path / "out" / "m.gguf", "bf16"
    if case == "not a folder":
        src = tmp_path / "nope"
    elif case == "no config":
        (src / "config.json").unlink()
    elif case == "architecture":
        cfg = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLMEagle3"]}))
    elif case == "rope":
        cfg = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**cfg, "rope_parameters": {"rope_type": "llama3"}}))
    elif case == "no tokenizer":
        (src / "tokenizer.json").unlink()
    elif case == "no weights":
        for f in src.glob("*.safetensors"):
            f.unlink()
    elif case == "type":
        typ = "q4_0"
    elif case == "suffix":
        out = tmp_path / "out" / "m.bin"
    elif case == "out is a folder":
        out = tmp_path / "dir.gguf"
        out.mkdir()
    elif case == "unwritable":
        out = Path("/proc/speclab/m.gguf")
    with pytest.raises(InvalidInput, match=why):
        gguf.export(gguf.plan(src, out, typ))
    assert not (tmp_path / "out").exists()


def test_the_export_follows_llama_cpps_conventions_and_fails_whole(model_dir, tmp_path, monkeypatch):
    import gguf as G
    out = gguf.export(gguf.plan(model_dir["qwen3"], tmp_path / "q.gguf", "bf16"))
    r = G.GGUFReader(out)
    field = lambda k: r.fields[k].contents()  # noqa: E731
    assert field("general.architecture") == "qwen3" and field("tokenizer.ggml.pre") == "gpt-2"
    assert field("tokenizer.ggml.model") == "gpt2" and field("tokenizer.ggml.add_bos_token") is False
    assert field("tokenizer.ggml.eos_token_id") == 0 and len(field("tokenizer.ggml.tokens")) == 8192
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["token_embd.weight"] == "BF16" and types["blk.0.attn_q.weight"] == "BF16"
    assert types["blk.0.attn_q_norm.weight"] == "F32" and types["output_norm.weight"] == "F32"
    assert "output.weight" in types  # untied head (the zoo's tied one writes none: llama.cpp reuses the embedding)
    assert len(types) == 2 + 1 + 2 * 11  # embedding, head, final norm, 11 tensors per layer

    def broken(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(G.GGUFWriter, "write_tensors_to_file", broken)
    with pytest.raises(OSError):
        gguf.export(gguf.plan(model_dir["qwen3"], tmp_path / "half.gguf", "f32"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.gguf"]  # nothing half-written beside it


@needs_llamacpp
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_llama_cpp_computes_speclabs_logits_on_the_export(arch, model_dir, tmp_path, monkeypatch):
    """fp32 export: llama.cpp's logits at every prompt position equal speclab's forward's within the rounding of
    llama.cpp's f16 KV cache (its default), argmax for argmax (Llama's q / k rows permuted to llama.cpp's rope
    layout; without the permutation they are far off)."""
    from speclab.core.target import Target
    t = Target.load(model_dir[arch], dtype="fp32")
    ids = t.tokenizer("The history of the printing press begins in the city of", return_tensors="pt").input_ids[0]
    with torch.inference_mode():
        ref = t.model(ids.view(1, -1)).logits[0].float().numpy()

    def llama_cpp_logits(path):
        llm = lc.load(gguf.export(gguf.plan(model_dir[arch], path, "f32")), speculative=True, n_ctx=256)
        llm.eval(ids.tolist())
        return np.array(llm.scores[: ids.numel()])
    got = llama_cpp_logits(tmp_path / f"{arch}.gguf")
    scale = np.abs(ref).max()
    assert np.abs(got - ref).max() <= 3e-3 * scale
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    if arch == "llama":  # the permutation is what makes Llama right
        monkeypatch.setitem(gguf.ARCHS, "LlamaForCausalLM", gguf.Arch("llama", permute_qk=False))
        assert np.abs(llama_cpp_logits(tmp_path / "unpermuted.gguf") - ref).max() > 0.1 * scale


@needs_llamacpp
def test_the_tokenizer_round_trip_is_identical_and_can_fail(model_dir, tmp_path, monkeypatch):
    """Every bundled prompt and hand-made text: llama.cpp's ids equal speclab's, for the zoo's GPT-2 split and a
    Qwen2-pattern tokenizer; a tokenizer mapped to the wrong pre-tokenizer is caught, and the command removes its
    file."""
    from speclab.cli.export import round_trip_texts
    from speclab.cli.main import main
    texts = round_trip_texts()
    assert len(texts) > 1000 and set(gguf.EDGE_TEXTS) <= set(texts)
    zoo = gguf.export(gguf.plan(model_dir["qwen3"], tmp_path / "zoo.gguf", "bf16"))
    assert lc.round_trip(model_dir["qwen3"], zoo, texts) == []

    qwen2 = _copy_model(model_dir["qwen3"], tmp_path / "qwen2tok", _with_pre(_split(next(iter(gguf.SPLIT_PRE)))))
    out = gguf.export(gguf.plan(qwen2, tmp_path / "qwen2tok.gguf", "bf16"))
    assert lc.round_trip(qwen2, out, texts[::4] + list(gguf.EDGE_TEXTS)) == []

    monkeypatch.setattr(gguf, "pre_tokenizer", lambda tok: "qwen2")  # the zoo's GPT-2 split called Qwen2's
    wrong = gguf.export(gguf.plan(model_dir["qwen3"], tmp_path / "wrong.gguf", "bf16"))
    bad = lc.round_trip(model_dir["qwen3"], wrong, gguf.EDGE_TEXTS)
    assert bad and all(ours != theirs for _, ours, theirs in bad)
    assert main(["export", "gguf", "--model", str(model_dir["qwen3"]), "--out", str(tmp_path / "cli.gguf")]) == 2
    assert not (tmp_path / "cli.gguf").exists()


@needs_llamacpp
def test_llama_cpp_decodes_greedily_and_counts_its_steps(model_dir, tmp_path):
    """The three peers decode the same greedy text (fp32); the speculative ones' steps add up to it."""
    from speclab.core.target import Target
    from speclab.equality import first_divergence
    from speclab.generate import generate
    t = Target.load(model_dir["qwen3"], dtype="fp32")
    d = lc.load(gguf.export(gguf.plan(model_dir["qwen3_draft"], tmp_path / "d.gguf", "f32")), n_ctx=256)
    tf = gguf.export(gguf.plan(model_dir["qwen3"], tmp_path / "t.gguf", "f32"))
    plain, spec = lc.load(tf, n_ctx=256), lc.load(tf, n_ctx=256, speculative=True)
    prompt = t.tokenizer("def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) +").input_ids
    ar = generate(t, torch.tensor(prompt), "ar", max_new_tokens=24).token_ids
    runs = {"plain": lc.decode(plain, prompt, 24, t.eos_ids)}
    for kind in ("pld", "sps"):
        runs[kind] = lc.decode(spec, prompt, 24, t.eos_ids, lc.drafter(kind, 3, d))
    for kind, r in runs.items():  # equal, or (llama.cpp's f16 KV cache) apart at a numerical near-tie only
        div = first_divergence(t, torch.tensor(prompt), ar, r.ids)
        assert div is None or div.near_tie, (kind, div)
        assert r.elapsed_s > 0 and r.prompt_ms > 0 and r.prompt_ms + r.eval_ms < 1e3 * r.elapsed_s
    assert runs["plain"].per_step is None
    sps = runs["sps"].per_step
    assert sps and all(0 <= a <= k <= 3 for k, a in sps)
    n = len(runs["sps"].ids)
    assert sum(a + 1 for _, a in sps) == n - 1  # each step commits its accepted drafts and one token
    assert sum(a + 1 for _, a in runs["pld"].per_step) == len(runs["pld"].ids) - 1  # a step that found nothing too
    assert sum(a for _, a in sps) > 0  # the perturbed draft agrees with the target often
    with pytest.raises(InvalidInput, match="needs a draft model"):
        lc.drafter("sps", 3)


def test_llama_cpp_threads_are_the_cores_this_process_may_use():
    assert 1 <= lc.threads() <= (os.cpu_count() or 1)


@needs_llamacpp
def test_costs_llamacpp_compares_per_token_costs_and_sweeps_draft_lengths(model_dir, tmp_path, capsys):
    from speclab.cli.main import main
    report = tmp_path / "lc.md"
    assert main(["costs", "llamacpp", "--model", str(model_dir["qwen3"]), "--draft", str(model_dir["qwen3_draft"]),
                 "--dtypes", "fp32", "--limit", "1", "--tokens", "8", "--pld-k", "2", "--sps-k", "2,3",
                 "--report", str(report)]) == 0
    md = report.read_text()
    assert "ms per token: llama.cpp's plain decoding against speclab's AR" in md and "bound_ms" in md
    assert "| fp32 " in md and "/4 " in md  # same_output of the 4 prompts (llama.cpp's f16 KV cache may tip a tie)
    for row in ("| llamacpp_pld |   2 |", "| llamacpp_sps |   2 |", "| llamacpp_sps |   3 |"):
        assert row in md
    assert "Where one speclab AR step goes" in md and "plotly" in report.with_suffix(".html").read_text()
