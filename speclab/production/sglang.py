"""SGLang's per-request speculative-decoding fields: `meta_info` of a native /generate response (also
`choices[i].meta_info` with `return_meta_info`), or `sglext.spec_tokens_details` of an OpenAI response (one object,
or one per choice when n > 1).

Their definitions (SGLang's TokenizerManager._calculate_spec_decoding_metrics) against speclab's:
- `spec_verify_ct`: verification steps = speclab's rounds.
- `spec_num_correct_drafts` (0.5.11: `spec_accepted_drafts`; up to 0.5.10: `spec_accept_token_num`): accepted
  draft tokens, bonus excluded.
- `spec_num_proposed_drafts` (`spec_proposed_drafts`, `spec_draft_token_num`): *nominal*, spec_verify_ct x
  (speculative_num_draft_tokens - 1) from the server's configuration, not the tokens each step drafted (for an
  EAGLE tree it counts tree nodes): speclab's acceptance rate over it inherits that.
- `spec_accept_length` = completion_tokens / spec_verify_ct: it counts the token the prefill sampled and misses
  what a stop cut, so it is not speclab's tau; tau is recomputed as 1 + correct / verify_ct.
- `spec_correct_drafts_histogram[j]` (`spec_accept_histogram`): steps with j correct drafts, trimmed at the largest j.
- `speculative_decoding_stats.accept_lengths` / `verify_lengths` (SGLang PR #34814's shape, where present): per
  step, both counting the root/bonus token: drafted = verify - 1, accepted = accept - 1.
"""
from __future__ import annotations

from speclab.errors import InvalidInput
from speclab.production.record import EngineRun, as_counts, as_int, histogram_rows

ENGINE = "sglang"
CORRECT = ("spec_num_correct_drafts", "spec_accepted_drafts", "spec_accept_token_num")  # newest name first
PROPOSED = ("spec_num_proposed_drafts", "spec_proposed_drafts", "spec_draft_token_num")
HISTOGRAM = ("spec_correct_drafts_histogram", "spec_accept_histogram")


def stats_of(obj: dict) -> list[tuple[dict, dict, str]]:
    """The response's SGLang records: (spec fields, the meta_info or choice they came with, where) for each
    request or choice; [] when there are none."""
    if not isinstance(obj, dict):
        return []
    out = []
    meta = obj.get("meta_info")
    if isinstance(meta, dict) and "spec_verify_ct" in meta:
        out.append((meta, meta, "meta_info"))
    for i, ch in enumerate(obj.get("choices") or []):
        m = ch.get("meta_info") if isinstance(ch, dict) else None
        if isinstance(m, dict) and "spec_verify_ct" in m:
            out.append((m, m, f"choices[{i}].meta_info"))
    ext = obj.get("sglext")
    det = ext.get("spec_tokens_details") if isinstance(ext, dict) else None
    if isinstance(det, dict):
        out.append((det, {}, "sglext.spec_tokens_details"))
    elif isinstance(det, list):
        out += [(d, {}, f"sglext.spec_tokens_details[{d.get('index', i)}]") for i, d in enumerate(det)
                if isinstance(d, dict)]
    return out


def _first(d: dict, keys: tuple[str, ...], where: str, required: bool = True):
    for key in keys:
        if key in d:
            return key, as_int(d, key, where)
    if required:
        raise InvalidInput(f"{where}: none of {', '.join(keys)} (SGLang's count of that, by version)")
    return None, None


def from_record(spec: dict, meta: dict, obj: dict, source: str, version: str | None = None,
                single: bool = True) -> EngineRun:
    """One SGLang request (or choice) as an EngineRun, checked. `single`: the response's only record (its usage and
    text are this record's; with n > 1 choices they are the response's, not one choice's)."""
    steps = as_int(spec, "spec_verify_ct", source)
    ckey, correct = _first(spec, CORRECT, source)
    pkey, proposed = _first(spec, PROPOSED, source, required=False)
    notes = [f"tau = 1 + {ckey} / spec_verify_ct (bonus included); SGLang's spec_accept_length (completion_tokens "
             "/ spec_verify_ct) counts the prefill's token and misses a stop's cut, so it is kept as reported only"]
    k = None
    if proposed is not None:
        k = proposed // steps if steps and proposed % steps == 0 else None
        notes.append(f"{pkey} is nominal (spec_verify_ct x (speculative_num_draft_tokens - 1), tree nodes for an "
                     "EAGLE tree): the acceptance rate over it is SGLang's, not an exact per-step count")
    hkey = next((key for key in HISTOGRAM if key in spec and spec[key]), None)
    rows: dict = {}
    if hkey:
        hist = as_counts(spec[hkey], hkey, source)
        k = max(k or 0, len(hist) - 1)
        rows = histogram_rows(hist, None)
        notes.append(f"{hkey} gives no drafted count per step: per-position acceptance counts every step as "
                     f"reaching every depth up to {k} (the engines' survival convention)")
    per_step = None
    stats = meta.get("speculative_decoding_stats") if isinstance(meta, dict) else None
    if isinstance(stats, dict) and "accept_lengths" in stats:
        acc = as_counts(stats.get("accept_lengths"), "accept_lengths", source)
        ver = as_counts(stats.get("verify_lengths"), "verify_lengths", source)
        if len(acc) != len(ver) or any(a < 1 or v < 1 for a, v in zip(acc, ver)):
            raise InvalidInput(f"{source}: accept_lengths and verify_lengths must be per-step lengths of at least 1 "
                               "(the root counts), of one length")
        per_step = [(v - 1, a - 1) for v, a in zip(ver, acc)]
        proposed = sum(v - 1 for v in ver)
        notes.append("per step from speculative_decoding_stats (accept/verify lengths include the root token: "
                     "minus 1 each); drafted counts are exact there")
    reported = {key: spec[key] for key in ("spec_accept_length", "spec_accept_rate") if key in spec}
    fields = {"request_id": meta.get("id") if isinstance(meta.get("id"), str) else obj.get("id"),
              "prompt_tokens": as_int(meta, "prompt_tokens", source, required=False),
              "new_tokens": as_int(meta, "completion_tokens", source, required=False),
              "elapsed_s": meta.get("e2e_latency") if isinstance(meta.get("e2e_latency"), (int, float)) else None,
              "output_text": obj.get("text") if isinstance(obj.get("text"), str) else None,
              "model": obj.get("model") if isinstance(obj.get("model"), str) else None}
    if single and fields["new_tokens"] is None and isinstance(obj.get("usage"), dict):
        fields["new_tokens"] = as_int(obj["usage"], "completion_tokens", source, required=False)
    return EngineRun(ENGINE, source, "request", steps, correct, proposed, k, rows, per_step, version=version,
                     reported=reported, notes=notes, **fields).check()
