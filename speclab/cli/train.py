"""Training commands: `speclab train target | draft | eagle3 | dflash | router` and `speclab zoo build | eval`."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from speclab.cli.common import _num, _positive_int
from speclab.errors import SpeclabError


def cmd_zoo(a: argparse.Namespace) -> int:
    from speclab.train.zoo_build import ZooBuildConfig, build_zoo, evaluate_zoo

    if a.zoo_cmd == "build":
        build_zoo(ZooBuildConfig(shared_data=a.shared_data, target_minutes=a.target_minutes,
                                 draft_pretrain_minutes=a.draft_pretrain_minutes, draft_minutes=a.draft_minutes,
                                 draft_more_minutes=a.draft_more_minutes, eagle3_minutes=a.eagle3_minutes,
                                 dflash_minutes=a.dflash_minutes,
                                 seed=a.seed))
    elif a.zoo_cmd == "eval":
        print(evaluate_zoo(eval_tokens=a.eval_tokens))
    return 0


def cmd_train(a: argparse.Namespace) -> int:
    from speclab import zoo
    from speclab.core.target import check_model_dir, quiet_loads
    from speclab.train.lm import TrainConfig, train_lm
    from speclab.train.zoo_build import DRAFT_SHAPE, TARGET_SHAPE
    quiet_loads()
    corpus = a.corpus or str(zoo.REPO_ROOT / "data" / "corpus")
    from speclab.train.corpus import DOMAINS
    missing = [f"{d}.{s}.txt" for d in DOMAINS for s in ("train", "val")
               if not (Path(corpus) / f"{d}.{s}.txt").is_file()]
    if a.what != "router" and missing:
        raise SpeclabError(f"--corpus {corpus} lacks {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} "
                           "(a corpus is a folder of <domain>.train.txt / <domain>.val.txt for "
                           f"{', '.join(DOMAINS)})")
    from speclab.files import check_writable
    try:  # the run directory can be made and written, before any model or data is loaded
        if Path(a.out).exists() and not Path(a.out).is_dir():
            raise ValueError("it is a file, not a folder")
        check_writable(Path(a.out) / "model", "the run")
    except ValueError as e:
        raise SpeclabError(f"--out {a.out}: {e}") from e
    if a.teacher:
        check_model_dir(a.teacher)
    if a.init_from:
        if a.what in ("eagle3", "dflash"):
            from speclab.drafters.checkpoint import check_dir
            check_dir(a.init_from, {"eagle3": "EAGLE-3 drafter", "dflash": "DFlash drafter"}[a.what])
        else:
            check_model_dir(a.init_from)
    if a.what == "eagle3":
        from speclab.train.eagle3 import Eagle3TrainConfig, train_eagle3, val_table
        cfg = Eagle3TrainConfig(target_dir=a.teacher or str(zoo.default_target()), corpus_dir=corpus, out_dir=a.out,
                                max_minutes=a.minutes, seed=a.seed, init_from=a.init_from, lr=a.lr or 2e-3,
                                ttt_steps=a.ttt_steps)
        summary = train_eagle3(cfg, log=lambda s: print(s, file=sys.stderr, flush=True))
        print(json.dumps({k: summary[k] for k in ("params", "steps", "tokens", "minutes")}, indent=1))
        print(val_table(summary["val"]))
        return 0
    if a.what == "dflash":
        from speclab.train.dflash import DFlashTrainConfig, train_dflash, val_table
        cfg = DFlashTrainConfig(target_dir=a.teacher or str(zoo.default_target()), corpus_dir=corpus, out_dir=a.out,
                                max_minutes=a.minutes, seed=a.seed, init_from=a.init_from, lr=a.lr or 1.5e-3,
                                block_size=a.block_size, markov_rank=a.markov_rank, num_layers=a.layers)
        summary = train_dflash(cfg, log=lambda s: print(s, file=sys.stderr, flush=True))
        print(json.dumps({k: summary[k] for k in ("params", "steps", "tokens", "minutes")}, indent=1))
        print(val_table(summary["val"]))
        return 0
    if a.what == "router":
        from speclab.core.target import Target
        from speclab.drafters.dflash import load_dflash
        from speclab.drafters.eagle3 import load_eagle3
        from speclab.train.router import RouterTrainConfig, curve_table, train_router
        cfg = RouterTrainConfig(corpus_dir=corpus, out_dir=a.out, sequences=a.sequences, seed=a.seed,
                                lr=a.lr or 1e-3, new_tokens=a.new_tokens, cost_prompts=a.cost_prompts,
                                epochs=a.epochs)
        target = Target.load(a.teacher or zoo.default_target(), device="cpu", dtype="fp32")
        models = {"eagle3": load_eagle3(a.eagle or zoo.default_eagle3(), target),
                  "dflash": load_dflash(a.dflash or zoo.default_dflash(), target)}
        summary = train_router(cfg, target, models, log=lambda s: print(s, file=sys.stderr, flush=True))
        print(json.dumps({k: summary[k] for k in ("collect_minutes", "heldout", "al_profiled")}, indent=1))
        print(f"hardware-aware threshold: {summary['hardware_threshold']['threshold']:.3f} "
              f"({json.dumps(summary['hardware_threshold'])})")
        print(curve_table(summary["curve"]))
        return 0
    if a.minutes is None:
        raise SpeclabError(f"train {a.what} needs --minutes (its wall-clock budget)")
    if a.what == "target":
        cfg = TrainConfig(corpus_dir=corpus, tokenizer_dir=str(zoo.tokenizer_dir()), out_dir=a.out, shape=TARGET_SHAPE,
                          lr=a.lr or 1.5e-3, max_minutes=a.minutes, seed=a.seed, init_from=a.init_from)
    else:
        cfg = TrainConfig(corpus_dir=corpus, tokenizer_dir=str(zoo.tokenizer_dir()), out_dir=a.out, shape=DRAFT_SHAPE,
                          teacher=a.teacher or str(zoo.default_target()), lr=a.lr or 3e-3, seq_len=256, batch_size=16,
                          max_minutes=a.minutes, seed=a.seed, init_from=a.init_from)
    summary = train_lm(cfg)
    print(json.dumps({k: summary[k] for k in ("params", "steps", "tokens", "minutes", "val")}, indent=1))
    return 0


def add_parsers(sub) -> None:
    """`train` and `zoo`."""
    t = sub.add_parser("train", help="train the zoo target, distil the zoo draft, train an EAGLE-3 or DFlash "
                       "drafter online from the frozen target, or WhiFlash's neural router from profiles (long)")
    t.add_argument("what", choices=["target", "draft", "eagle3", "dflash", "router"])
    t.add_argument("--out", required=True, help="run directory (checkpoints in OUT/model, log in OUT/train_log.jsonl)")
    t.add_argument("--minutes", type=_num(float, 0.01),
                   help="wall-clock budget; the LR schedule follows it (not for router)")
    t.add_argument("--sequences", type=_positive_int, default=240, help="router: corpus prompts profiled (their "
                   "greedy continuations give the (h_t, Delta AL) pairs; a fifth held out)")
    t.add_argument("--new-tokens", type=_positive_int, default=96, help="router: tokens generated per prompt")
    t.add_argument("--epochs", type=_positive_int, default=12, help="router: passes over the pairs (the profiles "
                   "are collected once and reused from OUT/pairs.pt when the run is repeated)")
    t.add_argument("--cost-prompts", type=_positive_int, default=6, help="router: prompts decoded live to fit the "
                   "cost model of the hardware-aware threshold")
    t.add_argument("--eagle", help="router: the EAGLE-3 drafter (default: the zoo's)")
    t.add_argument("--dflash", help="router: the DFlash drafter (default: the zoo's)")
    t.add_argument("--corpus", help="folder of <domain>.train.txt / .val.txt (default: data/corpus)")
    t.add_argument("--teacher", help="draft, eagle3, dflash: the target to learn from (default: the zoo target)")
    t.add_argument("--ttt-steps", type=_positive_int, default=3,
                   help="eagle3: training-time-test steps (unrolled on its own "
                   "outputs)")
    t.add_argument("--block-size", type=_num(int, 2), default=16,
                   help="dflash: the largest block trained (each step draws "
                   "its block size from 2..this)")
    t.add_argument("--markov-rank", type=_num(int, 0), default=64,
                   help="dflash: rank of DSpark's Markov head (0: none)")
    t.add_argument("--layers", type=_positive_int, default=2, help="dflash: drafter depth")
    t.add_argument("--init-from", help="resume from this model directory (HF; EAGLE-3 or DFlash for those)")
    t.add_argument("--lr", type=_num(float, 1e-8, 1.0), default=None,
                   help="peak learning rate (default: the zoo recipe's)")
    t.add_argument("--seed", type=_num(int, 0, 2**63 - 1), default=0)
    t.set_defaults(fn=cmd_train)

    z = sub.add_parser("zoo", help="build or evaluate the zoo models in data/zoo")
    zs = z.add_subparsers(dest="zoo_cmd", required=True)
    zb = zs.add_parser("build", help="re-create corpus, tokenizer, target and draft (long: hours on CPU)")
    zb.add_argument("--shared-data", default="../shared/data")
    zb.add_argument("--target-minutes", type=_num(float, 0.01), default=100.0)
    zb.add_argument("--draft-pretrain-minutes", type=_num(float, 0.01), default=20.0)
    zb.add_argument("--draft-minutes", type=_num(float, 0.01), default=20.0, help="distillation from the target")
    zb.add_argument("--draft-more-minutes", type=_num(float, 0.01), default=45.0,
                    help="a second distillation pass, LR 1e-3")
    zb.add_argument("--eagle3-minutes", type=_num(float, 0.01), default=87.0,
                    help="EAGLE-3 drafter, online from the target")
    zb.add_argument("--dflash-minutes", type=_num(float, 0.01), default=95.0,
                    help="DFlash drafter (+ Markov head), online from "
                    "the target")
    zb.add_argument("--seed", type=_num(int, 0, 2**63 - 1), default=0)
    ze = zs.add_parser("eval", help="per-domain validation loss and bits per byte of the zoo models")
    ze.add_argument("--eval-tokens", type=_positive_int, default=65536)
    z.set_defaults(fn=cmd_zoo)
