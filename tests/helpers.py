"""What several test modules share: tiny models built from configs (no downloads), the test prompts, the tiny
EAGLE-3 and DFlash drafters trained for a few seconds (conftest.py trains each once per session; the random drafters
are the registry's `ModelRole.random`, in the drafter modules, re-exported here), the CLI run in-process or as a
subprocess, and the check that bad input gets exactly one error line."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from speclab.drafters.confu import random_confu  # noqa: F401  (re-exported: the random drafters of the registry)
from speclab.drafters.dflash import random_dflash  # noqa: F401
from speclab.drafters.eagle3 import random_eagle3  # noqa: F401
from speclab.drafters.specblock import random_specblock  # noqa: F401
from speclab.drafters.sps import random_draft  # noqa: F401
from speclab.zoo import REPO_ROOT, tokenizer_dir

PROMPTS = ["def add(a, b):\n    return", "Once upon a time, a little dog", "Question: Tom has 3 apples. How many",
           "KING HENRY:\nWhat say you"]


def demo_rows() -> list[dict]:
    """The rows of data/prompts/demo.jsonl (one prompt per zoo category)."""
    path = REPO_ROOT / "data" / "prompts" / "demo.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


class NoTok:
    """The tokenizer of a target built over a bare vocabulary (tiny exact-distribution tests): no text, no EOS."""
    eos_token_id = None


# ---- tiny models ------------------------------------------------------------------------------------------------

def tiny_config(arch: str, vocab_size: int, hidden: int = 64, layers: int = 2, init: float = 0.3, ctx: int = 512):
    from transformers import LlamaConfig, Qwen3Config

    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=ctx,
                  initializer_range=init, eos_token_id=0, pad_token_id=1, bos_token_id=None, tie_word_embeddings=False)
    cfg = Qwen3Config(**common) if arch == "qwen3" else LlamaConfig(**common)
    cfg._attn_implementation = "sdpa"
    return cfg


def build_tiny(arch: str, out: Path, seed: int, vocab_size: int | None = None, tokenizer=True, **kw) -> Path:
    """A random tiny model (large init so distributions are peaked: argmax ties are then vanishingly rare)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir()) if tokenizer else None
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, vocab_size or len(tok), **kw))
    model.save_pretrained(out)
    if tok is not None:
        tok.save_pretrained(out)
    return out


def perturbed(src: Path, out: Path, noise: float, seed: int) -> Path:
    """A draft that agrees with the target often but not always: the target's weights plus noise."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.std())
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out


def save_bert(out: Path, tokenizer_src: Path) -> Path:
    """A small BERT (a masked LM, not a causal one) with a working tokenizer: what the CLI must refuse as a model."""
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    BertForMaskedLM(BertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=64)).save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_src).save_pretrained(out)
    return out


def own_text_windows(target, length: int = 48):
    """[n, length] windows of the target's own text (its greedy and sampled continuations of PROMPTS): what a
    drafter trained for a few seconds in a test learns to agree with."""
    from speclab.generate import generate

    ids = [target.tokenizer(p)["input_ids"] for p in PROMPTS]
    texts = [p + generate(target, torch.tensor(p), "ar", max_new_tokens=length, temperature=t, seed=i).token_ids
             for i, p in enumerate(ids) for t in (0.0, 1.0)]
    return torch.tensor([t[:length] for t in texts if len(t) >= length])


def start_drafter(drafter, target, prompt: str) -> torch.Tensor:
    """Hand a drafter a prompt as the engine does at a decode's start (`reset` with the prompt's target features,
    then an empty first `catch_up`), ready to `propose`. Returns the prompt's ids."""
    ids = target.tokenizer(prompt, return_tensors="pt")["input_ids"][0]
    drafter.reset(ids, target.forward(ids, target.new_cache(), layers=drafter.layers).features[:-1])
    drafter.catch_up(ids[:0], None)
    return ids


# ---- tiny EAGLE-3 drafters --------------------------------------------------------------------------------------

