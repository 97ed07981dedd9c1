"""One imported run (`EngineRun`): an engine's speculative-decoding counts in speclab's terms, what the engine
reported verbatim, every conversion applied; its checks; and its rows in the trace.

speclab's terms (`speclab.metrics`): a *step* is one verification round; `accepted` counts accepted draft tokens
(the bonus token excluded); a round commits accepted + 1 tokens, so tau = (steps + accepted) / steps, the bonus
included. An engine's per-step figures become `rounds` rows and a chain of `draft_nodes` per round (depth d =
the engine's position p + 1), so speclab's own SQL (`run_metrics`, `position_acceptance`) and figures read them.
Where an engine gives only totals and a histogram, they go to `engine_totals` and `engine_steps` (steps by drafted
and accepted count), which the same SQL reads too.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from speclab.errors import InvalidInput
from speclab.metrics import tau

ENGINES = ("vllm", "sglang", "llama.cpp", "tensorrt_llm")  # the servers whose runs come in (TensorRT-LLM via AIPerf)


@dataclass
class EngineRun:
    """One request (or one server window between two scrapes) as an engine reported it, in speclab's terms."""
    engine: str  # one of ENGINES
    source: str  # the file and where in it ("answers.jsonl line 3")
    scope: str  # "request" or "server window"
    steps: int  # verification steps (speclab: rounds)
    accepted: int  # accepted draft tokens, bonus excluded
    drafted: int | None  # drafted tokens (None: the engine does not say)
    max_draft: int | None = None  # k, the most tokens one step drafts (the configured draft length)
    histogram: dict = field(default_factory=dict)  # (drafted in the step or None when unknown, accepted) -> steps
    per_step: list[tuple[int, int]] | None = None  # (drafted, accepted) of every step, in order
    version: str | None = None
    model: str | None = None
    request_id: str | None = None
    prompt_tokens: int | None = None
    new_tokens: int | None = None
    elapsed_s: float | None = None
    output_text: str | None = None
    reported: dict = field(default_factory=dict)  # the engine's own figures, verbatim
    notes: list[str] = field(default_factory=list)  # conversions and caveats, each said once

    @property
    def committed(self) -> int:
        """Tokens the rounds committed: each round its accepted drafts and the target's own token (raw verifier
        counts: a stop or max_tokens may cut the last round's)."""
        return self.steps + self.accepted

    @property
    def tau(self) -> float:
        return tau(self.committed, self.steps)

    def check(self) -> EngineRun:
        """The counts agree with one another (each engine's documented invariants), else InvalidInput naming the
        source; -> self."""
        where = f"{self.source}: "
        if self.steps <= 0:
            raise InvalidInput(f"{where}no speculative steps in it (steps = {self.steps}): nothing to import")
        if self.accepted < 0 or (self.drafted is not None and not 0 <= self.accepted <= self.drafted):
            raise InvalidInput(f"{where}{self.accepted} accepted draft tokens of {self.drafted} drafted: "
                               "not counts of one run")
        if self.per_step is not None:
            if len(self.per_step) != self.steps:
                raise InvalidInput(f"{where}{len(self.per_step)} per-step entries for {self.steps} steps")
            d, a = np.array(self.per_step, np.int64).reshape(-1, 2).T
            if (a < 0).any() or (a > d).any():
                raise InvalidInput(f"{where}a step accepted more draft tokens than it drafted (or fewer than 0)")
            if int(a.sum()) != self.accepted or (self.drafted is not None and int(d.sum()) != self.drafted):
                raise InvalidInput(f"{where}the per-step counts sum to {int(a.sum())} accepted / {int(d.sum())} "
                                   f"drafted, the totals say {self.accepted} / {self.drafted}")
        if self.histogram:
            n = sum(self.histogram.values())
            acc = sum(j * c for (_, j), c in self.histogram.items())
            if any(c < 0 for c in self.histogram.values()) or n != self.steps or acc != self.accepted:
                raise InvalidInput(f"{where}the histogram holds {n} steps and {acc} accepted tokens, the totals "
                                   f"say {self.steps} and {self.accepted}")
        return self

    def params(self) -> dict:
        """The run's card (`runs.params_json`): scope, k, what the engine reported and the conversions."""
        return {"engine": self.engine, "scope": self.scope, "max_draft": self.max_draft, "reported": self.reported,
                "conversions": self.notes, "per_step": self.per_step is not None}

    def meta(self, category: str | None, device: str | None) -> dict:
        """The run's row of `runs` (a finished run: imports land whole or not at all)."""
        return {"method": self.engine, "target": self.model, "drafters": self.engine, "router": None,
                "params_json": json.dumps(self.params(), sort_keys=True, default=str), "prompt_id": self.request_id,
                "category": category, "device": device, "prompt_tokens": self.prompt_tokens,
                "new_tokens": self.new_tokens, "rounds": self.steps, "elapsed_s": self.elapsed_s,
                "output_text": self.output_text, "engine": self.engine, "engine_version": self.version,
                "source": self.source}

    def tables(self) -> dict[str, pa.Table]:
        """Its rows (run_id filled in by the store): per step, `rounds` and a chain of `draft_nodes`; else
        `engine_totals` and `engine_steps`."""
        if self.per_step is not None:
            d, a = np.array(self.per_step, np.int64).reshape(-1, 2).T
            n = len(d)
            depth = np.concatenate([np.arange(1, k + 1) for k in d]) if d.sum() else np.zeros(0, np.int64)
            rnd = np.repeat(np.arange(n), d)
            rounds = pa.table({"round": np.arange(n, dtype=np.int32), "drafter": pa.array([self.engine] * n),
                               "n_drafted": d.astype(np.int32), "n_accepted": a.astype(np.int32),
                               "committed": (a + 1).astype(np.int32), "target_calls": np.ones(n, np.int32)})
            nodes = pa.table({"round": rnd.astype(np.int32), "node": (depth - 1).astype(np.int32),
                              "parent": (depth - 2).astype(np.int32), "depth": depth.astype(np.int32),
                              "accepted": depth <= np.repeat(a, d)})
            return {"rounds": rounds, "draft_nodes": nodes}
        totals = pa.table({"steps": [self.steps], "accepted": [self.accepted],
                           "drafted": pa.array([self.drafted], pa.int64()), "committed": [self.committed],
                           "max_draft": pa.array([self.max_draft], pa.int32())})
        keys = sorted(self.histogram, key=lambda kj: (kj[0] is None, kj[0] or 0, kj[1]))
        steps = pa.table({"drafted": pa.array([k for k, _ in keys], pa.int32()),
                          "accepted": pa.array([j for _, j in keys], pa.int32()),
                          "steps": pa.array([self.histogram[kj] for kj in keys], pa.int64())})
        return {"engine_totals": totals, "engine_steps": steps}


