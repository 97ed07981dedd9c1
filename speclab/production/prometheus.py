"""A serving engine's speculative-decoding counters from two scrapes of its Prometheus endpoint, one before and one
after a run: their differences are one imported run over that window (every request the server served in it).

vLLM (`vllm:spec_decode_*`, exported with `_total`; one series per engine index, labels model_name and engine;
prometheus_client adds `_created` samples, timestamps, not counts) and llama.cpp (`llamacpp:spec_decode_*_total`,
server started with --metrics; counted as requests finish) export the same four counters:
- `num_drafts`: verification steps that drafted (speclab's rounds);
- `num_draft_tokens` / `num_accepted_tokens`: drafted and accepted tokens (bonus excluded);
- `num_accepted_tokens_per_pos{position=p}`: steps that accepted position p (0-based), i.e. accepted more than p.
tau = 1 + accepted / drafts. The per-position counters are a survival count over all steps, so the histogram of
accepted counts follows exactly: h[0] = drafts - A[0], h[j] = A[j-1] - A[j], h[k] = A[k-1].
"""
from __future__ import annotations

import math
import re

from speclab.errors import InvalidInput
from speclab.production.record import EngineRun

PREFIXES = {"vllm:spec_decode_": "vllm", "llamacpp:spec_decode_": "llama.cpp"}
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
PER_POS = "num_accepted_tokens_per_pos"
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$')
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


def parse(text: str, where: str) -> dict[tuple[str, tuple], float]:
    """Text exposition -> {(sample name, sorted label pairs): value}; a line that is not a sample or a comment is
    an InvalidInput naming it."""
    out = {}
    for i, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            raise InvalidInput(f"{where} line {i}: not a Prometheus sample ({line[:60]!r})")
        labels, rest = [], m.group(3) or ""
        while rest.strip():
            lm = _LABEL.match(rest)
            if not lm:
                raise InvalidInput(f"{where} line {i}: bad labels ({m.group(2)[:60]!r})")
            labels.append((lm.group(1), lm.group(2)))
            rest = rest[lm.end():]
        try:
            value = float(m.group(4))
        except ValueError:
            raise InvalidInput(f"{where} line {i}: {m.group(4)!r} is not a number") from None
        out[(m.group(1), tuple(sorted(labels)))] = value
    return out


def engine_of(samples: dict, where: str) -> tuple[str, str]:
    """(prefix, engine) of the speculative-decoding samples in a scrape."""
    found = {p for (name, _) in samples for p in PREFIXES if name.startswith(p)}
    if len(found) != 1:
        raise InvalidInput(f"{where}: {'no' if not found else 'more than one engine'}'s speculative-decoding "
                           f"counters ({', '.join(p + '*' for p in PREFIXES)}) in it")
    p = found.pop()
    return p, PREFIXES[p]


def _sums(samples: dict, prefix: str, model: str | None, where: str) -> tuple[dict, dict, set]:
    """Counter totals summed over engines (and per position), for one model; and the models seen."""
    models = {dict(lab).get("model_name") for (name, lab) in samples if name.startswith(prefix)} - {None}
    if model is None and len(models) > 1:
        raise InvalidInput(f"{where}: counters of several models ({', '.join(sorted(models))}): pick one with --model")
    if model is not None and models and model not in models:
        raise InvalidInput(f"{where}: no counters of model {model!r} (it has {', '.join(sorted(models))})")
    tot: dict[str, float] = {}
    created: dict = {}
    for (name, lab), v in samples.items():
        d = dict(lab)
        if not name.startswith(prefix) or (model is not None and d.get("model_name") not in (None, model)):
            continue
        base = name[len(prefix):]
        if base.endswith("_created"):
            created[(base, lab)] = v
            continue
        base = base.removesuffix("_total")
        if base == PER_POS:
            if "position" not in d or not d["position"].isdigit():
                raise InvalidInput(f"{where}: {name} without a numeric position label")
            base = f"{PER_POS}:{int(d['position'])}"
        tot[base] = tot.get(base, 0.0) + v
    return tot, created, models


def from_scrapes(before: str, after: str, before_where: str, after_where: str, model: str | None = None,
                 version: str | None = None) -> EngineRun:
    """The window between two scrapes as one EngineRun (scope "server window"), checked."""
    b, a = parse(before, before_where), parse(after, after_where)
    prefix, engine = engine_of(a, after_where)
    if engine_of(b, before_where)[1] != engine:
        raise InvalidInput(f"{before_where} and {after_where} are scrapes of different engines")
    tb, cb, _ = _sums(b, prefix, model, before_where)
    ta, ca, models = _sums(a, prefix, model, after_where)
    if any(cb.get(key) != v for key, v in ca.items() if key in cb):
        raise InvalidInput(f"the server restarted between {before_where} and {after_where} (a _created time "
                           "changed): the counters started again, so their difference means nothing")
    missing = [c for c in COUNTERS if c not in ta]
    if missing:
        raise InvalidInput(f"{after_where}: no {', '.join(prefix + c + '_total' for c in missing)}")
    delta = {key: ta[key] - tb.get(key, 0.0) for key in ta}
    neg = [key for key, v in delta.items() if v < 0]
    if neg:
        raise InvalidInput(f"{neg[0]} went down between {before_where} and {after_where}: the server restarted, or "
                           "the scrapes are in the wrong order (--before is the earlier one)")
    if any(v != math.floor(v) for v in delta.values()):
        raise InvalidInput(f"the counter differences between {before_where} and {after_where} are not whole counts")
    steps, drafted, accepted = (int(delta[c]) for c in COUNTERS)
    if steps == 0:
        raise InvalidInput(f"no speculative steps between {before_where} and {after_where}: the counters did not "
                           "move (was the run sent to this server between the scrapes?)")
    pos = sorted(int(key.split(":")[1]) for key in delta if key.startswith(PER_POS + ":"))
    notes = [f"{engine}'s counters over the window between the scrapes: every request served then is in it",
             "tau = 1 + num_accepted_tokens / num_drafts (the counters exclude the bonus token)",
             "positions: the 0-based position label p is speclab's draft depth p + 1"]
    rows, k = {}, None
    if pos:
        k = pos[-1] + 1
        if pos != list(range(k)):
            raise InvalidInput(f"{after_where}: per-position counters for positions {pos}, not 0..{k - 1}")
        surv = [int(delta[f"{PER_POS}:{p}"]) for p in range(k)] + [0]
        hist = [steps - surv[0]] + [surv[j - 1] - surv[j] for j in range(1, k + 1)]
        if min(hist) < 0:
            raise InvalidInput("the per-position counters do not fall with the position (or exceed num_drafts): "
                               "not one window of one server")
        fixed = drafted == k * steps
        rows = {(k if fixed else None, j): c for j, c in enumerate(hist) if c}
        how = (f"every step drafted k = {k} tokens: per-position acceptance is exact" if fixed else
               "draft lengths varied: per-position acceptance counts every step as reaching every depth (the "
               "engine's survival convention), below speclab's conditional figure")
        notes.append("the histogram of accepted counts follows from the per-position counters (steps accepting "
                     f"more than p); {how}")
    where = f"{before_where} .. {after_where}"
    return EngineRun(engine, where, "server window", steps, accepted, drafted, k, rows, None, version=version,
                     model=model or (next(iter(models)) if len(models) == 1 else None),
                     reported={c + "_delta": int(delta[c]) for c in COUNTERS}, notes=notes).check()