def assert_drafts_as_unrolled(d, ids: torch.Tensor, i: int, unrolled, steps: int = 3) -> None:
    """An EAGLE-3-style drafter caught up to pair i (its root) drafts what training's unroll computed at row i:
    the root's logits, then each depth's node fed the window's own next token."""
    torch.testing.assert_close(d.root_logits[0], unrolled[0][0, i], atol=1e-4, rtol=1e-4)
    h = d.root_h
    with torch.inference_mode():
        for s in range(1, steps):
            h, logp = d._forward_nodes(ids[i + 1 + s : i + 2 + s], h, s, None)
            torch.testing.assert_close(logp[0], torch.log_softmax(unrolled[s][0, i], -1), atol=1e-4, rtol=1e-4)


def train_tiny_eagle3(target, steps: int = 120, seed: int = 0):
    """A drafter trained for a few seconds with speclab's own training step (training-time test, 3 steps) on the
    target's own text (its greedy and sampled continuations of the test prompts): it agrees with the target
    often, so trees get accepted paths. Its last step's per-depth accuracies are in `train_acc`."""
    from speclab.drafters.eagle3 import Eagle3Model, config_for
    from speclab.train.eagle3 import target_features, ttt_forward, ttt_loss

    torch.manual_seed(seed)
    windows = own_text_windows(target)
    m = Eagle3Model(config_for(target))
    with torch.no_grad():
        m.lm_head.weight.copy_(target.model.get_output_embeddings().weight)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    embed = target.model.get_input_embeddings()
    feats, dist = target_features(target.model, windows, m.config.layer_ids)
    for _ in range(steps):
        loss, _, accs, _, _ = ttt_loss(ttt_forward(m, embed, windows, feats, 3), dist, m, 0.8)
        loss.backward()
        opt.step()
        opt.zero_grad()
    m.train_acc = accs
    return m.eval().requires_grad_(False)


# ---- tiny DFlash drafters ---------------------------------------------------------------------------------------

def train_tiny_dflash(target, steps: int = 150, seed: int = 0):
    """A drafter trained for a few seconds with speclab's own training step (random anchors, blocks of 2..8, the
    Markov head on both readouts) on the target's own text (its greedy and sampled continuations of the test
    prompts): it agrees with the target often, so blocks get accepted prefixes. Its last step's metrics are in
    `train_metrics`."""
    from speclab.drafters.dflash import DFlashModel, config_for
    from speclab.train.dflash import block_forward, block_loss, pick_blocks, target_features

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    windows = own_text_windows(target)
    m = DFlashModel(config_for(target, markov_rank=8))
    embed_w = target.model.get_input_embeddings().weight
    head_w = target.model.get_output_embeddings().weight
    feats, top = target_features(target.model, windows, m.config.target_layer_ids)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    for _ in range(steps):
        size = int(rng.integers(2, 9))
        anchors = pick_blocks(windows.shape[1], size, 64, rng)
        loss, metrics = block_loss(m, block_forward(m, embed_w, head_w, windows, feats, anchors, size), windows, top,
                                   anchors, 4.0)
        loss.backward()
        opt.step()
        opt.zero_grad()
    m.train_metrics = metrics
    return m.eval().requires_grad_(False)


# ---- the command line -------------------------------------------------------------------------------------------

def run_cli(*args: str, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """`python -m speclab.cli ARGS` in a fresh process from the repository root (its output captured as text)."""
    return subprocess.run([sys.executable, "-m", "speclab.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO_ROOT, check=False, **kw)


def error_lines(err: str, prefix: str = "speclab: error:") -> list[str]:
    """The lines of stderr that are speclab's error messages."""
    return [ln for ln in err.splitlines() if ln.startswith(prefix)]


def assert_one_error_line(argv: list[str], says: str | tuple[str, ...], capsys) -> str:
    """`speclab ARGV` run in-process: exit code 2, stdout empty, and stderr exactly one line, speclab's error line,
    holding `says` (or one of them). Argparse's own errors (SystemExit) count alike. Returns that line."""
    from speclab.cli import main

    capsys.readouterr()  # what the test's own set-up printed
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own errors end the process, with the same one line and exit code 2
        rc = e.code
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    says = (says,) if isinstance(says, str) else says
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("speclab: error:"), (argv, rc, err)
    assert any(s in lines[0] for s in says), (argv, lines[0])
    assert out == ""
    return lines[0]
