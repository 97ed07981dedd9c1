"""llama.cpp, the CPU peer, through its Python bindings (llama-cpp-python, built from source by the set-up).

Three ways it decodes a prompt greedily (`decode`), each the bindings' own `Llama.generate` with the greedy sampler:
- `plain`: one token per forward;
- `pld`: its prompt-lookup drafting (`LlamaPromptLookupDecoding(max_ngram_size, num_pred_tokens)`);
- `sps`: draft-model speculation with a second GGUF model (the zoo draft), through the bindings' draft-model
  interface (`LlamaDraftModel`: the bindings ship no draft-model drafter, so `ModelDrafter` is one: it keeps the
  draft's KV cache across calls and drafts k tokens greedily, a forward each).
The bindings verify a draft by evaluating it in one batch and keeping the prefix the greedy sampler agrees with.
`Counted` records each drafting call, so every step's (drafted, accepted) is known exactly; llama.cpp's own timings
(`llama_perf_context`: prompt and generation ms) come with each decode.

Nothing here loads a model unless asked, and nothing imports llama_cpp until then (`available`).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from speclab.errors import InvalidInput

KINDS = ("plain", "pld", "sps")
# the draft lengths of the bench's llama.cpp peers: the fastest measured on the zoo (`speclab costs llamacpp`)
LLAMACPP_PLD_K = 2
LLAMACPP_SPS_K = 2


def available() -> str | None:
    """The bindings' version when llama-cpp-python is installed and loads (its library built), else None."""
    try:
        import llama_cpp
    except (ImportError, OSError, RuntimeError):
        return None
    return str(llama_cpp.__version__)


def threads() -> int:
    """The threads both engines use: torch's (the cores this process may run on, unless set lower: a Ray worker's
    own CPUs, `speclab.cluster`)."""
    import torch
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, torch.get_num_threads()))


def load(path: str | Path, *, vocab_only: bool = False, n_ctx: int = 1024, speculative: bool = False,
         n_threads: int | None = None):
    """A llama_cpp.Llama on GGUF file `path` (quiet; `speculative`: kept logits of every row, as drafting needs)."""
    if available() is None:
        raise InvalidInput("llama-cpp-python is not installed (scripts/setup.sh builds it into .venv)")
    from llama_cpp import Llama
    _setup()
    n = n_threads or threads()
    return Llama(model_path=str(path), vocab_only=vocab_only, n_ctx=n_ctx, n_threads=n, n_threads_batch=n,
                 logits_all=speculative, verbose=False)


_SETUP: list = []  # llama.cpp's log callback, kept alive while llama.cpp may call it (set up once a process)


def _setup() -> None:
    """Once a process: llama.cpp's own log lines off (its load messages would interleave with speclab's progress),
    and this module's drafters registered as the bindings' `LlamaDraftModel`s."""
    if _SETUP:
        return
    import ctypes

    import llama_cpp
    from llama_cpp.llama_speculative import LlamaDraftModel

    @llama_cpp.llama_log_callback
    def ignore(level, text, user_data):
        return None
    _SETUP.append(ignore)
    llama_cpp.llama_log_set(ignore, ctypes.c_void_p(0))
    LlamaDraftModel.register(ModelDrafter)
    LlamaDraftModel.register(Counted)


class ModelDrafter:
    """Draft-model drafting for the bindings (a `LlamaDraftModel`): k tokens, greedy, from a second Llama whose KV
    cache follows the target's text (the common prefix is kept, the rest evaluated)."""

    def __init__(self, draft, k: int):
        self.draft, self.k = draft, k

    def __call__(self, input_ids, /, **kwargs):
        import llama_cpp
        import numpy as np
        d = self.draft
        ids = np.asarray(input_ids, dtype=np.intc)
        n = min(d.n_tokens, len(ids))
        differ = np.flatnonzero(d.input_ids[:n] != ids[:n])  # the draft's cache keeps the common prefix
        keep = min(int(differ[0]) if differ.size else n, len(ids) - 1)  # at least one token evaluated: its logits
        d.n_tokens = keep  # draft the first token
        d.eval(ids[keep:].tolist())
        out = []
        vocab = d.n_vocab()
        for _ in range(self.k):
            if d.n_tokens >= d.n_ctx():
                break
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(d.ctx, -1), shape=(vocab,))
            t = int(np.argmax(logits))
            out.append(t)
            d.eval([t])
        return np.array(out, dtype=np.intc)


