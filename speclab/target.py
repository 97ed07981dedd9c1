"""`Target`: any Hugging Face causal LM behind the few operations speculative decoding needs.

The target holds weights only; the KV cache lives with the caller (one per decoding session), so one
loaded target can serve several sessions. Everything runs under `torch.inference_mode`.

Two backends compute the same forward: `lean` (speclab/lean.py: the Llama family over the model's own
weights, a preallocated KV cache; per call 1.2-1.5x faster for the zoo target and 1.9-2.3x for the zoo
draft on CPU, `speclab forward-costs`) and `hf` (the transformers forward with a DynamicCache, for every other architecture).
`auto` picks lean where it applies.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from speclab.errors import ModelNotFound
from speclab.lean import KVCache, LeanDecoder, supports

BACKENDS = ("auto", "lean", "hf")


def pick_device(device: str | None = None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_dtype(device: torch.device, dtype: str | torch.dtype | None = None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype:
        return {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
                "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}[dtype]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_causal_lm(name_or_path: str | Path, device=None, dtype=None):
    """Load model + tokenizer from a local directory or the local Hugging Face cache; never downloads."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(name_or_path).expanduser()
    local = path.is_dir()
    if not local and (path.exists() or str(name_or_path).startswith((".", "/", "~")) or str(name_or_path).count("/") > 1):
        raise ModelNotFound(f"no model directory at {path.resolve()} (a model is a folder with config.json and weights)")
    if local and not (path / "config.json").exists():
        raise ModelNotFound(f"{path.resolve()} has no config.json: not a Hugging Face model directory")
    src = str(path) if local else str(name_or_path)
    dev = pick_device(device)
    dt = pick_dtype(dev, dtype)
    try:
        tok = AutoTokenizer.from_pretrained(src, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(src, local_files_only=True, dtype=dt)
    except (OSError, ValueError) as e:
        if local:
            raise ModelNotFound(f"could not load the model in {path.resolve()}: {e}") from e
        from huggingface_hub.constants import HF_HUB_CACHE
        raise ModelNotFound(
            f"model '{name_or_path}' is neither a local directory (looked at {path.resolve()}) nor in the "
            f"Hugging Face cache ({HF_HUB_CACHE}); speclab never downloads weights") from e
    return model.to(dev).eval(), tok


@dataclass
class ForwardOut:
    logits: torch.Tensor  # [n, vocab] float32
    features: dict[int, torch.Tensor]  # layer id -> [n, hidden] output of that decoder layer


class Target:
    """A causal LM with prefill, tree-masked forward, layer feature capture and cache surgery."""

    def __init__(self, model, tokenizer, name: str = "", backend: str = "auto"):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)} (got {backend!r})")
        why_not = supports(model)
        if backend == "lean" and why_not:
            raise ValueError(f"the lean backend does not support this model: {why_not}")
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.lean = LeanDecoder(model) if backend != "hf" and not why_not else None
        self.backend = "lean" if self.lean else "hf"
        self.config = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_context = int(getattr(self.config, "max_position_embeddings", 2048))
        self.eos_ids = _eos_ids(model, tokenizer)
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks: dict[int, object] = {}
        self._capture = frozenset()
        self.calls = 0  # number of forwards since load (benchmarks read differences)

    @classmethod
    def load(cls, name_or_path: str | Path, device=None, dtype=None, backend: str = "auto") -> "Target":
        model, tok = load_causal_lm(name_or_path, device, dtype)
        return cls(model, tok, name=str(name_or_path), backend=backend)

    @property
    def layers(self):
        return self.model.model.layers

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def new_cache(self):
        if self.lean:
            return self.lean.new_cache()
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    def capture(self, layer_ids: list[int]) -> None:
        """Keep the outputs of these decoder layers on every forward (and only these)."""
        self._capture = frozenset(layer_ids)
        if self.lean:
            return
        for i in list(self._hooks):
            if i not in layer_ids:
                self._hooks.pop(i).remove()
        for i in layer_ids:
            if i not in self._hooks:
                self._hooks[i] = self.layers[i].register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def fn(_module, _inp, out):
            self._captured[i] = out[0] if isinstance(out, tuple) else out
        return fn

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache, position_ids: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, last: int | None = None) -> ForwardOut:
        """Forward `input_ids` [n] after the tokens already in `cache`.

        `position_ids` [n] default to cache_len + arange(n); `mask` is an additive float mask
        [1, 1, n, cache_len + n] (0 = attend, finfo.min = blocked) for tree attention, default causal.
        `last` limits the logits to the last rows (the LM head is a large share of a small model's call).
        """
        ids = input_ids.view(-1).to(self.device)
        pos = None if position_ids is None else position_ids.view(-1).to(self.device)
        if mask is not None:
            mask = mask.to(device=self.device, dtype=self.dtype)
        self.calls += 1
        if self.lean:
            logits, feats = self.lean.forward(ids, cache, pos, mask, self._capture, last)
            return ForwardOut(logits.float(), feats)
        self._captured.clear()
        out = self.model(input_ids=ids[None], position_ids=None if pos is None else pos[None], attention_mask=mask,
                         past_key_values=cache, use_cache=True, logits_to_keep=last or 0)
        feats = {i: h[0] for i, h in self._captured.items()}
        return ForwardOut(out.logits[0].float(), feats)

    def prefill(self, input_ids: torch.Tensor, cache) -> ForwardOut:
        """Forward a prompt; logits of its last position only."""
        return self.forward(input_ids, cache, last=1)


# ---- KV cache surgery (speclab's KVCache or transformers 5.x DynamicCache) ----

def crop_cache(cache, length: int) -> None:
    """Keep the first `length` positions."""
    if isinstance(cache, KVCache):
        return cache.crop(length)
    n = cache.get_seq_length() - length
    if n > 0:
        cache.crop(-n)


def keep_cache(cache, start: int, keep: torch.Tensor) -> None:
    """Keep positions [0, start) plus `start + keep` (indices relative to start, ascending): an accepted tree path."""
    if keep.numel() == 0 or int(keep[-1]) == keep.numel() - 1:  # ascending and unique, so a prefix: crop
        crop_cache(cache, start + keep.numel())
        return
    if isinstance(cache, KVCache):
        return cache.keep(start, keep)
    idx = torch.cat([torch.arange(start, device=keep.device), start + keep])
    for layer in cache.layers:
        i = idx.to(layer.keys.device)
        layer.keys = layer.keys.index_select(-2, i)
        layer.values = layer.values.index_select(-2, i)


def _eos_ids(model, tokenizer) -> list[int]:
    ids = set()
    for src in (getattr(model, "generation_config", None), model.config):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        if e is not None:
            ids.update(e if isinstance(e, (list, tuple)) else [e])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)
