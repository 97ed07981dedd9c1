"""Prompt suites from the bundled prompt sets in data/prompts/ (each folder has its SOURCE.md).

Spec-Bench categories (mt_bench, translation, summarization, qa, math_reasoning, rag), and domain suites
that fit the zoo: code (HumanEval, MBPP), math (GSM8K test, MATH-500), stories and literature (zoo
validation slices), plus `zoo` (all four zoo domains), `zoo-calibration` (more prompts of the same domains,
held out from `zoo`: for calibrating routers) and `demo`.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

from speclab.errors import InvalidInput
from speclab.zoo import REPO_ROOT

PROMPTS = REPO_ROOT / "data" / "prompts"
SPEC_BENCH = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
MT_BENCH_CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def _jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _spec_bench(category: str) -> list[dict]:
    rows = _jsonl(PROMPTS / "spec_bench" / "question.jsonl")
    keep = MT_BENCH_CATEGORIES if category == "mt_bench" else {category}
    return [{"prompt_id": f"spec_bench-{r['question_id']}", "category": category, "prompt": r["turns"][0], "chat": True}
            for r in rows if r["category"] in keep]


def _code() -> list[dict]:
    he = [{"prompt_id": r["task_id"], "category": "code", "prompt": r["prompt"], "chat": False}
          for r in _jsonl(PROMPTS / "humaneval" / "HumanEval.jsonl.gz")]
    mbpp = [{"prompt_id": f"mbpp-{r['task_id']}", "category": "code", "chat": False,
             "prompt": f'"""{r["text"]}\n{r["test_list"][0]}\n"""\n'}  # the task and one test, as a docstring
            for r in _jsonl(PROMPTS / "mbpp" / "mbpp.jsonl") if 11 <= r["task_id"] <= 510]
    return [x for pair in zip(he, mbpp) for x in pair]  # alternate the two sets


def _math() -> list[dict]:
    gsm = [{"prompt_id": f"gsm8k-{i}", "category": "math", "prompt": f"Question: {r['question'].strip()}\nAnswer:",
            "chat": False}
           for i, r in enumerate(_jsonl(PROMPTS / "gsm8k" / "test.jsonl"))]
    m500 = [{"prompt_id": r["unique_id"], "category": "math", "prompt": f"Question: {r['problem'].strip()}\nAnswer:",
             "chat": False}
            for r in _jsonl(PROMPTS / "math500" / "test.jsonl")]
    return [x for pair in zip(gsm, m500) for x in pair]


def _zoo_domain(domain: str | None, file: str = "zoo_domains.jsonl") -> list[dict]:
    rows = _jsonl(PROMPTS / file)
    return [{"prompt_id": r["id"], "category": r["category"], "prompt": r["prompt"], "chat": False}
            for r in rows if domain is None or r["category"] == domain]


SUITES = {
    **{c: (lambda c=c: _spec_bench(c)) for c in SPEC_BENCH},
    "spec_bench": lambda: [r for c in SPEC_BENCH for r in _spec_bench(c)],
    "code": _code,
    "math": _math,
    "stories": lambda: _zoo_domain("stories"),
    "literature": lambda: _zoo_domain("literature"),
    "zoo": lambda: _zoo_domain(None),
    "zoo-calibration": lambda: _zoo_domain(None, "zoo_calibration.jsonl"),  # held out from `zoo`: for calibration
    "demo": lambda: [{"prompt_id": r["id"], "category": r["category"], "prompt": r["prompt"], "chat": False}
                     for r in _jsonl(PROMPTS / "demo.jsonl")],
}


def load_suite(name: str, limit: int | None = None) -> list[dict]:
    """Prompts of a suite; with `limit`, at most that many per category (interleaved across categories)."""
    if name not in SUITES:
        raise InvalidInput(f"unknown suite '{name}'; available: {', '.join(SUITES)}")
    rows = SUITES[name]()
    if limit is None:
        return rows
    by_cat: dict[str, list[dict]] = {}
    for r in rows:
        by_cat.setdefault(r["category"], []).append(r)
    picked = [cat[:limit] for cat in by_cat.values()]
    return [r for i in range(limit) for cat in picked if i < len(cat) for r in [cat[i]]]