@dataclass
class Counted:
    """A drafter wrapped to record every call: the length of the text it drafted after and how many it drafted.
    Consecutive calls give each verification step's committed tokens (the text's growth), so its accepted count."""
    inner: object
    calls: list[tuple[int, int]] = field(default_factory=list)  # (text length, drafted)

    def __call__(self, input_ids, /, **kwargs):
        out = self.inner(input_ids, **kwargs)  # type: ignore[operator]
        self.calls.append((len(input_ids), len(out)))
        return out

    def steps(self, final_length: int) -> list[tuple[int, int]]:
        """(drafted, accepted) of every forward after the prefill, given the text's final length: a call's draft
        (perhaps empty: prompt lookup found nothing) is verified in the next forward, which commits its accepted
        drafts and one token of the target, as a speclab round does; a decode cut by the token budget truncates the
        last step's count (as any engine's raw counts)."""
        out = []
        for (n, k), nxt in zip(self.calls, [c[0] for c in self.calls[1:]] + [final_length]):
            if nxt > n:
                out.append((k, min(k, nxt - n - 1)))
        return out


@dataclass
class PeerDecode:
    ids: list[int]  # generated token ids
    elapsed_s: float  # wall time of the whole decode (prefill included), as speclab's runs
    prompt_ms: float  # llama.cpp's own timings (llama_perf_context): forwards of several tokens (the prompt, and
    eval_ms: float  # every speculative verification) and forwards of one token
    per_step: list[tuple[int, int]] | None  # (drafted, accepted) per verification step; None: plain decoding


def drafter(kind: str, k: int, draft=None):
    """The bindings' drafter of `kind` with k draft tokens a step, wrapped to count (None for plain)."""
    if kind == "plain":
        return None
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    _setup()
    if kind == "pld":
        inner = LlamaPromptLookupDecoding(max_ngram_size=3, num_pred_tokens=k)
    elif kind == "sps":
        if draft is None:
            raise InvalidInput("llama.cpp draft-model speculation needs a draft model")
        inner = ModelDrafter(draft, k)
    else:
        raise InvalidInput(f"llama.cpp decoding {kind!r}: one of {', '.join(KINDS)}")
    return Counted(inner)


def decode(llm, prompt: list[int], max_new_tokens: int, eos: list[int], counted: Counted | None = None) -> PeerDecode:
    """Greedy decode of `prompt` (ids) with `llm` (its `draft_model` set to `counted`, or None): up to
    `max_new_tokens` tokens, stopping after an eos id (kept, as speclab's runs keep theirs)."""
    import llama_cpp
    llm.draft_model = counted
    if counted is not None:
        counted.calls.clear()
        if isinstance(counted.inner, ModelDrafter):
            counted.inner.draft.reset()
    llm.reset()
    llama_cpp.llama_perf_context_reset(llm.ctx)
    out: list[int] = []
    t0 = time.perf_counter()
    for t in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(t))
        if t in eos or len(out) >= max_new_tokens:
            break
    secs = time.perf_counter() - t0
    perf = llama_cpp.llama_perf_context(llm.ctx)
    steps = counted.steps(len(prompt) + len(out)) if counted is not None else None
    return PeerDecode(out, secs, float(perf.t_p_eval_ms), float(perf.t_eval_ms), steps)


def engine_version() -> str:
    """The engine as a run row names it: bindings version and llama.cpp's build / CPU features."""
    import llama_cpp
    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    on = [part.split("=")[0].strip() for part in info.replace("CPU :", "").split("|") if part.strip().endswith("= 1")]
    return f"llama-cpp-python {llama_cpp.__version__} (CPU: {' '.join(on)})"


def round_trip(model_dir: str | Path, gguf_path: str | Path, texts) -> list[tuple[str, list, list]]:
    """Tokenize each text with the checkpoint's own tokenizer (tokenizer.json) and with llama.cpp reading the GGUF
    file (its vocabulary only; added tokens parsed as the checkpoint's tokenizer parses them); returns the (text,
    speclab ids, llama.cpp ids) of every text where they differ (empty: identical)."""
    from tokenizers import Tokenizer
    hf = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    vocab = load(gguf_path, vocab_only=True)
    bad = []
    for text in texts:
        ours = hf.encode(text, add_special_tokens=False).ids
        theirs = vocab.tokenize(text.encode(), add_bos=False, special=True) if text else []
        if ours != theirs:
            bad.append((text, ours, theirs))
    return bad
