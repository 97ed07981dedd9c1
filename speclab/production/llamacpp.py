"""llama.cpp server's speculative-decoding figures: `timings.draft_n` and `timings.draft_n_accepted` of a
/completion or OpenAI-style response (or of a stream's last chunk).

Their definitions (tools/server: server_slot::get_timings) against speclab's:
- `draft_n`: draft tokens generated for the request (absent: none were drafted); `draft_n_accepted`: of those,
  accepted (bonus excluded). Their ratio is speclab's acceptance rate.
- there is no step count per request (PR #27676's `draft_n_verif_steps` is read where a build has it): the steps
  are derived as predicted_n - 1 - draft_n_accepted (the prefill samples the first token; each step commits its
  accepted drafts and one token of its own), so tau = 1 + accepted / steps is *derived*, and a stop cut in the last
  step makes it slightly low.
- `predicted_n`: generated tokens (the first, from the prefill, included); prompt_ms + predicted_ms: the run's time.
Per-position rates come from the server's Prometheus counters (`speclab.production.prometheus`).
"""
from __future__ import annotations

from speclab.errors import InvalidInput
from speclab.production.record import EngineRun, as_int
from speclab.production.vllm import response_fields

ENGINE = "llama.cpp"


def stats_of(obj: dict):
    """The response's `timings` when it has llama.cpp's draft counts (None otherwise)."""
    t = obj.get("timings") if isinstance(obj, dict) else None
    return t if isinstance(t, dict) and "predicted_n" in t else None


def from_response(obj: dict, source: str, version: str | None = None) -> EngineRun:
    t = stats_of(obj)
    if t is None or "draft_n" not in t:
        raise InvalidInput(f"{source}: timings has no draft_n: llama.cpp reports it only when the request drafted "
                           "(a server started with a draft model or --spec-* options)")
    drafted, predicted = as_int(t, "draft_n", source), as_int(t, "predicted_n", source)
    accepted = as_int(t, "draft_n_accepted", source, required=False) or 0
    notes = ["draft_n_accepted excludes the bonus token, as speclab's accepted count does"]
    steps = as_int(t, "draft_n_verif_steps", source, required=False)
    if steps is None:
        steps = predicted - 1 - accepted
        if steps <= 0:
            raise InvalidInput(f"{source}: predicted_n = {predicted} with {accepted} accepted drafts leaves no "
                               "verification step: not counts of one request")
        notes.append(f"steps derived as predicted_n - 1 - draft_n_accepted = {steps} (llama.cpp gives no step "
                     "count per request): tau = 1 + accepted / steps is derived, slightly low if a stop cut the "
                     "last step")
    fields = response_fields(obj)
    if fields["new_tokens"] is None:
        fields["new_tokens"] = predicted
    ms = [t.get(k) for k in ("prompt_ms", "predicted_ms")]
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in ms):
        fields["elapsed_s"] = (ms[0] + ms[1]) / 1e3
    if fields["prompt_tokens"] is None:
        n = [as_int(t, k, source, required=False) for k in ("prompt_n", "cache_n")]
        fields["prompt_tokens"] = sum(v for v in n if v is not None) if n[0] is not None else None
    if fields["output_text"] is None and isinstance(obj.get("content"), str):
        fields["output_text"] = obj["content"]
    fp = obj.get("system_fingerprint")
    reported = {key: t[key] for key in ("draft_n", "draft_n_accepted", "predicted_n", "predicted_per_second")
                if key in t}
    return EngineRun(ENGINE, source, "request", steps, accepted, drafted, None, {}, None,
                     version=version or (fp if isinstance(fp, str) else None), reported=reported, notes=notes,
                     **fields).check()
