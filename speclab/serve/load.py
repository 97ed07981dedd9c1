"""Load generators over a prompt suite and the serve bench (`speclab serve-bench`).

- Closed loop (`closed_loop`): N clients, each sending its next prompt as soon as its last request completes, so
  N requests are in flight until the suite runs out.
- Open loop (`open_loop`): Poisson arrivals at `rate` requests per second (exponential gaps drawn with `seed`),
  admitted when they arrive, up to the batch's `max_batch`; a request's TTFT includes its wait.

Both drive a `speclab.core.batch.Batch` step by step on its own clock and return the requests' `Done` records and the
steps; `serve_bench` runs every (policy, load) pair on the same prompts and one loaded target, each request's
output checked against its single-stream decode where asked.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from speclab.core.batch import Batch, Done, Request, StepEvent
from speclab.metrics import serving_metrics


@dataclass
class Served:
    """One load run: every request's outcome, every step, and the wall time from start to the last completion."""
    dones: list[Done]
    steps: list[StepEvent]
    makespan_s: float

    @property
    def metrics(self) -> dict[str, float]:
        return serving_metrics(self.dones, self.makespan_s)


def drafters_for(policy: str, method: str, target, models: dict, params: dict):
    """One request's drafters under `policy` (`Batch`'s `make_drafters`): none under `none`, else the method's."""
    from speclab.methods import build_method
    from speclab.serve.policies import parse_policy
    if parse_policy(policy)[0] == "none":
        return dict
    return lambda: build_method(method, target, models, params)[0]


def warm_up(target, make_drafters, prompts: list[torch.Tensor], sampling, max_batch: int, requests: int = 8,
            k: int = 8, tokens: int = 8) -> None:
    """One short batch before the measured runs (`speclab serve-bench`): `requests` prompts, `k` draft tokens each
    (more than 32 rows a step), `tokens` tokens. A first call does lazy work once per process (each weight's packed
    copies, oneDNN's for products of more than 32 rows, the native layers' weight lists): 160 ms at the first DFlash
    step of 8 requests here, which the first measured run to draft used to pay (and DSpark read as drafting's cost)."""
    from speclab.serve.policies import Fixed
    n = min(requests, len(prompts), max_batch)
    closed_loop(Batch(target, make_drafters, Fixed(k), sampling, max_batch=max_batch), prompts[:n], n, tokens)


def seed_of(batch: Batch, rid: int) -> int | None:
    """Request `rid`'s sampling seed: the batch's seed + rid (each request its own draws; None stays None)."""
    return None if batch.sampling.seed is None else batch.sampling.seed + rid


def closed_loop(batch: Batch, prompts: list[torch.Tensor], concurrency: int, max_new_tokens: int,
                on_step: Callable[[int], None] | None = None) -> Served:
    """`concurrency` clients over the prompts in order: each sends its next prompt when its last one completes."""
    steps: list[StepEvent] = []
    t0 = batch.now()
    for ev in closed_steps(batch, prompts, concurrency, max_new_tokens):
        steps.append(ev)
        if on_step is not None:
            on_step(len(batch.done))
    return Served([batch.done[i] for i in range(len(prompts))], steps, batch.now() - t0)


def closed_steps(batch: Batch, prompts: list[torch.Tensor], concurrency: int,
                 max_new_tokens: int) -> Iterator[StepEvent]:
    """The closed loop step by step (what the app streams): each batched step's StepEvent as it happens."""
    queue = list(enumerate(prompts))
    for _ in range(min(concurrency, len(queue))):
        rid, ids = queue.pop(0)
        batch.submit(Request(rid, ids, max_new_tokens, batch.now(), seed_of(batch, rid)))
    while not batch.idle:
        finished = len(batch.done)
        ev = batch.step()
        for _ in range(len(batch.done) - finished):  # each client that got its answer sends its next prompt
            if queue:
                rid, ids = queue.pop(0)
                batch.submit(Request(rid, ids, max_new_tokens, batch.now(), seed_of(batch, rid)))
        if ev is not None:
            yield ev


def open_loop(batch: Batch, prompts: list[torch.Tensor], rate: float, max_new_tokens: int, seed: int = 0,
              on_step: Callable[[int], None] | None = None) -> Served:
    """Poisson arrivals at `rate` per second, in the prompts' order; idle gaps are waited out in real time."""
    gen = torch.Generator().manual_seed(seed)
    gaps = torch.empty(len(prompts), dtype=torch.float64).exponential_(rate, generator=gen)
    t0 = batch.now()
    arrivals = (t0 + gaps.cumsum(0)).tolist()
    for rid, (ids, at) in enumerate(zip(prompts, arrivals)):
        batch.submit(Request(rid, ids, max_new_tokens, at, seed_of(batch, rid)))
    steps: list[StepEvent] = []
    while not batch.idle:
        ev = batch.step()
        if ev is not None:
            steps.append(ev)
        elif batch.waiting:  # nothing active: sleep until the next arrival
            time.sleep(max(0.0, min(r.arrival_s for r in batch.waiting) - batch.now()))
        if on_step is not None:
            on_step(len(batch.done))
    return Served([batch.done[i] for i in range(len(prompts))], steps, batch.now() - t0)
