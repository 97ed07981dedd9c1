"""`Target`: any Hugging Face causal LM behind the few operations speculative decoding needs.

The target holds weights only; the KV cache lives with the caller (one per decoding session), so one
loaded target can serve several sessions. Everything runs under `torch.inference_mode`.

Two backends compute the same forward: `lean` (speclab/core/lean.py: the Llama family over the model's own
weights, a preallocated KV cache; per call 1.2-1.5x faster for the zoo target and 1.9-2.3x for the zoo
draft on CPU, `speclab costs forward`) and `hf` (the transformers forward with a DynamicCache, for every other
architecture). `auto` picks lean where it applies.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from speclab.core import pages
from speclab.core.lean import KVCache, LeanDecoder, Segment, supports
from speclab.core.precision import Head, check_logits, dtype_name, pick_dtype
from speclab.errors import ModelNotFound

BACKENDS = ("auto", "lean", "hf")


def pick_device(device: str | None = None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def check_model_dir(name_or_path: str | Path) -> Path:
    """A local model directory (with config.json) or a hub name to look up in the local cache; anything else is
    ModelNotFound, without loading anything."""
    path = Path(name_or_path).expanduser()
    if not path.is_dir() and (path.exists() or str(name_or_path).startswith((".", "/", "~"))
                              or str(name_or_path).count("/") > 1):
        raise ModelNotFound(f"no model directory at {path.resolve()} "
                            "(a model is a folder with config.json and weights)")
    if path.is_dir() and not (path / "config.json").exists():
        raise ModelNotFound(f"{path.resolve()} has no config.json: not a Hugging Face model directory")
    return path


def quiet_loads() -> None:
    """No progress bars from transformers' loads and saves: each takes a second or less here, and a bar would
    come before an error line."""
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()


def load_causal_lm(name_or_path: str | Path, device=None, dtype=None):
    """Load model + tokenizer from a local directory or the local Hugging Face cache; never downloads."""
    from safetensors import SafetensorError
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    quiet_loads()
    path = check_model_dir(name_or_path)
    local = path.is_dir()
    src = str(path) if local else str(name_or_path)
    dev = pick_device(device)
    dt = pick_dtype(dev, dtype)
    where = path.resolve() if local else f"'{name_or_path}'"
    try:
        tok = AutoTokenizer.from_pretrained(src, local_files_only=True)
        config = AutoConfig.from_pretrained(src, local_files_only=True)
        archs = getattr(config, "architectures", None) or []
        if archs and not any(a.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")) for a in archs):
            raise ModelNotFound(f"{where} holds a {', '.join(archs)} (config.json 'architectures'), not a causal "
                                "language model: speculative decoding needs a left-to-right LM")
        loaded: Any = AutoModelForCausalLM.from_pretrained(  # (model, loading info); mismatches named below
            src, local_files_only=True, dtype=dt, output_loading_info=True, ignore_mismatched_sizes=True)
        model, info = loaded
    except (OSError, ValueError, RuntimeError, SafetensorError) as e:
        if isinstance(e, ModelNotFound):
            raise
        if isinstance(e, SafetensorError):
            raise ModelNotFound(f"the weights in {where} are truncated or corrupt ({_first_line(e)})") from e
        if local:
            raise ModelNotFound(f"could not load the model in {where}: {_first_line(e)}") from e
        from huggingface_hub.constants import HF_HUB_CACHE
        raise ModelNotFound(
            f"model '{name_or_path}' is neither a local directory (looked at {path.resolve()}) nor in the "
            f"Hugging Face cache ({HF_HUB_CACHE}); speclab never downloads weights") from e
    bad = [f"missing {_names(info.get('missing_keys'))}" if info.get("missing_keys") else "",
           f"mismatched {_names([k[0] if isinstance(k, tuple) else k for k in info.get('mismatched_keys') or []])}"
           if info.get("mismatched_keys") else ""]
    if any(bad):
        raise ModelNotFound(f"the weights in {where} do not match its config.json ({'; '.join(b for b in bad if b)}): "
                            "transformers would initialise those at random; is it the right directory?")
    return pages.place(model.to(dev).eval()), tok


def _names(keys, most: int = 4) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:most]) + (f" and {len(keys) - most} more" if len(keys) > most else "")


def _first_line(e: Exception) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    mism = [ln for ln in lines if "size mismatch" in ln or "shape" in ln.lower()]
    return "; ".join(mism[:3]) if mism else (lines[0] if lines else type(e).__name__)


@dataclass
class ForwardOut:
    logits: torch.Tensor  # [rows, vocab] float32: every input row, or the last `last` rows
    features: torch.Tensor | None  # [n, len(layers) * d]: outputs of the asked decoder layers, concatenated, every row
    hidden: torch.Tensor | None  # [rows, d]: final-norm hidden state of the rows whose logits are returned (if asked)
    future: torch.Tensor | None = None  # [m, d]: final-norm states of contemplate rows forwarded in the call (ConFu)


class ForwardClock:
    """Process-wide count and wall time of model forwards (targets and drafters). The engine reads differences
    around each phase, as it does with `Target.calls`, so several decodes interleaved round by round (the app)
    each see their own calls. On CUDA a forward returns before its kernels finish, so the time is only
    meaningful on CPU (the bench reports the model-call share there only)."""

    def __init__(self):
        self.calls, self.seconds, self._n = 0, 0.0, 1

    def __call__(self, n: int) -> ForwardClock:
        """`with forward_clock(n):` one call that runs n forwards (a native loop over a drafter's chain)."""
        self._n = n
        return self

    def __enter__(self):
        self._t0 = time.perf_counter()

    def __exit__(self, *exc):
        self.seconds += time.perf_counter() - self._t0
        self.calls += self._n
        self._n = 1


forward_clock = ForwardClock()


class Target:
    """A causal LM with prefill, tree-masked forward returning chosen layer features, and cache surgery.

    It holds weights and a call counter only: caches, features and signals belong to the caller, so one loaded
    target serves several interleaved decodes."""

    def __init__(self, model, tokenizer, name: str = "", backend: str = "auto", logits: str = "fp32",
                 exact: bool = False):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)} (got {backend!r})")
        why_not = supports(model)
        if backend == "lean" and why_not:
            raise ValueError(f"the lean backend does not support this model: {why_not}")
        if exact and (backend == "hf" or why_not):
            raise ValueError("exact mode runs on the lean forward only: "
                             + (why_not or "the hf backend was asked for"))
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.logits, self.exact = check_logits(logits), bool(exact)
        self.lean = LeanDecoder(model, logits, exact) if backend != "hf" and not why_not else None
        self.backend = "lean" if self.lean else "hf"
        self._head = self.lean.lm if self.lean else Head(model.get_output_embeddings().weight, logits)
        self.config = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        if self.device.type == "cuda":
            # cuDNN's attention (PyTorch's first choice for bf16 on Hopper) builds a plan for every new sequence
            # length: 35 ms per decoded token against 2.4 ms without it (zoo target, bf16, H200). A decode meets a
            # new length every step, so attention runs on the flash / memory-efficient kernels instead.
            torch.backends.cuda.enable_cudnn_sdp(False)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.hidden_size = int(self.config.hidden_size)
        self.max_context = int(getattr(self.config, "max_position_embeddings", 2048))
        self.eos_ids = _eos_ids(model, tokenizer)
        self.calls = 0  # number of forwards since load (benchmarks and the engine read differences)
        self.dtype_choice: str | None = None  # why --dtype auto chose this dtype (`DtypeDecision.line`), if it did

    @classmethod
    def load(cls, name_or_path: str | Path, device=None, dtype=None, backend: str = "auto", logits: str = "fp32",
             exact: bool = False) -> Target:
        model, tok = load_causal_lm(name_or_path, device, dtype)
        return cls(model, tok, name=str(name_or_path), backend=backend, logits=logits, exact=exact)

    @property
    def fp32_logits(self) -> bool:
        """Whether the head refines low-precision logits to fp32 (`speclab.core.precision.Head`). Drafters' logits
        stay in their dtype: verification accepts by the target's."""
        return self._head.refine

    @property
    def precision(self) -> dict:
        """How this target computes, for the run rows: dtype, logits dtype, exact mode."""
        return {"dtype": dtype_name(self.dtype), "logits_dtype": "float32" if self.fp32_logits or
                self.dtype == torch.float32 else dtype_name(self.dtype), "exact": self.exact}

    @property
    def fingerprint(self) -> str:
        """Which model this is, wherever its files lie and in any dtype: a hash of its shape and of a few of its
        embedding weights (rounded), for files made for one target (routing calibrations)."""
        import hashlib
        import json
        c = self.config
        shape = [c.model_type, self.vocab_size, self.hidden_size, self.num_layers, int(c.intermediate_size)]
        w = self.model.get_input_embeddings().weight[:4, :16].detach().float().cpu().numpy().round(2)
        return hashlib.sha1((json.dumps(shape) + w.tobytes().hex()).encode()).hexdigest()[:16]

    @property
    def decoder(self):
        """The transformers base model (embeddings, decoder layers, final norm)."""
        return self.model.get_decoder()

    @property
    def layers(self):
        d = self.decoder
        return d.layers if hasattr(d, "layers") else d.h

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def new_cache(self, capacity: int | None = None):
        """A KV cache for about `capacity` tokens (a decode's prompt + new tokens, and a drafter's room; None: the
        default size; it grows, except in exact mode)."""
        if self.lean:
            return self.lean.new_cache(capacity)
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache, position_ids: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, last: int | None = None, layers: tuple[int, ...] = (),
                hidden: bool = False, head=None, con=None) -> ForwardOut:
        """Forward `input_ids` [n] after the tokens already in `cache`.

        `position_ids` [n] default to cache_len + arange(n); `mask` is an additive float mask
        [1, 1, n, cache_len + n] (0 = attend, finfo.min = blocked) for tree attention, default causal.
        `last` limits the logits (and `hidden`) to the last rows (the LM head is a large share of a small
        model's call). `layers`: decoder layers whose outputs come back as `features` (layer i's output is
        transformers' `hidden_states[i + 1]`), concatenated in the order given. `hidden`: also return the
        final-norm hidden state of the returned rows (what the LM head sees). `head`: a callable that replaces
        the LM head on those states (a draft model's FlashHead, `drafters.flashhead`). `con`: contemplate rows in the
        same call (`speclab.core.lean.ConRows`, lean forward only), whose states come back as `future`.
        """
        ids = input_ids.view(-1).to(self.device)
        pos = None if position_ids is None else position_ids.view(-1).to(self.device)
        if mask is not None:
            mask = mask.to(device=self.device, dtype=self.dtype)
        layers = tuple(layers)
        self.calls += 1
        with forward_clock:
            if self.lean:
                logits, feats, h, future = self.lean.forward(ids, cache, pos, mask, layers, last, hidden, head, con)
                return ForwardOut(logits.float(), feats, h, future)
            if con is not None:
                raise ValueError("contemplate rows ride in the lean forward only (transformers': the after schedule)")
            return self._hf_forward(ids, cache, pos, mask, last, layers, hidden, head)

    @torch.inference_mode()
    def forward_many(self, segs: list[Segment], layers: tuple[int, ...] = (), hidden: bool = False) -> list[ForwardOut]:
        """Several sequences' rows, each after its own cache (`speclab.core.lean.Segment`), in ONE forward of the lean
        backend (its matrix products over all rows: `LeanDecoder.forward_many`); the hf backend and exact mode run
        them one by one. Each ForwardOut is what `forward` returns for that segment alone (every row's logits)."""
        segs = [s._replace(ids=s.ids.view(-1).to(self.device),
                           mask=None if s.mask is None else s.mask.to(device=self.device, dtype=self.dtype))
                for s in segs]
        if self.lean is None or self.exact:
            return [self.forward(s.ids, s.cache, s.pos, s.mask, layers=tuple(layers), hidden=hidden) for s in segs]
        self.calls += 1
        with forward_clock:
            outs = self.lean.forward_many(segs, tuple(layers), hidden)
        return [ForwardOut(lg.float(), f, h) for lg, f, h in outs]

    def _hf_forward(self, ids, cache, pos, mask, last, layers, hidden, head=None) -> ForwardOut:
        """The transformers forward; layer outputs come from forward hooks that live for this call only."""
        kept: dict[int, torch.Tensor] = {}
        hooks = [self.layers[i].register_forward_hook(
            lambda _m, _i, out, i=i: kept.__setitem__(i, out[0] if isinstance(out, tuple) else out))
            for i in set(layers)]
        try:
            out = self.decoder(input_ids=ids[None], position_ids=None if pos is None else pos[None],
                               attention_mask=mask, past_key_values=cache, use_cache=True)
        finally:
            for hk in hooks:
                hk.remove()
        h = out.last_hidden_state[0]  # transformers' final norm, in the model's dtype
        if last is not None:
            h = h[-last:]
        feats = torch.cat([kept[i][0] for i in layers], -1) if layers else None
        return ForwardOut((head or self._head)(h).float(), feats, h if hidden else None)

    def prefill(self, input_ids: torch.Tensor, cache, layers: tuple[int, ...] = (), last: int = 1,
                hidden: bool = False) -> ForwardOut:
        """Forward a prompt; logits of its last position (or `last` positions) only."""
        return self.forward(input_ids, cache, last=last, layers=layers, hidden=hidden)

    @property
    def embed_table(self) -> torch.Tensor | None:
        """The table `embed` takes rows of, where it is a plain lookup (the lean backend); None where transformers'
        embedding module runs (it may scale its rows)."""
        return self.lean.embed if self.lean else None

    @torch.inference_mode()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's input embeddings of `ids` [..., d] (drafters that share them: DFlash)."""
        if self.embed_table is not None:
            return self.embed_table[ids.to(self.device)]
        return self.model.get_input_embeddings()(ids.to(self.device))

    @torch.inference_mode()
    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head of the target over hidden states [..., d] -> float32 logits [..., vocab]."""
        if self.lean:
            return self.lm_head(self.lean.final_norm(h.to(self.dtype)))
        return self.lm_head(_final_norm(self.decoder)(h.to(self.dtype)))

    @torch.inference_mode()
    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head alone (no final norm) over already-normed states [..., d] (fp32 or the model's dtype) ->
        float32 logits (`speclab.core.precision.Head`)."""
        return self._head(h)

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head's weight [V, d] in the model's dtype (DFlash drafts through it, after its own norm)."""
        return self._head.weight


def _final_norm(decoder):
    for name in ("norm", "ln_f", "final_layernorm", "final_layer_norm"):
        if hasattr(decoder, name):
            return getattr(decoder, name)
    raise ValueError(f"cannot find the final norm of {type(decoder).__name__}")


# ---- KV cache surgery (speclab's KVCache or transformers 5.x DynamicCache) ----

def crop_cache(cache, length: int) -> None:
    """Keep the first `length` positions."""
    if isinstance(cache, KVCache):
        return cache.crop(length)
    n = cache.get_seq_length() - length
    if n > 0:
        cache.crop(-n)


def row_call(t: Target, ids: torch.Tensor, context: int):
    """`call(n)`: one forward of `ids[context : context + n]` after a `context`-token cache of `ids`, rolled back
    after the call (what `speclab costs` times; a model role's `ModelRole.call` for a target-shaped draft model)."""
    cache = t.new_cache(ids.numel() + 8)
    t.forward(ids[:context], cache)

    def call(n: int) -> None:
        t.forward(ids[context : context + n], cache)
        crop_cache(cache, context)
    return call


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
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        if e is not None:
            ids.update(e if isinstance(e, (list, tuple)) else [e])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)
