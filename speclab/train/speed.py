"""How fast the online drafter trainings run on this CPU, by setting (`python -m speclab.train.speed`).

One row per setting: the milliseconds of a training step split into its parts (the frozen target's forward, the
drafter's forward, the loss, the backward and the optimizer step) and the tokens per second. The settings vary one
thing at a time from EAGLE-3's old recipe (fp32, full-vocabulary loss, 3 TTT steps, the 8,192-token head): bf16
autocast, the loss on the target's top-32 tokens, 1-4 TTT steps, a smaller draft head; and DFlash in fp32 against
bf16; then the cost of a draft head at inference by its vocabulary. Measure on a quiet machine (nothing else
running): the figures are medians of `--steps` steps after two warm-up steps, on the same windows for every row.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace

import numpy as np
import torch

from speclab.train import lm


class _Laps:
    """Milliseconds between successive `lap()` calls."""

    def __init__(self):
        self.t, self.laps = time.perf_counter(), []

    def lap(self) -> None:
        now = time.perf_counter()
        self.laps.append((now - self.t) * 1e3)
        self.t = now


def _step_ms(m, cfg, data, steps: int, features, forward, loss) -> dict:
    """Median ms of each part of `steps` training steps (after two warm-up steps) of drafter `m`:
    features(ids) -> the target's part, forward(ids, feats) under the autocast of cfg.precision, loss(ids, feats,
    logits, out) -> the loss tensor; then the backward and the optimizer step."""
    opt = torch.optim.AdamW(list(m.parameters()), lr=1e-4)
    rng = np.random.default_rng(0)
    rows = []
    for i in range(steps + 2):
        ids = lm.sample_windows(data, lm.DOMAIN_WEIGHTS, cfg, rng)
        clock = _Laps()
        out = features(ids)
        clock.lap()
        with lm.autocast(cfg.precision):
            logits = forward(ids, out)
        clock.lap()
        value = loss(ids, logits, out)
        clock.lap()
        value.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        clock.lap()
        if i >= 2:
            rows.append(clock.laps)
    return _row(rows, cfg.batch_size * cfg.seq_len)


def eagle3_step_ms(cfg, target, data, steps: int) -> dict:
    from speclab.train.corpus import DOMAINS
    from speclab.train.eagle3 import new_drafter, target_features, ttt_forward, ttt_loss

    counts = sum(np.bincount(data[d]["train"], minlength=target.config.vocab_size) for d in DOMAINS)
    m = new_drafter(target, cfg, counts if cfg.draft_vocab_size else None)
    embed = target.get_input_embeddings()
    return _step_ms(m, cfg, data, steps,
                    lambda ids: target_features(target, ids, m.config.layer_ids, cfg.loss_topk),
                    lambda ids, out: ttt_forward(m, embed, ids, out[0], cfg.ttt_steps),
                    lambda ids, logits, out: ttt_loss(logits, out[1], m, cfg.step_weight)[0])


def dflash_step_ms(cfg, target, data, steps: int, mask_id: int) -> dict:
    from speclab.train.dflash import block_forward, block_loss, new_drafter, pick_blocks, target_features

    m = new_drafter(target, cfg, mask_id)
    embed_w, head_w = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    rng = np.random.default_rng(1)
    anchors = {}  # per window batch: drawn with the features, outside the timed forward

    def features(ids):
        anchors["a"] = pick_blocks(ids.shape[1], cfg.block_size, cfg.rows, rng)
        return target_features(target, ids, m.config.target_layer_ids)

    return _step_ms(m, cfg, data, steps, features,
                    lambda ids, out: block_forward(m, embed_w, head_w, ids, out[0], anchors["a"], cfg.block_size),
                    lambda ids, logits, out: block_loss(m, logits, ids, out[1], anchors["a"], cfg.gamma)[0])


def _row(rows: list[tuple], tokens: int) -> dict:
    med = np.median(np.array(rows), 0)
    total = float(med.sum())
    return {"target": med[0], "forward": med[1], "loss": med[2], "backward": med[3], "total": total,
            "loss_share": med[2] / total, "tok_s": tokens / total * 1e3}


def head_ms(vocab: int, rows: int, hidden: int = 512, reps: int = 200) -> float:
    """Median ms of a draft head's logits at inference: `rows` bf16 hidden states through a [vocab, hidden] bf16
    head with fp32 top logits (`speclab.core.precision.Head`, as the drafters run it)."""
    from speclab.core.precision import Head

    g = torch.Generator().manual_seed(0)
    head = Head(torch.randn(vocab, hidden, generator=g).to(torch.bfloat16))
    h = torch.randn(rows, hidden, generator=g).to(torch.bfloat16)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        head(h)
        times.append((time.perf_counter() - t) * 1e3)
    return float(np.median(times))


def head_table(vocabs=(8192, 4096, 2048, 1024), rows=(1, 8, 16)) -> str:
    lines = ["| draft head | " + " | ".join(f"{r} row{'s' if r > 1 else ''} ms" for r in rows) + " |",
             "|---|" + "---|" * len(rows)]
    for v in vocabs:
        lines.append(f"| {v} | " + " | ".join(f"{head_ms(v, r):.3f}" for r in rows) + " |")
    return "\n".join(lines)


def table(results: list[tuple[str, dict]]) -> str:
    lines = ["| setting | target ms | drafter fwd ms | loss ms | bwd + opt ms | step ms | loss share | tokens/s |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in results:
        lines.append(f"| {name} | {r['target']:.0f} | {r['forward']:.0f} | {r['loss']:.0f} | {r['backward']:.0f} | "
                     f"{r['total']:.0f} | {r['loss_share']:.0%} | {r['tok_s']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    from speclab import zoo
    from speclab.train.dflash import DFlashTrainConfig
    from speclab.train.eagle3 import Eagle3TrainConfig

    ap = argparse.ArgumentParser(prog="python -m speclab.train.speed", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--corpus", default=str(zoo.REPO_ROOT / "data" / "corpus"))
    ap.add_argument("--only", choices=["eagle3", "dflash", "heads"], default=None)
    a = ap.parse_args(argv)
    base = Eagle3TrainConfig(target_dir=str(zoo.default_target()), corpus_dir=a.corpus, out_dir="unused")
    targets: dict = {}

    def setup(precision):
        if precision not in targets:
            targets[precision] = lm.frozen_target_setup(replace(base, precision=precision))
        return targets[precision]

    results = []
    if a.only in (None, "eagle3"):
        settings = [("eagle3 fp32, full loss, 3 TTT, head 8192", {}),
                    ("eagle3 bf16 autocast", {"precision": "bf16"}),
                    ("eagle3 bf16, top-32 loss", {"precision": "bf16", "loss_topk": 32}),
                    ("eagle3 bf16, top-32, 1 TTT", {"precision": "bf16", "loss_topk": 32, "ttt_steps": 1}),
                    ("eagle3 bf16, top-32, 2 TTT", {"precision": "bf16", "loss_topk": 32, "ttt_steps": 2}),
                    ("eagle3 bf16, top-32, 4 TTT", {"precision": "bf16", "loss_topk": 32, "ttt_steps": 4}),
                    ("eagle3 bf16, top-32, 3 TTT, head 4096", {"precision": "bf16", "loss_topk": 32,
                                                                "draft_vocab_size": 4096}),
                    ("eagle3 bf16, top-32, 3 TTT, head 2048", {"precision": "bf16", "loss_topk": 32,
                                                                "draft_vocab_size": 2048})]
        for name, change in settings:
            cfg = replace(base, **change)
            _, data, target, _ = setup(cfg.precision)
            results.append((name, eagle3_step_ms(cfg, target, data, a.steps)))
            print(f"{name}: {results[-1][1]['tok_s']:.0f} tokens/s", flush=True)
    if a.only in (None, "dflash"):
        for precision in ("fp32", "bf16"):
            tok, data, target, _ = setup(precision)
            cfg = DFlashTrainConfig(target_dir=base.target_dir, corpus_dir=a.corpus, out_dir="unused",
                                    precision=precision)
            name = f"dflash {precision}, blocks of 16, top-32 loss"
            results.append((name, dflash_step_ms(cfg, target, data, a.steps,
                                                 tok.convert_tokens_to_ids(tok.mask_token))))
            print(f"{name}: {results[-1][1]['tok_s']:.0f} tokens/s", flush=True)
    if results:
        print(f"\nbatch {base.batch_size} x {base.seq_len} tokens, {torch.get_num_threads()} threads, median of "
              f"{a.steps} steps\n")
        print(table(results))
    if a.only in (None, "heads"):
        print(f"\ndraft head at inference (bf16, fp32 top logits), {torch.get_num_threads()} threads, median of 200\n")
        print(head_table())


if __name__ == "__main__":
    main()
