"""`generate`: the one public entry for decoding a prompt with any registered method, traced or not."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch

from speclab.checks import Bound, check_number, check_sampling
from speclab.core import verify
from speclab.core.engine import DecodeResult, RoundEvent, check_request, decode_rounds
from speclab.core.precision import DTYPES, dtype_name
from speclab.core.sampling import Sampling
from speclab.core.target import Target
from speclab.equality import output_hash
from speclab.errors import InvalidInput
from speclab.methods import build_method, check_models, get_method, method_params, split_dtype
from speclab.metrics import tau, tokens_per_s
from speclab.trace import TraceStore


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    method: str
    run_id: int | None
    decode: DecodeResult
    elapsed_s: float  # decode time (speclab.metrics): the decode's own phases + the trace's final flush

    @property
    def tokens_per_s(self) -> float:
        return tokens_per_s(len(self.token_ids), self.elapsed_s)

    def summary(self) -> dict:
        d = self.decode
        return {"run_id": self.run_id, "method": self.method, "tokens": len(self.token_ids), "rounds": d.rounds,
                "target_calls": d.target_calls, "tau": tau(len(self.token_ids), d.rounds),
                "elapsed_s": round(self.elapsed_s, 4), "tokens_per_s": round(self.tokens_per_s, 2),
                "stopped": d.stopped}


def check_text(prompt) -> None:
    """A prompt is non-empty text that UTF-8 can encode (no lone surrogates); else InvalidInput, before any model."""
    if prompt is None or not str(prompt).strip():
        raise InvalidInput("the prompt is empty")
    try:
        str(prompt).encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidInput(f"the prompt has a character UTF-8 cannot encode ({prompt[e.start]!r} at character "
                           f"{e.start}: a lone surrogate, as a JSON escape like \\ud800 makes); "
                           "nothing was decoded") from e


def encode_prompt(target: Target, prompt: str) -> torch.Tensor:
    check_text(prompt)
    return torch.tensor(target.tokenizer(prompt, add_special_tokens=False)["input_ids"], dtype=torch.long)


@dataclass
class Request:
    prompt_ids: torch.Tensor
    max_new_tokens: int
    sampling: Sampling
    params: dict  # the method's parameters, defaults filled in


def check_generation(target: Target, prompt: str | torch.Tensor, method: str, models: dict | None = None,
                     max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                     seed: int | None = None, params: dict | None = None) -> Request:
    """Every parameter of a decode checked before any model work (and before a run row exists): the method (a
    spec, `speclab.methods.parse_spec`) and the drafter models it needs (`models` by role), sampling,
    max_new_tokens, the prompt (tokenized: not empty, fits the context) and the method's parameters against the
    models. Raises InvalidInput naming the parameter, its value and what is allowed."""
    check_models(method, models or {})
    pinned = split_dtype(method)[1]
    if pinned and DTYPES[pinned] is not target.dtype:
        raise InvalidInput(f"method spec '{method}' decodes in {pinned}, but the target was loaded in "
                           f"{dtype_name(target.dtype)}: load it with --dtype {pinned}")
    temperature, top_k, top_p, seed = check_sampling(temperature, top_k, top_p, seed, target.vocab_size)
    max_new_tokens = check_number("max_new_tokens", max_new_tokens, int, Bound(1))
    prompt_ids = prompt.flatten().long() if isinstance(prompt, torch.Tensor) else encode_prompt(target, prompt)
    check_request(target, prompt_ids, max_new_tokens)
    return Request(prompt_ids, max_new_tokens, Sampling(temperature, top_k, top_p, seed),
                   method_params(method, params or {}, target, sampled=temperature > 0))


class Generation:
    """One decode with any registered method, traced or not, as an iterator of RoundEvents. `models` holds the
    models the method needs, by role (`speclab.methods.ROLES`: what `speclab.models.load_models` returns).

    `for ev in Generation(...)` drives it round by round (several can be interleaved, as the app's
    side-by-side view does); `.result` holds the GenerationResult at the end. With `trace`, the run row is
    written as the decode starts (building a Generation writes nothing: the app builds all its columns, every check
    and every drafter, before any row exists) and is `running` until the end, `failed` on an exception,
    `interrupted` on Ctrl-C, `cancelled` if the consumer stops early. Every parameter is checked before any model
    work (`speclab.checks`). `keep_logits` keeps each round's verification logits on its RoundEvent (for inspecting
    rounds).
    """

    def __init__(self, target: Target, prompt: str | torch.Tensor, method: str = "ar", *, models: dict | None = None,
                 max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int | None = None, deferred: bool = True, trace: TraceStore | None = None,
                 on_round: Callable[[RoundEvent], None] | None = None, prompt_id: str | None = None,
                 category: str | None = None, bench_id: str | None = None, keep_logits: bool = False,
                 group: str | None = None, **params):
        models = models or {}
        req = check_generation(target, prompt, method, models, max_new_tokens, temperature, top_k, top_p, seed, params)
        self.target, self.method, self.trace, self.on_round = target, method, trace, on_round
        self.prompt_ids, self.params, sampling = req.prompt_ids, req.params, req.sampling
        self.drafters, self.router = build_method(method, target, models, self.params, category, not sampling.greedy)
        self.kw = dict(max_new_tokens=req.max_new_tokens, sampling=sampling, deferred=deferred, keep_logits=keep_logits)
        self.result: GenerationResult | None = None
        self.run_id, self.writer = None, None
        self._run_row: dict = {}
        if trace is not None:  # written when the decode starts (`_open_run`): several Generations built side by side
            # (the app's columns) are all checked and built before any of them leaves a row
            self._run_row = dict(
                method=method, target=target.name, drafters=",".join(self.drafters) or None,
                router=self.router.policy if self.router else None,
                params={**self.params, "max_new_tokens": req.max_new_tokens, **asdict(sampling),
                        **({} if sampling.greedy else {"chain_verify": verify.CHAIN_RULE}),  # how chains were tested
                        "deferred": deferred, **{role: getattr(models.get(role), "name", None)
                                                 for role in get_method(method).needs},
                        **_own_dtypes(target, models, get_method(method).needs)},
                prompt_id=prompt_id, category=category, **run_device(target),
                prompt_text=prompt if isinstance(prompt, str) else None,
                prompt_tokens=self.prompt_ids.numel(), bench_id=bench_id, decode_group=group,
                eager=bool(getattr(self.router, "eager", False)))

    def _open_run(self) -> None:
        """The run row (status `running`) and its writer, once, as the decode starts."""
        if self.trace is not None and self.run_id is None:
            self.run_id = self.trace.start_run(**self._run_row)
            self.writer = self.trace.writer(self.run_id, self.target.tokenizer)

    def _so_far(self, committed: list[torch.Tensor]) -> dict:
        """The run row's figures of a decode that ended early: the tokens and rounds it committed, its text."""
        ids = torch.cat(committed) if committed else torch.zeros(0, dtype=torch.long)
        return {"new_tokens": ids.numel(), "rounds": len(committed),
                "output_text": self.target.tokenizer.decode(ids.tolist(), skip_special_tokens=True)}

    @property
    def record(self) -> bool:
        """Whether RoundEvents are built (traced, watched or kept for inspection); otherwise the engine's fast path
        yields None."""
        return self.trace is not None or self.on_round is not None or self.kw["keep_logits"]

    def __iter__(self) -> Iterator[RoundEvent | None]:
        self._open_run()
        rounds = decode_rounds(self.target, self.prompt_ids, self.drafters, self.router,
                               listeners=(self.writer,) if self.writer is not None else (), record=self.record,
                               **self.kw)
        status = "failed"
        committed: list[torch.Tensor] = []  # what a run that ends early had committed (its row says so)
        try:
            while True:
                try:
                    ev = next(rounds)
                except StopIteration as end:
                    res = end.value
                    break
                if ev is not None:
                    committed.append(ev.committed)
                if self.on_round is not None:
                    self.on_round(ev)
                yield ev
            status = "done"
        except GeneratorExit:
            status = "cancelled"
            raise
        except BaseException as e:
            if self.trace is not None:  # Ctrl-C is the user's choice, not a failure
                self.writer.flush()
                if isinstance(e, KeyboardInterrupt):
                    self.trace.finish_run(self.run_id, "interrupted", **self._so_far(committed))
                else:
                    self.trace.finish_run(self.run_id, "failed", error=f"{type(e).__name__}: {e}",
                                          **self._so_far(committed))
            raise
        finally:
            if self.trace is not None and status == "cancelled":
                self.writer.flush()
                self.trace.finish_run(self.run_id, "cancelled", **self._so_far(committed))
        text = self.target.tokenizer.decode(res.new_ids.tolist(), skip_special_tokens=True)
        elapsed = res.elapsed_s
        if self.trace is not None:
            t0 = time.perf_counter()
            self.writer.flush()  # the trace's last batch is part of the traced decode's time
            flush_s = time.perf_counter() - t0
            elapsed += flush_s
            self.trace.finish_run(self.run_id, "done", new_tokens=res.new_ids.numel(), rounds=res.rounds,
                                  target_calls=res.target_calls, elapsed_s=elapsed, wall_s=res.wall_s + flush_s,
                                  prefill_ms=res.prefill_ms, model_ms=model_ms(self.target, res),
                                  output_text=text, output_hash=output_hash(res.new_ids.tolist()))
        self.result = GenerationResult(text, res.new_ids.tolist(), self.method, self.run_id, res, elapsed)


