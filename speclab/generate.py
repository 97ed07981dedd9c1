"""`generate`: the one public entry for decoding a prompt with any registered method, traced or not."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from speclab.engine import DecodeResult, RoundEvent, decode
from speclab.errors import InvalidInput
from speclab.methods import get_method, method_params
from speclab.sampling import Sampling
from speclab.target import Target
from speclab.trace import TraceStore


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    method: str
    run_id: int | None
    decode: DecodeResult

    @property
    def tokens_per_s(self) -> float:
        return self.decode.tokens_per_s

    def summary(self) -> dict:
        d = self.decode
        return {"run_id": self.run_id, "method": self.method, "tokens": len(self.token_ids), "rounds": d.rounds,
                "target_calls": d.target_calls, "tau": len(self.token_ids) / max(1, d.rounds),
                "elapsed_s": round(d.elapsed_s, 4), "tokens_per_s": round(d.tokens_per_s, 2), "stopped": d.stopped}


def output_hash(token_ids: list[int]) -> str:
    """A short fingerprint of a token sequence: equal outputs (e.g. greedy speculative vs AR) have equal hashes."""
    import hashlib
    return hashlib.sha1(",".join(map(str, token_ids)).encode()).hexdigest()[:16]


def encode_prompt(target: Target, prompt: str) -> torch.Tensor:
    if prompt is None or not str(prompt).strip():
        raise InvalidInput("the prompt is empty")
    return torch.tensor(target.tokenizer(prompt, add_special_tokens=False)["input_ids"], dtype=torch.long)


def generate(target: Target, prompt: str | torch.Tensor, method: str = "ar", *, draft: Target | None = None,
             max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             seed: int | None = None, deferred: bool = True, trace: TraceStore | None = None,
             on_round: Callable[[RoundEvent], None] | None = None, prompt_id: str | None = None,
             category: str | None = None, bench_id: str | None = None, **params) -> GenerationResult:
    """Decode `prompt` with `method` ("ar", "sps", "pld", ...; see speclab.methods.METHODS).

    Greedy when temperature == 0. Method parameters (k, tree_topk, ...) are keyword arguments.
    With `trace`, the run and every round go to the DuckDB trace; `on_round` sees each RoundEvent live.
    """
    m = get_method(method)
    if not 0 <= top_p <= 1 or temperature < 0 or top_k < 0:
        raise InvalidInput(f"bad sampling parameters: temperature={temperature} (>= 0), top_k={top_k} (>= 0), top_p={top_p} (0..1)")
    prompt_ids = prompt.flatten().long() if isinstance(prompt, torch.Tensor) else encode_prompt(target, prompt)
    p = method_params(method, params)
    drafters = {m.name: m.build(target, draft, **p)} if m.build else {}
    sampling = Sampling(temperature, top_k, top_p, seed)
    listeners = [on_round] if on_round else []
    run_id, writer = None, None
    if trace is not None:
        from speclab.engine import check_request
        check_request(target, prompt_ids, max_new_tokens)  # bad input never leaves a failed run behind
        run_id = trace.start_run(
            method=method, target=target.name, drafters=",".join(drafters) or None, router="fixed",
            params={**p, "max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k,
                    "top_p": top_p, "seed": seed, "deferred": deferred, "draft": draft.name if draft else None},
            prompt_id=prompt_id, category=category, device=str(target.device), dtype=str(target.dtype).replace("torch.", ""),
            prompt_text=prompt if isinstance(prompt, str) else None, prompt_tokens=prompt_ids.numel(), bench_id=bench_id)
        writer = trace.writer(run_id, target.tokenizer)
        listeners.insert(0, writer)
    try:
        res = decode(target, prompt_ids, drafters, max_new_tokens=max_new_tokens, sampling=sampling,
                     deferred=deferred, listeners=tuple(listeners))
    except BaseException as e:
        if trace is not None:
            writer.flush()
            trace.finish_run(run_id, "failed", error=f"{type(e).__name__}: {e}")
        raise
    text = target.tokenizer.decode(res.new_ids.tolist(), skip_special_tokens=True)
    if trace is not None:
        writer.flush()
        trace.finish_run(run_id, "done", new_tokens=res.new_ids.numel(), rounds=res.rounds,
                         target_calls=res.target_calls, elapsed_s=res.elapsed_s, output_text=text,
                         output_hash=output_hash(res.new_ids.tolist()))
    return GenerationResult(text, res.new_ids.tolist(), method, run_id, res)
