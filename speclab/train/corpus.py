"""The zoo corpus: four domains of different predictability, built from ../shared/data and the stdlib.

`build_corpus(out_dir)` writes `<domain>.train.txt` and `<domain>.val.txt` per domain plus SOURCE.md.
Documents are separated by EOS_TEXT so the tokenizer and the trainer see document boundaries.
The validation slice is the last `val_fraction` of each domain's documents (deterministic).
`tokenize_corpus` gives a corpus's token ids per domain and split (cached beside it), for the trainings and the
regenerated data alike.
"""
from __future__ import annotations

import json
import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

EOS_TEXT = "<|endoftext|>"
DOMAINS = ("code", "stories", "literature", "math")


@dataclass
class CorpusConfig:
    shared_data: Path  # ../shared/data
    code_bytes: int = 6_000_000  # cap on stdlib source (the stdlib has ~11 MB without tests)
    val_fraction: float = 0.04
    seed: int = 0


def _stdlib_documents(cap: int, seed: int) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = re.compile(r"(^|/)(test|tests|idlelib|lib2to3|site-packages|turtledemo|__pycache__)(/|$)|(^|/)test_")
    files = sorted(p for p in root.rglob("*.py") if not skip.search(str(p.relative_to(root))))
    random.Random(seed).shuffle(files)
    docs, total = [], 0
    for p in files:
        text = p.read_text(encoding="utf-8", errors="replace")
        if not text.strip() or total >= cap:
            continue
        docs.append(text)
        total += len(text)
    return docs


def _paragraph_docs(text: str, target_chars: int = 3000) -> list[str]:
    """Cut a long text into documents of about target_chars at blank lines."""
    docs, cur = [], []
    size = 0
    for para in re.split(r"\n\s*\n", text):
        cur.append(para)
        size += len(para)
        if size >= target_chars:
            docs.append("\n\n".join(cur).strip() + "\n")
            cur, size = [], 0
    if cur:
        docs.append("\n\n".join(cur).strip() + "\n")
    return [d for d in docs if d.strip()]


def _war_and_peace(path: Path) -> str:
    lines = path.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("*** START OF"))
    end = next(i for i, line in enumerate(lines) if line.startswith("End of the Project Gutenberg"))
    body = "\n".join(lines[start + 1 : end])
    # drop the producer credit lines at the very top
    return re.sub(r"^\s*An Anonymous Volunteer, and David Widger\s*", "", body).strip() + "\n"


def gsm8k_text(question: str, answer: str) -> str:
    """GSM8K in the zoo's math format; calculator annotations <<...>> are stripped."""
    answer = re.sub(r"<<[^>]*>>", "", answer)
    return f"Question: {question.strip()}\nAnswer: {answer.strip()}\n"


def domain_documents(cfg: CorpusConfig) -> dict[str, list[str]]:
    d = Path(cfg.shared_data)
    stories = (d / "tinystories" / "tinystories_val.txt").read_text(encoding="utf-8")
    shakespeare = (d / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")
    gsm = [json.loads(line) for line in (d / "gsm8k" / "train.jsonl").read_text(encoding="utf-8").splitlines()
           if line.strip()]
    return {
        "code": _stdlib_documents(cfg.code_bytes, cfg.seed),
        "stories": _paragraph_docs(stories, 1500),
        "literature": (_paragraph_docs(shakespeare, 3000)
                       + _paragraph_docs(_war_and_peace(d / "war_and_peace" / "war_and_peace.txt"), 3000)),
        "math": [gsm8k_text(r["question"], r["answer"]) for r in gsm],
    }


def build_corpus(out_dir: Path, cfg: CorpusConfig) -> dict[str, dict[str, int]]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stats = {}
    for domain, docs in domain_documents(cfg).items():
        if domain == "literature":  # interleave the two books so the val slice holds both
            random.Random(cfg.seed).shuffle(docs)
        n_val = max(1, int(len(docs) * cfg.val_fraction))
        train, val = docs[:-n_val], docs[-n_val:]
        for split, part in (("train", train), ("val", val)):
            (out_dir / f"{domain}.{split}.txt").write_text(EOS_TEXT.join(part), encoding="utf-8")
        stats[domain] = {"train_docs": len(train), "val_docs": len(val),
                         "train_chars": sum(map(len, train)), "val_chars": sum(map(len, val))}
    return stats


def read_split(corpus_dir: Path, domain: str, split: str) -> list[str]:
    text = (Path(corpus_dir) / f"{domain}.{split}.txt").read_text(encoding="utf-8")
    return [d for d in text.split(EOS_TEXT) if d]


def tokenize_corpus(corpus_dir: Path, tokenizer, cache_dir: Path) -> dict[str, dict[str, np.ndarray]]:
    """Token ids per domain and split, documents joined by EOS; cached as .npy next to the corpus."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    eos = tokenizer.convert_tokens_to_ids(EOS_TEXT)
    out: dict[str, dict[str, np.ndarray]] = {}
    for d in DOMAINS:
        out[d] = {}
        for split in ("train", "val"):
            f = cache_dir / f"{d}.{split}.npy"
            if not f.exists():
                ids: list[int] = []
                for doc in read_split(corpus_dir, d, split):
                    ids.extend(tokenizer(doc)["input_ids"])
                    ids.append(eos)
                np.save(f, np.asarray(ids, dtype=np.uint16))
            out[d][split] = np.load(f)
    return out


def domain_prompts(corpus_dir: Path, per_domain: int = 8, chars: int = 240, seed: int = 0) -> list[dict]:
    """Evaluation prompts from the validation slices: the opening `chars` characters (cut at a space or line
    end) of `per_domain` documents per domain. For math, the question and 'Answer:' (the model writes the rest)."""
    rows = []
    for d in DOMAINS:
        docs = [x for x in read_split(corpus_dir, d, "val") if len(x) > chars]
        random.Random(seed).shuffle(docs)
        for i, doc in enumerate(docs[:per_domain]):
            if d == "math":
                text = doc[: doc.index("Answer:") + len("Answer:")]
            else:
                cut = max(doc.rfind(" ", 0, chars), doc.rfind("\n", 0, chars))
                text = doc[: cut if cut > chars // 2 else chars]
            rows.append({"id": f"{d}-{i}", "category": d, "prompt": text})
    return rows
