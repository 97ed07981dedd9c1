"""A drafter's training curve measured by decoding (`speclab train curve`): every checkpoint a training kept
(`OUT/checkpoints/<tokens>`, written at each validation) decodes the zoo prompts with the target, greedily and at
temperature 1, and its tau (tokens per target call; speclab.metrics) is the curve's point.

The validation figures of the training log are implied by argmax matches on held-out windows; these are measured
on real decodes, so a drafter's curve and the zoo bench speak the same unit. Timing plays no part (tau counts
tokens and rounds), so the curve may be measured while another job runs.
"""
from __future__ import annotations

import json
from pathlib import Path

from speclab.progress import Progress

CURVE_FILE = "curve.json"


def checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(tokens seen, directory) of every kept checkpoint of a run, oldest first, then the final one (OUT/model)."""
    run = Path(run_dir)
    kept = sorted((int(p.name), p) for p in (run / "checkpoints").glob("[0-9]*") if p.is_dir())
    final = run / "model"
    if final.is_dir():
        card = final / "train_config.json"
        tokens = json.loads(card.read_text()).get("tokens", 0) if card.exists() else 0
        if not kept or tokens > kept[-1][0]:
            kept.append((tokens, final))
    return kept


def decode_tau(target, role: str, drafter, prompts: list[dict], new_tokens: int, temperature: float,
               seed: int = 0) -> dict[str, float]:
    """tau per category (and 'all') of `role`'s method over `prompts`: tokens / rounds, pooled."""
    from speclab.generate import generate
    from speclab.metrics import tau

    toks: dict[str, int] = {}
    rounds: dict[str, int] = {}
    for i, p in enumerate(prompts):
        r = generate(target, p["prompt"], role, models={role: drafter}, max_new_tokens=new_tokens,
                     temperature=temperature, seed=seed + i)
        for c in (p["category"], "all"):
            toks[c] = toks.get(c, 0) + len(r.token_ids)
            rounds[c] = rounds.get(c, 0) + r.decode.rounds
    return {c: tau(toks[c], rounds[c]) for c in toks}


def measure_curve(run_dir: str | Path, role: str, target, load, prompts: list[dict], new_tokens: int = 96,
                  temperatures: tuple[float, ...] = (0.0, 1.0), log=print) -> list[dict]:
    """One record per checkpoint: tokens seen and, per temperature, tau per category. Records already in
    RUN/curve.json for the same prompts and settings are reused, so a growing run is measured incrementally."""
    from speclab.files import write_atomic

    run = Path(run_dir)
    key = {"role": role, "prompts": [p["prompt_id"] for p in prompts], "new_tokens": new_tokens,
           "temperatures": list(temperatures)}
    saved = json.loads((run / CURVE_FILE).read_text()) if (run / CURVE_FILE).exists() else {}
    done = {r["tokens"]: r for r in saved.get("records", [])} if saved.get("key") == key else {}
    cps = checkpoints(run)
    prog = Progress(len(cps), f"curve of {run} (checkpoints)")
    out = []
    for i, (tokens, path) in enumerate(cps):
        if tokens not in done:
            drafter = load(path, target)
            done[tokens] = {"tokens": tokens, "checkpoint": path.name,
                            "tau": {str(t): decode_tau(target, role, drafter, prompts, new_tokens, t)
                                    for t in temperatures}}
            write_atomic(run / CURVE_FILE, json.dumps({"key": key, "records": sorted(done.values(),
                                                                                      key=lambda r: r["tokens"])}))
        out.append(done[tokens])
        prog.update(i + 1, tokens=f"{tokens / 1e6:.2f}M", tau=f"{done[tokens]['tau'][str(temperatures[0])]['all']:.2f}")
    return out


def curve_markdown(records: list[dict]) -> str:
    """Markdown: tokens seen, then per temperature tau overall and per category."""
    if not records:
        return "(no checkpoints)"
    temps = list(records[0]["tau"])
    cats = [c for c in records[0]["tau"][temps[0]] if c != "all"]
    head = ["tokens (M)"] + [f"T={t} {c}" for t in temps for c in ["all", *cats]]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        rows.append(f"| {r['tokens'] / 1e6:.2f} | "
                    + " | ".join(f"{r['tau'][t][c]:.2f}" for t in temps for c in ["all", *cats]) + " |")
    return "\n".join(rows)
