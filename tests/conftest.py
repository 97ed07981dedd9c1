"""Fixtures: tiny Qwen3 / Llama models built from configs (no downloads), saved as HF directories."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from speclab.core.target import Target
from speclab.zoo import tokenizer_dir

torch.set_num_threads(2)


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


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    paths = {"qwen3": build_tiny("qwen3", d / "qwen3", seed=0), "llama": build_tiny("llama", d / "llama", seed=1)}
    paths["qwen3_draft"] = perturbed(paths["qwen3"], d / "qwen3_draft", noise=0.15, seed=2)
    return paths


@pytest.fixture(scope="session")
def qwen3(model_dir) -> Target:
    return Target.load(model_dir["qwen3"], dtype="fp32")


@pytest.fixture(scope="session")
def llama(model_dir) -> Target:
    return Target.load(model_dir["llama"], dtype="fp32")


@pytest.fixture(scope="session")
def qwen3_hf(model_dir) -> Target:
    """The same tiny Qwen3 on the transformers forward (DynamicCache) instead of speclab's lean forward."""
    return Target.load(model_dir["qwen3"], dtype="fp32", backend="hf")


@pytest.fixture(scope="session")
def qwen3_draft_hf(model_dir) -> Target:
    return Target.load(model_dir["qwen3_draft"], dtype="fp32", backend="hf")


@pytest.fixture(scope="session")
def qwen3_draft(model_dir) -> Target:
    return Target.load(model_dir["qwen3_draft"], dtype="fp32")


PROMPTS = ["def add(a, b):\n    return", "Once upon a time, a little dog", "Question: Tom has 3 apples. How many",
           "KING HENRY:\nWhat say you"]


def own_text_windows(target, length: int = 48):
    """[n, length] windows of the target's own text (its greedy and sampled continuations of PROMPTS): what a
    drafter trained for a few seconds in a test learns to agree with."""
    from speclab.generate import generate

    ids = [target.tokenizer(p)["input_ids"] for p in PROMPTS]
    texts = [p + generate(target, torch.tensor(p), "ar", max_new_tokens=length, temperature=t, seed=i).token_ids
             for i, p in enumerate(ids) for t in (0.0, 1.0)]
    return torch.tensor([t[:length] for t in texts if len(t) >= length])


@pytest.fixture(scope="session")
def deep(tmp_path_factory):
    """A tiny 4-layer Qwen3 target with the zoo tokenizer (which reserves <|mask|> = 2): EAGLE-3 reads three
    distinct layers of it, DFlash three as well."""
    return Target.load(build_tiny("qwen3", tmp_path_factory.mktemp("deep") / "t4", seed=7, layers=4), dtype="fp32")


@pytest.fixture(scope="session")
def tiny_v8(tmp_path_factory):
    """A tiny 4-layer target over an 8-token vocabulary without a tokenizer (exact joint distributions are cheap):
    the end-to-end sampling tests of drafters that read target layers."""
    from test_sampling import V, _NoTok
    from transformers import AutoModelForCausalLM

    path = build_tiny("qwen3", tmp_path_factory.mktemp("v8") / "t", seed=5, vocab_size=V, tokenizer=False,
                      hidden=32, init=0.08, layers=4)
    target = Target(AutoModelForCausalLM.from_pretrained(path).eval(), _NoTok())
    target.eos_ids = []
    return target
