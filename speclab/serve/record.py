"""A serving session in the trace (`speclab.core.batch.Recorder`): every request a run (its rounds, tokens and draft
nodes as a single-stream decode writes them, each round with the batched `step` it was part of and its commit time),
every batched step a row of `steps`, all under one session id (the runs' `decode_group`, the steps' `session`).

A request's run row carries its arrival, first token and completion on the session's clock (`arrival_s`,
`first_token_s`, `done_s`: `run_metrics` derives TTFT, TPOT and ITL from them and the rounds), its elapsed time from
admission to completion, and `cancelled` when it was cancelled (with what it committed).
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from speclab.core.batch import Done, StepEvent, Stream
from speclab.core.engine import RoundEvent
from speclab.equality import output_hash
from speclab.generate import run_device
from speclab.methods import get_method
from speclab.serve.policies import parse_policy
from speclab.trace import RunWriter, TraceStore

STEP_PHASES = ("prefill", "policy", "draft", "verify", "commit")


def served_row(target, method: str, params: dict, policy: str, st: Stream, prompt: dict, **more) -> dict:
    """A served request's run row: its method (`ar` under the `none` policy: no drafter ran, and those runs are the
    serve's equality reference), the method's parameters with the policy and `more` (the load, ...), its prompt
    row and the device."""
    plain = parse_policy(policy)[0] == "none"
    return dict(method="ar" if plain else method, target=target.name,
                drafters=None if plain else get_method(method).drafter, router=None,
                params={**params, "policy": policy, **more}, prompt_id=prompt.get("prompt_id"),
                category=prompt.get("category"), prompt_text=prompt["prompt"],
                prompt_tokens=st.req.prompt_ids.numel(), **run_device(target))


class ServeRecorder:
    """`run_row(stream)`: the run row's fields of a request (method, params, prompt, device ...), from the caller."""

    def __init__(self, store: TraceStore, tokenizer, session: str, policy: str, run_row):
        self.store, self.tokenizer, self.session, self.policy, self.run_row = store, tokenizer, session, policy, run_row
        self.runs: dict[int, tuple[int, RunWriter]] = {}
        self.steps: list[StepEvent] = []

    def admitted(self, s: Stream) -> None:
        run_id = self.store.start_run(**self.run_row(s), decode_group=self.session, arrival_s=s.req.arrival_s)
        self.runs[s.req.rid] = (run_id, self.store.writer(run_id, self.tokenizer))

    def round(self, s: Stream, ev: RoundEvent) -> None:
        self.runs[s.req.rid][1](ev)

    def finished(self, s: Stream, done: Done) -> None:
        run_id, writer = self.runs.pop(s.req.rid)
        writer.flush()
        ids = done.new_ids.tolist()
        self.store.finish_run(
            run_id, "cancelled" if done.stopped == "cancelled" else "done", new_tokens=len(ids), rounds=done.rounds,
            target_calls=done.rounds + 1, elapsed_s=done.done_s - done.admitted_s, first_token_s=done.first_s,
            done_s=done.done_s, output_text=self.tokenizer.decode(ids, skip_special_tokens=True),
            output_hash=output_hash(ids))

    def step(self, ev: StepEvent) -> None:
        self.steps.append(ev)

    def flush(self) -> None:
        """The session's steps into `steps`, in one append."""
        evs, self.steps = self.steps, []
        if not evs:
            return

        def col(f, kind=np.int32):
            return np.array([f(e) for e in evs], kind)
        self.store.append({"steps": pa.table({
            "session": [self.session] * len(evs), "step": col(lambda e: e.step), "t_s": col(lambda e: e.t_s, float),
            "policy": [self.policy] * len(evs), "requests": col(lambda e: len(e.rids)), "rows": col(lambda e: e.rows),
            "drafted": col(lambda e: sum(e.drafted)), "accepted": col(lambda e: sum(e.accepted)),
            "target_calls": col(lambda e: e.target_calls), "drafter_calls": col(lambda e: e.drafter_calls),
            "admitted": col(lambda e: e.admitted),
            **{f"t_{k}_ms": col(lambda e, k=k: e.ms.get(k, 0.0), float) for k in STEP_PHASES}})})