def _own_dtypes(target: Target, models: dict, roles) -> dict:
    """`<role>_dtype` for each drafter model of `roles` that runs in another dtype than the target (--dtype auto's
    own-dtype roles: `precision.DtypeDecision.roles`) and `<role>_weights` "int8" for each whose products read int8
    weights (`--drafter-weights`), for the run row's params."""
    from speclab.core.layers import reads_int8
    from speclab.core.precision import dtype_name
    own = {role: getattr(models.get(role), "dtype", None) for role in roles}
    return {**{f"{role}_dtype": dtype_name(dt) for role, dt in own.items()
               if isinstance(dt, torch.dtype) and dt != target.dtype},
            **{f"{role}_weights": "int8" for role in roles
               if models.get(role) is not None and reads_int8(models[role])}}


def run_device(target: Target) -> dict:
    """Where and how a run computed, for its run row: device, dtype, logits dtype, exact mode and the CPU."""
    from speclab.core.precision import cpu_label
    return {"device": str(target.device), **target.precision, "cpu": cpu_label()}


def model_ms(target: Target, res: DecodeResult) -> float | None:
    """Time inside model forwards, for the trace: measured on CPU only (a CUDA forward returns before it ends)."""
    return res.model_s * 1e3 if target.device.type == "cpu" else None


def generate(target: Target, prompt: str | torch.Tensor, method: str = "ar", **kw) -> GenerationResult:
    """Decode `prompt` with `method` ("ar", "sps", "pld", ...; see speclab.methods.METHODS) to the end.

    Keyword arguments are those of `Generation`: models (by role: speclab.methods.ROLES), max_new_tokens,
    temperature (0 = greedy), top_k, top_p, seed, deferred, trace (a TraceStore), on_round (sees each RoundEvent
    live), prompt_id, category, bench_id, group (the decode group of runs decoded together: the app's Decode
    press, a bench's prompt), and the method's parameters (k, tree_topk, ...).
    """
    g = Generation(target, prompt, method, **kw)
    for _ in g:
        pass
    return g.result