def histogram_rows(hist, k: int | None) -> dict:
    """A dense histogram (index j: steps that accepted j draft tokens) as (drafted, j) -> steps, with every step's
    drafted count `k` (None: unknown); empty bins left out."""
    return {(k, j): int(c) for j, c in enumerate(hist) if int(c)}


def as_int(obj: dict, key: str, where: str, required: bool = True) -> int | None:
    """obj[key] as a non-negative integer (a JSON number such as 43 or 43.0), else InvalidInput naming it."""
    v = obj.get(key)
    if v is None:
        if required:
            raise InvalidInput(f"{where}: no {key!r} (the engine's speculative-decoding fields are incomplete)")
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v < 0 or int(v) != v:
        raise InvalidInput(f"{where}: {key} = {v!r} is not a count")
    return int(v)


def as_counts(v, key: str, where: str) -> list[int]:
    """A JSON list of counts, else InvalidInput naming it."""
    if not isinstance(v, list) or any(isinstance(c, bool) or not isinstance(c, (int, float)) or c != c or c < 0
                                      or int(c) != c for c in v):
        raise InvalidInput(f"{where}: {key} is not a list of counts ({str(v)[:60]})")
    return [int(c) for c in v]


def per_step_pairs(sd: dict, source: str) -> list[tuple[int, int]]:
    """An engine's `per_step_accepted` / `per_step_drafted` lists as (drafted, accepted) per step, in order (vLLM's
    detailed level, and AIPerf's record of it); InvalidInput when either is not a list of counts or their lengths
    differ."""
    acc = as_counts(sd.get("per_step_accepted"), "per_step_accepted", source)
    dr = as_counts(sd.get("per_step_drafted"), "per_step_drafted", source)
    if len(acc) != len(dr):
        raise InvalidInput(f"{source}: per_step_accepted has {len(acc)} entries, per_step_drafted {len(dr)}")
    return list(zip(dr, acc))


def agree(source: str, key: str, reported, computed: float, shape: str) -> None:
    """An engine's reported ratio (`key`: mean_acceptance_length, draft_acceptance_rate) against its definition
    over the counts (`computed`), to 0.1%; absent (None) passes. Else InvalidInput, naming `shape` (what the file
    was expected to be)."""
    if reported is None:
        return
    if isinstance(reported, bool) or not isinstance(reported, (int, float)) or \
            not math.isclose(float(reported), computed, rel_tol=1e-3, abs_tol=1e-6):
        raise InvalidInput(f"{source}: {key} = {reported!r}, but its definition over the counts gives "
                           f"{computed:.6g}: {shape}")


def write_runs(store, runs: list[EngineRun], category: str | None = None, device: str | None = None) -> list[int]:
    """Every run into the trace in one transaction (all or nothing). -> their run ids."""
    return store.add_finished_runs([r.meta(category, device) for r in runs], [r.tables() for r in runs])
