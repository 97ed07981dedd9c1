"""Re-create the zoo from ../shared/data: corpus -> tokenizer -> target -> distilled draft -> EAGLE-3 and DFlash
drafters on the corpus -> the target's own continuations -> both drafters trained on them, then for sampling (and
DSpark's confidence head on DFlash) -> EAGLE-3 on a third folder of continuations -> evaluation.

`speclab zoo build` runs the whole recipe (hours on a 2-core CPU; never in CI). `speclab zoo eval`
measures the per-domain validation loss and bits per byte of the zoo models, the table of the model card.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from speclab.train.corpus import CorpusConfig, build_corpus, tokenize_corpus
from speclab.train.lm import (
    ModelShape,
    TrainConfig,
    evaluate,
    train_lm,
)
from speclab.train.tokenizer import train_tokenizer
from speclab.zoo import REPO_ROOT, zoo_dir

TARGET_SHAPE = ModelShape(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
                          head_dim=64, intermediate_size=1536, max_position_embeddings=1024)
DRAFT_SHAPE = ModelShape(hidden_size=192, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                         head_dim=32, intermediate_size=512, max_position_embeddings=1024)


@dataclass
class ZooBuildConfig:
    shared_data: str = "../shared/data"
    target_minutes: float = 100.0
    draft_pretrain_minutes: float = 20.0
    draft_minutes: float = 20.0
    draft_more_minutes: float = 45.0  # a second distillation pass at a lower LR (the zoo's draft had 13 + 45 min)
    eagle3_minutes: float = 87.0  # EAGLE-3 drafter, online from the frozen target (data/zoo/eagle3/README.md)
    dflash_minutes: float = 95.0  # DFlash drafter with DSpark's Markov head (data/zoo/dflash/README.md)
    # the target's own continuations, greedy and sampled, trained on together (speclab.train.regenerate; README
    # "Training the drafters" has the measurement that chose both)
    regen_modes: tuple[str, ...] = ("greedy", "sample")
    v2_minutes: float = 60.0  # both drafters on the regenerated data, from their corpus checkpoints, bf16 autocast
    v2_lr: float = 1e-3
    v2_eagle3_vocab: int = 4096  # the EAGLE-3 head's draft vocabulary after step 10
    # step 11, EAGLE-3 trained for sampling (data/zoo/eagle3/README.md "Drafters v3"): the target's full distribution
    # as the loss, then with DSpark's acceptance term added, on the same regenerated data
    v3_minutes: tuple[float, float] = (40.0, 25.0)
    v3_lr: tuple[float, float] = (3e-4, 2e-4)
    v3_loss_tv: float = 1.0
    # step 12, DFlash trained for sampling (data/zoo/dflash/README.md "Drafter v3"): the full distribution and the
    # acceptance term together, then DSpark's confidence head on it (the head reads the drafter's states)
    dflash_v3_minutes: float = 50.0
    dflash_v3_lr: float = 3e-4
    dspark_minutes: float = 15.0
    # step 13, EAGLE-3 v4 (data/zoo/eagle3/README.md "Drafter v4"): a third folder of continuations (other prompt
    # windows, every other row sampled) beside the first two, v3's loss
    v4_regen_seed: int = 1
    v4_minutes: float = 55.0
    v4_lr: float = 3e-4
    seed: int = 0
    work_dir: str = "build/zoo"


def build_zoo(cfg: ZooBuildConfig) -> None:
    corpus = REPO_ROOT / "data" / "corpus"
    zoo = zoo_dir()
    work = Path(cfg.work_dir)
    print(f"[1/13] corpus -> {corpus}", flush=True)
    print(json.dumps(build_corpus(corpus, CorpusConfig(shared_data=Path(cfg.shared_data), seed=cfg.seed)), indent=1))
    print(f"[2/13] tokenizer -> {zoo / 'tokenizer'}", flush=True)
    shutil.rmtree(corpus / ".tokens", ignore_errors=True)
    train_tokenizer(corpus, zoo / "tokenizer")
    print(f"[3/13] target ({cfg.target_minutes:.0f} min)", flush=True)
    train_lm(TrainConfig(corpus_dir=str(corpus), tokenizer_dir=str(zoo / "tokenizer"), out_dir=str(work / "target"),
                         shape=TARGET_SHAPE, lr=1.5e-3, max_minutes=cfg.target_minutes, seed=cfg.seed))
    _install(work / "target", zoo / "target")
    print(f"[4/13] draft pre-trained on the corpus ({cfg.draft_pretrain_minutes:.0f} min)", flush=True)
    train_lm(TrainConfig(corpus_dir=str(corpus), tokenizer_dir=str(zoo / "tokenizer"), out_dir=str(work / "draft_ce"),
                         shape=DRAFT_SHAPE, lr=3e-3, seq_len=256, batch_size=16,
                         max_minutes=cfg.draft_pretrain_minutes, seed=cfg.seed + 2))
    print(f"[5/13] draft distilled from the target's distributions ({cfg.draft_minutes:.0f} min)", flush=True)
    train_lm(TrainConfig(corpus_dir=str(corpus), tokenizer_dir=str(zoo / "tokenizer"), out_dir=str(work / "draft_kl"),
                         shape=DRAFT_SHAPE, teacher=str(zoo / "target"), init_from=str(work / "draft_ce" / "model"),
                         lr=2e-3, warmup_steps=20, seq_len=256, batch_size=16, max_minutes=cfg.draft_minutes,
                         seed=cfg.seed + 3))
    print(f"[6/13] more distillation at a lower LR ({cfg.draft_more_minutes:.0f} min)", flush=True)
    train_lm(TrainConfig(corpus_dir=str(corpus), tokenizer_dir=str(zoo / "tokenizer"), out_dir=str(work / "draft_kl2"),
                         shape=DRAFT_SHAPE, teacher=str(zoo / "target"), init_from=str(work / "draft_kl" / "model"),
                         lr=1e-3, seq_len=256, batch_size=16, max_minutes=cfg.draft_more_minutes, seed=cfg.seed + 3))
    _install(work / "draft_kl2", zoo / "draft",
             earlier_logs=(work / "draft_ce" / "train_log.jsonl", work / "draft_kl" / "train_log.jsonl"))
    print(f"[7/13] EAGLE-3 drafter, online from the frozen target on the corpus ({cfg.eagle3_minutes:.0f} min)",
          flush=True)
    from speclab.train.eagle3 import Eagle3TrainConfig, train_eagle3
    train_eagle3(Eagle3TrainConfig(target_dir=str(zoo / "target"), corpus_dir=str(corpus), out_dir=str(work / "eagle3"),
                                   max_minutes=cfg.eagle3_minutes, seed=cfg.seed, precision="fp32", loss_topk=0))
    print(f"[8/13] DFlash drafter with DSpark's Markov head, online from the frozen target on the corpus "
          f"({cfg.dflash_minutes:.0f} min)", flush=True)
    from speclab.train.dflash import DFlashTrainConfig, train_dflash
    train_dflash(DFlashTrainConfig(target_dir=str(zoo / "target"), corpus_dir=str(corpus), out_dir=str(work / "dflash"),
                                   max_minutes=cfg.dflash_minutes, seed=cfg.seed, precision="fp32"))
    regen = [REPO_ROOT / "data" / "regen" / mode for mode in cfg.regen_modes]
    print(f"[9/13] the target's own continuations ({', '.join(cfg.regen_modes)}) -> data/regen", flush=True)
    from speclab.train.regenerate import RegenConfig, regenerate
    for mode, folder in zip(cfg.regen_modes, regen):
        regenerate(RegenConfig(target_dir=str(zoo / "target"), corpus_dir=str(corpus), out_dir=str(folder),
                               mode=mode, seed=cfg.seed))
    data = ",".join(str(f) for f in regen)
    print(f"[10/13] both drafters go on training on it, side by side on one thread each ({cfg.v2_minutes:.0f} min)",
          flush=True)
    import threading
    runs = [threading.Thread(target=train_eagle3, args=(Eagle3TrainConfig(
                target_dir=str(zoo / "target"), corpus_dir=data, out_dir=str(work / "eagle3_v2"),
                init_from=str(work / "eagle3" / "model"), max_minutes=cfg.v2_minutes, seed=cfg.seed + 2,
                lr=cfg.v2_lr, threads=1, precision="bf16", loss_topk=32, draft_vocab_size=cfg.v2_eagle3_vocab),)),
            threading.Thread(target=train_dflash, args=(DFlashTrainConfig(
                target_dir=str(zoo / "target"), corpus_dir=data, out_dir=str(work / "dflash_v2"),
                init_from=str(work / "dflash" / "model"), max_minutes=cfg.v2_minutes, seed=cfg.seed + 2,
                lr=cfg.v2_lr, threads=1, precision="bf16"),))]
    for r in runs:
        r.start()
    for r in runs:
        r.join()
    print(f"[11/13] EAGLE-3 trained for sampling: full-distribution loss ({cfg.v3_minutes[0]:.0f} min), then with the "
          f"acceptance term ({cfg.v3_minutes[1]:.0f} min)", flush=True)
    start = work / "eagle3_v2"
    for i, (name, tv) in enumerate((("eagle3_v3_kl", 0.0), ("eagle3_v3_tv", cfg.v3_loss_tv))):
        train_eagle3(Eagle3TrainConfig(target_dir=str(zoo / "target"), corpus_dir=data, out_dir=str(work / name),
                                       init_from=str(start / "model"), max_minutes=cfg.v3_minutes[i],
                                       seed=cfg.seed + 3 + i, lr=cfg.v3_lr[i], threads=2, precision="bf16",
                                       loss_topk=0, loss_tv=tv))
        start = work / name  # installed after step 13, which goes on from it
    print(f"[12/13] DFlash trained for sampling: full distribution and acceptance term ({cfg.dflash_v3_minutes:.0f} "
          f"min), then DSpark's confidence head ({cfg.dspark_minutes:.0f} min)", flush=True)
    train_dflash(DFlashTrainConfig(target_dir=str(zoo / "target"), corpus_dir=data, out_dir=str(work / "dflash_v3"),
                                   init_from=str(work / "dflash_v2" / "model"), max_minutes=cfg.dflash_v3_minutes,
                                   seed=cfg.seed + 6, lr=cfg.dflash_v3_lr, threads=2, precision="bf16", loss_topk=0,
                                   loss_tv=1.0))
    from speclab.train.dspark import DSparkTrainConfig, train_dspark
    train_dspark(DSparkTrainConfig(target_dir=str(zoo / "target"), corpus_dir=data, out_dir=str(work / "dspark"),
                                   init_from=str(work / "dflash_v3" / "model"), max_minutes=cfg.dspark_minutes,
                                   seed=cfg.seed, threads=2, precision="bf16", label="greedy"))
    _install(work / "dflash_v3", zoo / "dflash", every=25,
             earlier_logs=tuple(work / n / "train_log.jsonl" for n in ("dflash", "dflash_v2")))
    head = work / "dspark" / "model"  # the same drafter with its head and the head's scaling in config.json
    for name in ("model.safetensors", "config.json"):
        shutil.copy(head / name, zoo / "dflash" / name)
    shutil.copy(head / "train_config.json", zoo / "dflash" / "dspark_train_config.json")
    print(f"[13/13] EAGLE-3 v4: a third folder of continuations (mix, seed {cfg.v4_regen_seed}), then "
          f"{cfg.v4_minutes:.0f} min more on all three", flush=True)
    mix = REPO_ROOT / "data" / "regen" / "mix1"
    regenerate(RegenConfig(target_dir=str(zoo / "target"), corpus_dir=str(corpus), out_dir=str(mix), mode="mix",
                           seed=cfg.v4_regen_seed))
    train_eagle3(Eagle3TrainConfig(target_dir=str(zoo / "target"), corpus_dir=f"{data},{mix}",
                                   out_dir=str(work / "eagle3_v4"), init_from=str(start / "model"),
                                   max_minutes=cfg.v4_minutes, seed=cfg.seed + 5, lr=cfg.v4_lr, threads=2,
                                   precision="bf16", loss_topk=0, loss_tv=cfg.v3_loss_tv))
    _install(work / "eagle3_v4", zoo / "eagle3", every=25,
             earlier_logs=tuple(work / n / "train_log.jsonl" for n in ("eagle3", "eagle3_v2", "eagle3_v3_kl",
                                                                       "eagle3_v3_tv")))
    print(evaluate_zoo())


def _install(run_dir: Path, dest: Path, earlier_logs: tuple[Path, ...] = (), every: int = 100) -> None:
    """Copy the final checkpoint into the zoo with a thinned training log (earlier logs of a resumed run first);
    a model card (README.md) already there is kept."""
    from speclab.train.lm import training_curve

    card = (dest / "README.md").read_text() if (dest / "README.md").exists() else None
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(run_dir / "model", dest)
    recs = training_curve([*earlier_logs, run_dir / "train_log.jsonl"], every=every)
    (dest / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    if card:
        (dest / "README.md").write_text(card)


def evaluate_zoo(eval_tokens: int = 65536) -> str:
    """Markdown table: per-domain validation loss (nats/token) and bits per byte of target and draft."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    zoo = zoo_dir()
    tok = AutoTokenizer.from_pretrained(zoo / "tokenizer")
    corpus = REPO_ROOT / "data" / "corpus"
    data = tokenize_corpus(corpus, tok, corpus / ".tokens")
    res = {}
    for name in ("target", "draft"):
        model = AutoModelForCausalLM.from_pretrained(zoo / name, dtype=torch.float32)
        res[name] = evaluate(model, data, 512, eval_tokens, tok)
        res[name]["params"] = sum(p.numel() for p in model.parameters())
    eval_tokens_note = "16,384 tokens per domain during training"
    lines = ["| domain | target loss | draft loss | gap (nats) | target bits/byte | draft bits/byte |",
             "|---|---|---|---|---|---|"]
    for d in res["target"]:
        if d == "params":
            continue
        t, dr = res["target"][d], res["draft"][d]
        lines.append(f"| {d} | {t['loss']:.3f} | {dr['loss']:.3f} | {dr['loss'] - t['loss']:.3f} | "
                     f"{t['bits_per_byte']:.3f} | {dr['bits_per_byte']:.3f} |")
    from speclab.train.lm import curve_table, training_curve
    for name in ("target", "draft"):
        log = zoo / name / "train_log.jsonl"
        if log.exists():
            lines.append(f"\n{name} training curve (validation on {eval_tokens_note}):\n")
            lines.append(curve_table(training_curve([log], every=10**9)))
    log = zoo / "eagle3" / "train_log.jsonl"
    if log.exists():
        from speclab.train.eagle3 import curve_table as eagle3_curve
        lines.append("\neagle3 training curve (validation accuracy = draft argmax equals the target's, at TTT steps "
                     "0 and last):\n")
        lines.append(eagle3_curve(training_curve([log], every=10**9)))
    log = zoo / "dflash" / "train_log.jsonl"
    if log.exists():
        from speclab.train.dflash import curve_table as dflash_curve
        lines.append("\ndflash training curve (validation: greedy acceptance length a full block implies, plain "
                     "readout / with the Markov head):\n")
        lines.append(dflash_curve(training_curve([log], every=10**9)))
    lines.append(f"\nparams: target {res['target']['params'] / 1e6:.2f} M, draft {res['draft']['params'] / 1e6:.2f} M; "
                 f"{eval_tokens} validation tokens per domain (or all there are)")
    return "\n".join(lines)
