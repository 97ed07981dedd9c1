"""Which files hold what: a saved response (JSON), many (a JSON list, or JSON lines such as a benchmark's results
or an OpenAI batch output), a saved event stream (`data: {...}` lines: the chunks merged into one response, its
text joined, its last usage chunk's metrics kept); and which engine wrote each response."""
from __future__ import annotations

import json
from pathlib import Path

from speclab.errors import InvalidInput
from speclab.production import aiperf, llamacpp, sglang, vllm
from speclab.production.record import EngineRun

SOURCES = ("vllm", "sglang", "llama.cpp", "aiperf")  # the shapes a response can have (--engine)

MAX_BYTES = 512 << 20


def read_text(path: str, what: str = "file") -> str:
    p = Path(path).expanduser()
    if not p.is_file():
        raise InvalidInput(f"{what} {path}: no such file")
    if p.stat().st_size > MAX_BYTES:
        raise InvalidInput(f"{what} {path}: {p.stat().st_size >> 20} MB, more than a saved response should be")
    try:
        return p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidInput(f"{what} {path}: cannot be read as text ({e})") from None


def responses(path: str) -> list[tuple[dict, str]]:
    """The responses a file holds, each with where it is ("answers.jsonl line 3")."""
    text = read_text(path)
    name = Path(path).name
    if not text.strip():
        raise InvalidInput(f"{path}: the file is empty")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if any(ln.startswith("data:") for ln in lines):
        return [(_merge_stream(lines, name), f"{name} (stream)")]
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        obj = None
    if isinstance(obj, dict):
        return [(_unwrap(obj), name)]
    if isinstance(obj, list):
        if not all(isinstance(o, dict) for o in obj):
            raise InvalidInput(f"{path}: a JSON list whose items are not all response objects")
        return [(_unwrap(o), f"{name} item {i}") for i, o in enumerate(obj)]
    out = []
    for i, ln in enumerate(text.splitlines(), 1):
        if not ln.strip():
            continue
        try:
            o = json.loads(ln)
        except json.JSONDecodeError as e:
            raise InvalidInput(f"{path} line {i}: not JSON ({e.msg}); a file to import holds a JSON response, a "
                               "JSON list of them, JSON lines, or a saved event stream (data: lines)") from None
        if not isinstance(o, dict):
            raise InvalidInput(f"{path} line {i}: not a response object")
        out.append((_unwrap(o), f"{name} line {i}"))
    return out


def _unwrap(obj: dict) -> dict:
    """An OpenAI batch output line keeps the response in response.body."""
    resp = obj.get("response")
    if isinstance(resp, dict) and isinstance(resp.get("body"), dict):
        return resp["body"]
    return obj


def _merge_stream(lines: list[str], name: str) -> dict:
    """A saved server-sent event stream as one response: the chunks' text joined; usage, metrics, timings,
    meta_info and sglext from the chunks that carry them (the last wins)."""
    merged: dict = {"choices": [{"text": ""}]}
    for i, ln in enumerate(lines, 1):
        if not ln.startswith("data:"):
            continue
        body = ln[5:].strip()
        if body == "[DONE]":
            continue
        try:
            chunk = json.loads(body)
        except json.JSONDecodeError as e:
            raise InvalidInput(f"{name}: event {i} is not JSON ({e.msg})") from None
        if not isinstance(chunk, dict):
            continue
        for key in ("id", "model", "system_fingerprint", "usage", "metrics", "timings", "meta_info", "sglext"):
            if chunk.get(key) is not None:
                merged[key] = chunk[key]
        for ch in chunk.get("choices") or []:
            if isinstance(ch, dict) and ch.get("index", 0) == 0:
                delta = ch.get("delta") if isinstance(ch.get("delta"), dict) else {}
                piece = ch.get("text", delta.get("content"))
                if isinstance(piece, str):
                    merged["choices"][0]["text"] += piece
        if isinstance(chunk.get("content"), str):  # llama.cpp's native stream
            merged["choices"][0]["text"] += chunk["content"]
    return merged


def detect(obj: dict) -> list[str]:
    """The engines whose speculative-decoding fields a response has (AIPerf's record: "aiperf")."""
    if aiperf.stats_of(obj) is not None:
        return ["aiperf"]
    found = []
    if vllm.stats_of(obj) is not None:
        found.append("vllm")
    if sglang.stats_of(obj):
        found.append("sglang")
    if llamacpp.stats_of(obj) is not None:
        found.append("llama.cpp")
    return found


def runs_of(obj: dict, where: str, engine: str = "auto", version: str | None = None) -> list[EngineRun]:
    """The imported runs of one response (SGLang: one per choice that has its fields)."""
    found = detect(obj)
    if engine != "auto":
        if engine not in found:
            raise InvalidInput(f"{where}: no {engine} speculative-decoding fields in it"
                               + (f" (it looks like {', '.join(found)}: leave --engine out)" if found else ""))
        found = [engine]
    if not found:
        raise InvalidInput(f"{where}: no speculative-decoding figures of {', '.join(SOURCES)} in it (vLLM: "
                           "metrics.speculative_decoding; SGLang: meta_info.spec_verify_ct or sglext."
                           "spec_tokens_details; llama.cpp: timings.draft_n; AIPerf: a record line's "
                           "spec_decode_acceptance)")
    if len(found) > 1:
        raise InvalidInput(f"{where}: it has the fields of {' and '.join(found)}: say which with --engine")
    if found[0] == "vllm":
        return [vllm.from_response(obj, where, version)]
    if found[0] == "llama.cpp":
        return [llamacpp.from_response(obj, where, version)]
    if found[0] == "aiperf":
        return [aiperf.from_record(obj, where, version)]
    recs = sglang.stats_of(obj)
    return [sglang.from_record(spec, meta, obj, f"{where} {loc}" if len(recs) > 1 else where, version, len(recs) == 1)
            for spec, meta, loc in recs]


def import_files(paths: list[str], engine: str = "auto", version: str | None = None,
                 skipped: list | None = None) -> list[EngineRun]:
    """Every run of every file, all parsed and checked before anything is written. AIPerf lines that are no run
    (a failed request, the warm-up phase) go to `skipped` as (where, why) when it is given; a file of those alone
    is refused."""
    if engine not in ("auto", *SOURCES):
        raise InvalidInput(f"--engine {engine!r}: one of auto, {', '.join(SOURCES)}")
    runs, passed = [], []
    for path in paths:
        before, skipped_before = len(runs), len(passed)
        for obj, where in responses(path):
            why = aiperf.skip_reason(obj) if detect(obj) == ["aiperf"] else None
            if why is not None and engine in ("auto", "aiperf"):
                passed.append((where, why))
            else:
                runs += runs_of(obj, where, engine, version)
        if len(runs) == before and len(passed) > skipped_before:
            raise InvalidInput(f"{path}: no run in it ({len(passed) - skipped_before} AIPerf line(s) of failed "
                               "requests or the warm-up phase, which are no runs)")
    if skipped is not None:
        skipped += passed
    return runs
