"""NVIDIA AIPerf's per-request records (`profile_export.jsonl`, one JSON object per line): the engine-neutral
`spec_decode_acceptance` record AIPerf attaches to each request whose server reported speculative-decoding stats
(`SpecDecodeAcceptanceRecord`, src/aiperf/common/models/spec_decode_models.py).

Its definitions against speclab's:
- `num_spec_steps`: verification steps = speclab's rounds; `num_accepted_draft_tokens` / `num_draft_tokens`:
  accepted (bonus excluded) and drafted tokens, as speclab counts them; `num_spec_tokens`: k (absent: variable).
- `mean_acceptance_length` = 1 + accepted / steps: speclab's tau; `draft_acceptance_rate` = accepted / drafted, a
  fraction (the `metrics` entry `spec_decode_draft_acceptance_rate` is the same in percent): both checked.
- `acceptance_histogram`: SPARSE, {accepted count: steps}, zero bins left out, integer keys (strings once written
  as JSON), unlike vLLM's dense list; checked to sum to the steps and the accepted count.
- `per_step_accepted` / `per_step_drafted` (vLLM's detailed level through AIPerf): one speclab round per step.
- `engine` names the server AIPerf measured (vllm, tensorrt_llm, llamacpp): the run's engine.
The line's `metadata.x_request_id` is the run's request id; `metrics` give its prompt and output token counts and
`request_latency` its time. A line of a failed request (an `error`, no record) or of the warm-up phase is no run:
`skip_reason` says why, and the import counts it and goes on (a file of such lines alone imports nothing: refused).
"""
from __future__ import annotations

from speclab.errors import InvalidInput
from speclab.production.record import EngineRun, agree, as_int, per_step_pairs

ENGINES = {"vllm": "vllm", "tensorrt_llm": "tensorrt_llm", "trtllm": "tensorrt_llm", "llamacpp": "llama.cpp",
           "llama.cpp": "llama.cpp", "sglang": "sglang"}  # AIPerf's engine names -> the trace's
_SECONDS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "sec": 1.0, "s": 1.0}


def stats_of(obj: dict):
    """The line's `spec_decode_acceptance` when it is an AIPerf record (a `metadata` and `metrics` beside it)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("metadata"), dict) or "metrics" not in obj:
        return None
    if "spec_decode_acceptance" not in obj and isinstance(obj.get("error"), dict):
        return {}
    return obj.get("spec_decode_acceptance")


def skip_reason(obj: dict) -> str | None:
    """Why an AIPerf line is no run (a failed request, the warm-up phase), or None."""
    if obj.get("spec_decode_acceptance") is None and isinstance(obj.get("error"), dict):
        err = obj["error"]
        return f"a failed request ({str(err.get('type') or err.get('message') or 'error')[:60]})"
    if (obj.get("metadata") or {}).get("benchmark_phase") == "warmup":
        return "the warm-up phase"
    return None


def _metric(obj: dict, tag: str):
    m = (obj.get("metrics") or {}).get(tag)
    return m if isinstance(m, dict) and isinstance(m.get("value"), (int, float)) and not isinstance(m["value"], bool) \
        else None


def _histogram(h, source: str, k: int | None) -> dict:
    """The sparse histogram as speclab's (drafted or None, accepted) -> steps."""
    if not isinstance(h, dict):
        raise InvalidInput(f"{source}: acceptance_histogram is not an object {{accepted count: steps}} (AIPerf's "
                           "is sparse)")
    out = {}
    for key, c in h.items():
        if not str(key).isdigit():
            raise InvalidInput(f"{source}: acceptance_histogram has a key {key!r}, not an accepted count")
        count = as_int({"c": c}, "c", f"{source}: acceptance_histogram[{key}]")
        if count:
            out[(k, int(key))] = count
    return out


def from_record(obj: dict, source: str, version: str | None = None) -> EngineRun:
    """One AIPerf record line as an EngineRun, checked."""
    sd = stats_of(obj)
    if not sd:
        err = obj.get("error") if isinstance(obj, dict) else None
        why = f" (the request failed: {str(err.get('message') or err.get('type'))[:80]})" if isinstance(err, dict) \
            else ""
        raise InvalidInput(f"{source}: no spec_decode_acceptance record{why}: AIPerf writes one only when the "
                           "server reported per-request speculative-decoding stats")
    if not isinstance(sd, dict):
        raise InvalidInput(f"{source}: spec_decode_acceptance is not an object")
    engine = ENGINES.get(str(sd.get("engine")))
    if engine is None:
        raise InvalidInput(f"{source}: spec_decode_acceptance.engine = {sd.get('engine')!r}, not one AIPerf names "
                           f"({', '.join(sorted(set(ENGINES)))})")
    steps, accepted = as_int(sd, "num_spec_steps", source), as_int(sd, "num_accepted_draft_tokens", source)
    drafted, k = as_int(sd, "num_draft_tokens", source), as_int(sd, "num_spec_tokens", source, required=False)
    fixed = k is not None and drafted == k * steps
    hist = _histogram(sd.get("acceptance_histogram", {}), source, k if fixed else None)
    notes = ["imported from AIPerf's per-request record (spec_decode_acceptance), engine-neutral",
             "acceptance_histogram is sparse ({accepted: steps}, zero bins left out), unlike vLLM's dense list",
             "mean_acceptance_length includes the bonus token (1 + accepted / steps), as speclab's tau does: taken "
             "as is, and checked against the counts",
             (f"every step drafted k = {k} tokens: per-position acceptance from the histogram is exact" if fixed else
              "draft lengths varied (or k is not given): per-position acceptance counts every step as reaching "
              "every depth")]
    per_step = None
    if sd.get("per_step_accepted") is not None or sd.get("per_step_drafted") is not None:
        per_step = per_step_pairs(sd, source)
        notes.append("per_step_accepted / per_step_drafted: one speclab round per step, in order")
    meta = obj["metadata"]
    latency = _metric(obj, "request_latency")
    elapsed = latency["value"] * _SECONDS[latency["unit"]] if latency and latency.get("unit") in _SECONDS else None
    out = _metric(obj, "output_token_count") or _metric(obj, "output_sequence_length")
    isl = _metric(obj, "input_sequence_length")
    reported = {key: sd[key] for key in ("mean_acceptance_length", "draft_acceptance_rate", "acceptance_histogram")
                if key in sd}
    rid = meta.get("x_request_id") or meta.get("x_correlation_id")
    run = EngineRun(engine, source, "request", steps, accepted, drafted, k, hist, per_step, reported=reported,
                    notes=notes, version=version, request_id=rid if isinstance(rid, str) else None,
                    prompt_tokens=int(isl["value"]) if isl else None,
                    new_tokens=int(out["value"]) if out else as_int(sd, "completion_tokens", source, required=False),
                    elapsed_s=elapsed)
    run.check()
    for key, computed in (("mean_acceptance_length", run.tau),
                          ("draft_acceptance_rate", accepted / drafted if drafted else 0.0)):
        agree(source, key, sd.get(key), computed, "not AIPerf's documented record")
    return run
