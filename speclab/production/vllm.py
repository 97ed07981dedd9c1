"""vLLM's per-request speculative-decoding metrics (`--per-request-spec-decode-metrics summary|detailed`): the
object `metrics.speculative_decoding` of a completion or chat response, or of the final usage chunk of a stream.

Its definitions (vLLM's docs/features/speculative_decoding/acceptance_metrics.md) against speclab's:
- `num_spec_steps`: verification steps = speclab's rounds; `num_accepted_draft_tokens` / `num_draft_tokens`:
  accepted (bonus excluded) and drafted tokens, as speclab counts them.
- `mean_acceptance_length` = 1 + accepted / steps: bonus included, speclab's tau; taken as is and checked.
- `draft_acceptance_rate` = accepted / drafted (a fraction): speclab's acceptance rate; checked.
- `acceptance_histogram[j]`: steps that accepted j draft tokens (dense, length k + 1);
  `acceptance_histogram_by_draft_length["k"][j]` the same per drafted count k (newer builds).
- `per_step_accepted` / `per_step_drafted` (detailed): one entry per step, in order: speclab's rounds.
"""
from __future__ import annotations

from speclab.errors import InvalidInput
from speclab.production.record import EngineRun, agree, as_counts, as_int, histogram_rows, per_step_pairs

ENGINE = "vllm"


def stats_of(obj: dict):
    """The response's `metrics.speculative_decoding` (None: absent; a JSON null is returned as {} to say why)."""
    metrics = obj.get("metrics") if isinstance(obj, dict) else None
    if not isinstance(metrics, dict) or "speculative_decoding" not in metrics:
        return None
    return metrics["speculative_decoding"] or {}


def from_response(obj: dict, source: str, version: str | None = None) -> EngineRun:
    """One vLLM response (or a stream's merged chunks) as an EngineRun, checked."""
    sd = stats_of(obj)
    if not sd:
        raise InvalidInput(f"{source}: metrics.speculative_decoding is null: vLLM fills it only with "
                           "--per-request-spec-decode-metrics summary|detailed, speculative decoding on and n = 1")
    steps, accepted = as_int(sd, "num_spec_steps", source), as_int(sd, "num_accepted_draft_tokens", source)
    drafted, k = as_int(sd, "num_draft_tokens", source), as_int(sd, "num_spec_tokens", source)
    hist = as_counts(sd.get("acceptance_histogram"), "acceptance_histogram", source)
    notes = ["mean_acceptance_length includes the bonus token (1 + accepted / steps), as speclab's tau does: "
             "taken as is, and checked against the counts",
             "positions: vLLM's 0-based position p is speclab's draft depth p + 1",
             "counts are the verifier's raw ones: a stop or max_tokens may commit fewer tokens in the last step"]
    by_len = sd.get("acceptance_histogram_by_draft_length")
    if by_len:
        if not isinstance(by_len, dict):
            raise InvalidInput(f"{source}: acceptance_histogram_by_draft_length is not an object keyed by draft "
                               "length")
        rows: dict = {}
        for key, h in by_len.items():
            if not str(key).isdigit():
                raise InvalidInput(f"{source}: acceptance_histogram_by_draft_length has a key {key!r}, not a "
                                   "draft length")
            rows |= histogram_rows(as_counts(h, f"acceptance_histogram_by_draft_length[{key}]", source), int(key))
        notes.append("per-position acceptance from acceptance_histogram_by_draft_length: exact (a step that "
                     "drafted k tokens reached depths 1..k)")
    elif drafted == k * steps:
        rows = histogram_rows(hist, k)
        notes.append(f"every step drafted k = {k} tokens (num_draft_tokens = k x steps): per-position acceptance "
                     "from acceptance_histogram is exact")
    else:
        rows = histogram_rows(hist, None)
        notes.append("draft lengths varied and there is no acceptance_histogram_by_draft_length: per-position "
                     "acceptance counts every step as reaching every depth (vLLM's own survival convention), "
                     "below speclab's conditional figure")
    per_step = None
    if "per_step_accepted" in sd or "per_step_drafted" in sd:
        per_step = per_step_pairs(sd, source)
        notes.append("per_step_accepted / per_step_drafted (detailed): one speclab round per step, in order")
    reported = {key: sd[key] for key in ("mean_acceptance_length", "draft_acceptance_rate") if key in sd}
    run = EngineRun(ENGINE, source, "request", steps, accepted, drafted, k, rows, per_step, reported=reported,
                    notes=notes, version=version or _version(obj), **response_fields(obj))
    run.check()
    if len(hist) != k + 1:
        raise InvalidInput(f"{source}: acceptance_histogram has {len(hist)} bins for num_spec_tokens = {k} "
                           f"(vLLM's is dense, k + 1 bins)")
    if sum(hist) != steps or sum(j * c for j, c in enumerate(hist)) != accepted:
        raise InvalidInput(f"{source}: acceptance_histogram holds {sum(hist)} steps and "
                           f"{sum(j * c for j, c in enumerate(hist))} accepted tokens, the counts say {steps} and "
                           f"{accepted}")
    shape = "not vLLM's documented shape (pin the vLLM version that wrote it)"
    agree(source, "mean_acceptance_length", reported.get("mean_acceptance_length"), run.tau, shape)
    agree(source, "draft_acceptance_rate", reported.get("draft_acceptance_rate"),
          accepted / drafted if drafted else 0.0, shape)
    return run


def _version(obj: dict) -> str | None:
    fp = obj.get("system_fingerprint")
    return fp[5:] if isinstance(fp, str) and fp.startswith("vllm-") else None


def response_fields(obj: dict) -> dict:
    """The request's id, model, token counts and text of an OpenAI-style response (what a run row keeps)."""
    usage = obj.get("usage") if isinstance(obj.get("usage"), dict) else {}
    choices = obj.get("choices") if isinstance(obj.get("choices"), list) else []
    first = choices[0] if choices and isinstance(choices[0], dict) else {}
    msg = first.get("message") if isinstance(first.get("message"), dict) else {}
    text = first.get("text", msg.get("content"))
    return {"request_id": _str(obj.get("id")), "model": _str(obj.get("model")),
            "prompt_tokens": _count(usage.get("prompt_tokens")), "new_tokens": _count(usage.get("completion_tokens")),
            "output_text": text if isinstance(text, str) else None}


def _str(v) -> str | None:
    return v if isinstance(v, str) else None


def _count(v) -> int | None:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and v >= 0 else None
