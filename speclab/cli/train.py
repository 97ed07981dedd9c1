"""Training commands: `speclab train target | draft | eagle3 | dflash | router`, `speclab data regenerate` and
`speclab zoo build | eval`."""
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
        from speclab import zoo
        for path, option, what in ((a.work_dir, "--work-dir", "the zoo's training runs"),
                                   (zoo.zoo_dir(), "the zoo folder", "the zoo's models"),
                                   (zoo.REPO_ROOT / "data" / "corpus", "the corpus folder", "the corpus"),
                                   (zoo.REPO_ROOT / "data" / "regen", "the regenerated data folder",
                                    "the regenerated data")):
            check_out(path, what, option=option)
        build_zoo(ZooBuildConfig(work_dir=a.work_dir, shared_data=a.shared_data, target_minutes=a.target_minutes,
                                 draft_pretrain_minutes=a.draft_pretrain_minutes, draft_minutes=a.draft_minutes,
                                 draft_more_minutes=a.draft_more_minutes, eagle3_minutes=a.eagle3_minutes,
                                 dflash_minutes=a.dflash_minutes, regen_modes=tuple(a.regen_modes.split(",")),
                                 v2_minutes=a.v2_minutes,
                                 seed=a.seed))
    elif a.zoo_cmd == "eval":
        print(evaluate_zoo(eval_tokens=a.eval_tokens))
    return 0


def check_out(path: str | Path, what: str, file: str | None = None, option: str = "--out") -> None:
    """An output folder (a training run, regenerated data, the zoo's) that can be made and written, and its `file`
    if it is there, tried now, before any model or data is loaded (`speclab.files.check_writable`: the folder and a
    file in it made, then removed, so nothing is left behind and a refused command makes no folder); else one line
    naming the option."""
    from speclab.files import check_writable
    try:
        if Path(path).exists() and not Path(path).is_dir():
            raise ValueError("it is a file, not a folder")
        check_writable(Path(path) / (file or ".speclab-probe"), what)
    except ValueError as e:
        raise SpeclabError(f"{option} {path}: {e}") from e


def check_data(folders: str, regenerated_ok: bool = True) -> None:
    """--corpus: one or more folders (comma-separated), each a text corpus (<domain>.train.txt / .val.txt) or, for
    the drafter trainings, a regenerated one (`speclab data regenerate`); else one line saying what is missing."""
    from speclab.train.corpus import DOMAINS
    from speclab.train.regenerate import is_regenerated

    names = [f for f in str(folders).split(",") if f.strip()]
    if not names:
        raise SpeclabError(f"--corpus {folders!r} names no folder")
    for f in names:
        regen = is_regenerated(f)
        if regen and not regenerated_ok:
            raise SpeclabError(f"--corpus {f} is regenerated data: this training reads a text corpus")
        ext = "npz" if regen else "txt"
        missing = [f"{d}.{s}.{ext}" for d in DOMAINS for s in ("train", "val")
                   if not (Path(f) / f"{d}.{s}.{ext}").is_file()]
        if missing:
            raise SpeclabError(f"--corpus {f} lacks {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} (a "
                               f"corpus is a folder of <domain>.train.txt / <domain>.val.txt for {', '.join(DOMAINS)}"
                               + (", or of the .npz files of `speclab data regenerate`)" if regenerated_ok else ")"))


def _modes(text: str) -> str:
    """--regen-modes: greedy, sample or mix, comma-separated (argparse's one-line error otherwise)."""
    modes = [m for m in text.split(",") if m]
    bad = [m for m in modes if m not in ("greedy", "sample", "mix")]
    if not modes or bad or len(set(modes)) < len(modes):
        raise argparse.ArgumentTypeError(f"{text!r}: give distinct modes among greedy, sample, mix, comma-separated")
    return ",".join(modes)


def _precision(name: str) -> str:
    """--precision auto: bf16 autocast where the zoo's speculative decodes run in bf16 (this machine's --dtype auto
    decision, `speclab.models.resolve_dtype`: cached, measured once)."""
    if name != "auto":
        return name
    from speclab.models import ModelPaths, resolve_dtype
    dtype, d = resolve_dtype(ModelPaths())
    print(f"--precision auto: {'bf16 autocast' if dtype == 'bf16' else 'fp32'} ({d.line('speculative')})",
          file=sys.stderr, flush=True)
    return dtype


def _regen_dtype(name: str, target) -> str:
    """--dtype auto of `data regenerate`: the target's speculative decodes' dtype on this machine (resolved here, so
    the regeneration's settings name the dtype it really ran in)."""
    if name != "auto":
        return name
    from speclab.models import ModelPaths, resolve_dtype
    dtype, d = resolve_dtype(ModelPaths(target=str(target)))
    print(f"data regenerate: {d.line('speculative')}", file=sys.stderr, flush=True)
    return dtype


def _curve(a: argparse.Namespace) -> int:
    """`speclab train curve --out RUN --drafter ROLE`: every kept checkpoint of a drafter training decoded on the
    zoo prompts (speclab.train.curve)."""
    from speclab.bench.suites import load_suite
    from speclab.models import ModelPaths, load_models
    from speclab.train.curve import checkpoints, curve_markdown, measure_curve

    if not a.drafter:
        raise SpeclabError("train curve needs --drafter (eagle3 or dflash: the kind of drafter the run trained)")
    if not checkpoints(a.out):
        raise SpeclabError(f"--out {a.out} holds no checkpoint (OUT/model or OUT/checkpoints/<tokens>)")
    target, _ = load_models(ModelPaths(dtype=None if a.precision == "auto" else a.precision), roles=())
    from speclab.methods import ROLES
    role = ROLES[a.drafter]
    records = measure_curve(a.out, a.drafter, target, lambda path, t: role.load(path, t, None),
                            load_suite("zoo", a.limit), new_tokens=a.new_tokens,
                            log=lambda s: print(s, file=sys.stderr, flush=True))
    print(curve_markdown(records))
    return 0


def cmd_data(a: argparse.Namespace) -> int:
    """`speclab data regenerate`: the target's own continuations (speclab.train.regenerate)."""
    from speclab import zoo
    from speclab.core.target import check_model_dir, quiet_loads
    from speclab.train.regenerate import RegenConfig, regenerate
    quiet_loads()
    target = str(check_model_dir(a.target or zoo.default_target()))
    corpus = a.corpus or str(zoo.REPO_ROOT / "data" / "corpus")
    check_data(corpus, regenerated_ok=False)
    if "," in corpus:
        raise SpeclabError(f"--corpus {corpus}: regenerate reads one corpus folder")
    ctx = json.loads((Path(target) / "config.json").read_text()).get("max_position_embeddings")
    if ctx and a.prompt_len + a.new_tokens > ctx:
        raise SpeclabError(f"--prompt-len {a.prompt_len} + --new-tokens {a.new_tokens} exceed the target's context "
                           f"of {ctx} positions")
    check_out(a.out, "the regenerated data", "provenance.json")
    cfg = RegenConfig(target_dir=target, corpus_dir=corpus, out_dir=a.out, mode=a.mode,
                      train_sequences=a.train_sequences, val_sequences=a.val_sequences, prompt_len=a.prompt_len,
                      new_tokens=a.new_tokens, batch=a.batch, dtype=_regen_dtype(a.dtype, target), seed=a.seed)
    try:
        prov = regenerate(cfg, log=lambda s: print(s, file=sys.stderr, flush=True))
    except ValueError as e:
        raise SpeclabError(str(e)) from e
    print(json.dumps({k: prov[k] for k in ("sampling", "new_tokens", "seconds_this_run", "dtype")}, indent=1))
    return 0


def cmd_train(a: argparse.Namespace) -> int:
    from speclab import zoo
    from speclab.core.target import check_model_dir, quiet_loads
    from speclab.train.lm import TrainConfig, train_lm
    from speclab.train.zoo_build import DRAFT_SHAPE, TARGET_SHAPE
    quiet_loads()
    corpus = a.corpus or str(zoo.REPO_ROOT / "data" / "corpus")
    if a.what != "router" or a.corpus:
        check_data(corpus, regenerated_ok=a.what in DRAFTERS)
    check_out(a.out, "the run", "curve.json" if a.what == "curve" else "train_log.jsonl")
    if a.teacher:
        check_model_dir(a.teacher)
    if a.init_from:
        if a.what in DRAFTERS:
            from speclab.drafters.checkpoint import check_dir
            check_dir(a.init_from, {"eagle3": "EAGLE-3 drafter", "dflash": "DFlash drafter",
                                    "specblock": "SpecBlock drafter",
                                    "confu": "EAGLE-3 or ConFu drafter"}[a.what])
        else:
            check_model_dir(a.init_from)
        if a.what == "confu":
            _check_confu_resume(a)
    elif a.what == "confu":
        raise SpeclabError("train confu starts from a trained EAGLE-3 drafter (the paper's start): give --init-from "
                           "(e.g. data/zoo/eagle3), or a ConFu run's OUT/model to resume")
    if a.what == "curve":
        return _curve(a)
    if a.what in DRAFTERS:
        return _train_drafter(a, corpus)
    if a.what == "router":
        from speclab.core.target import Target
        from speclab.drafters.dflash import load_dflash
        from speclab.drafters.eagle3 import load_eagle3
        from speclab.train.router import RouterTrainConfig, curve_table, train_router
        cfg = RouterTrainConfig(corpus_dir=corpus, out_dir=a.out, sequences=a.sequences, seed=a.seed,
                                lr=a.lr or 1e-3, new_tokens=a.new_tokens, cost_prompts=a.cost_prompts,
                                epochs=a.epochs)
        target = Target.load(a.teacher or zoo.default_target(), device="cpu",
                             dtype=None if a.precision == "auto" else a.precision)
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


# the options that fix a ConFu run's shape (None when not given: ConFuTrainConfig's default)
CONFU_SHAPE = {"soft_prompts": "--soft-prompts", "experts": "--experts", "expert_topk": "--expert-topk"}


def _check_confu_resume(a: argparse.Namespace) -> None:
    """A ConFu run resumed with --init-from keeps its own shape (s, experts, top-k): an option that asks for
    another is refused rather than ignored."""
    raw = json.loads((Path(a.init_from) / "config.json").read_text())
    for key, flag in CONFU_SHAPE.items():
        asked, has = getattr(a, key), raw.get("confu", {}).get(key)
        if has is not None and asked is not None and asked != has:
            raise SpeclabError(f"{flag} {asked}: the ConFu run at {a.init_from} has {has} (a resumed run keeps its "
                               f"shape; leave {flag} out)")


def _train_drafter(a: argparse.Namespace, corpus: str) -> int:
    """`speclab train eagle3 | dflash | specblock`: the run's settings every drafter training shares, its own,
    the training, then its validation table."""
    from speclab import zoo
    run = dict(target_dir=a.teacher or str(zoo.default_target()), corpus_dir=corpus, out_dir=a.out,
               max_minutes=a.minutes, seed=a.seed, init_from=a.init_from, precision=_precision(a.precision),
               threads=a.threads, domain_weights=_domain_weights(a.without), max_tokens=a.max_tokens)
    if a.what == "eagle3":
        from speclab.train import eagle3 as t
        cfg = t.Eagle3TrainConfig(**run, lr=a.lr or 2e-3, ttt_steps=a.ttt_steps, loss_topk=a.loss_topk,
                                  draft_vocab_size=a.draft_vocab)
        train = t.train_eagle3
    elif a.what == "dflash":
        from speclab.train import dflash as t
        cfg = t.DFlashTrainConfig(**run, lr=a.lr or 1.5e-3, block_size=a.block_size or 16,
                                  markov_rank=a.markov_rank, num_layers=a.layers)
        train = t.train_dflash
    elif a.what == "confu":
        from speclab.train import confu as t
        cfg = t.ConFuTrainConfig(**run, lr=a.lr or 1e-3, ttt_steps=a.ttt_steps, loss_topk=a.loss_topk or 32,
                                 **{k: getattr(a, k) for k in CONFU_SHAPE if getattr(a, k) is not None},
                                 replicate=a.replicate, anchors=a.anchors)
        train = t.train_confu
    else:
        from speclab.train import specblock as t
        cfg = t.SpecBlockTrainConfig(**run, lr=a.lr or 1e-3, block_size=a.block_size or 4, hidden_layers=a.layers,
                                     layer_shift=not a.no_shift, valid_prefix=not a.no_valid_prefix,
                                     rank_warmup=a.rank_warmup, loss_topk=a.loss_topk or 32)
        train = t.train_specblock
    summary = train(cfg, log=lambda s: print(s, file=sys.stderr, flush=True))
    print(json.dumps({k: summary[k] for k in ("params", "steps", "tokens", "minutes")}, indent=1))
    print(t.val_table(summary["val"]))
    return 0


DRAFTERS = ("eagle3", "dflash", "specblock", "confu")  # the online drafter trainings


def _domain_weights(without: str | None) -> dict:
    """The training mix, without one domain when asked."""
    from speclab.train.lm import DOMAIN_WEIGHTS
    return {d: w for d, w in DOMAIN_WEIGHTS.items() if d != without}


def add_parsers(sub) -> None:
    """`train` and `zoo`."""
    from speclab.train.corpus import DOMAINS
    t = sub.add_parser("train", help="train the zoo target, distil the zoo draft, train an EAGLE-3 or DFlash "
                       "drafter online from the frozen target, or WhiFlash's neural router from profiles (long)")
    t.add_argument("what", choices=["target", "draft", *DRAFTERS, "router", "curve"],
                   help="curve: decode the zoo prompts with every checkpoint a drafter training (--out) kept")
    t.add_argument("--drafter", choices=["eagle3", "dflash"], help="curve: the kind of drafter --out trained")
    t.add_argument("--limit", type=_positive_int, default=2, help="curve: zoo prompts per category")
    t.add_argument("--out", required=True, help="run directory (checkpoints in OUT/model, log in OUT/train_log.jsonl)")
    t.add_argument("--minutes", type=_num(float, 0.01),
                   help="wall-clock budget; the LR schedule follows it (not for router)")
    t.add_argument("--sequences", type=_positive_int, default=240, help="router: corpus prompts profiled (their "
                   "greedy continuations give the (h_t, Delta AL) pairs; a fifth held out)")
    t.add_argument("--new-tokens", type=_positive_int, default=96, help="router, curve: tokens generated per prompt")
    t.add_argument("--epochs", type=_positive_int, default=12, help="router: passes over the pairs (the profiles "
                   "are collected once and reused from OUT/pairs.pt when the run is repeated)")
    t.add_argument("--cost-prompts", type=_positive_int, default=6, help="router: prompts decoded live to fit the "
                   "cost model of the hardware-aware threshold")
    t.add_argument("--eagle", help="router: the EAGLE-3 drafter (default: the zoo's)")
    t.add_argument("--dflash", help="router: the DFlash drafter (default: the zoo's)")
    t.add_argument("--corpus", help="folder of <domain>.train.txt / .val.txt (default: data/corpus); eagle3 and "
                   "dflash also read folders of `speclab data regenerate`, several joined by commas")
    t.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                   help="eagle3, dflash: the drafter in fp32 or in bf16 autocast (the target then in bf16); auto: "
                   "bf16 where the CPU computes it natively (README \"Training the drafters\"); curve, router: the "
                   "decodes' dtype (the router's profiles and round timings)")
    t.add_argument("--loss-topk", type=_num(int, 0), default=32, help="eagle3: the loss against the target's k most "
                   "likely tokens, renormalised (0: its full distribution)")
    t.add_argument("--draft-vocab", type=_num(int, 2), default=None, help="eagle3: the draft head's vocabulary, the "
                   "training data's most frequent tokens (default: the target's whole vocabulary, or --init-from's)")
    t.add_argument("--teacher", help="draft, eagle3, dflash: the target to learn from (default: the zoo target)")
    t.add_argument("--ttt-steps", type=_positive_int, default=3,
                   help="eagle3: training-time-test steps (unrolled on its own "
                   "outputs)")
    t.add_argument("--block-size", type=_num(int, 2, 64), default=None,
                   help="dflash: the largest block trained (each step draws its block size from 2..this; default 16); "
                   "specblock: K, the positions of one block (default 4, fixed for the drafter's life)")
    t.add_argument("--no-shift", action="store_true", help="specblock: no layer-wise shift (the ablation)")
    t.add_argument("--no-valid-prefix", action="store_true",
                   help="specblock: supervise every row, not only those after a right prefix (the ablation)")
    t.add_argument("--rank-warmup", type=_num(int, 0), default=300,
                   help="specblock: steps before the rank head's loss is switched on")
    t.add_argument("--without", choices=list(DOMAINS), default=None,
                   help="eagle3, dflash, specblock: leave one domain out of the training mix (a domain shift to "
                   "adapt to)")
    t.add_argument("--markov-rank", type=_num(int, 0), default=64,
                   help="dflash: rank of DSpark's Markov head (0: none)")
    t.add_argument("--layers", type=_positive_int, default=2, help="dflash, specblock: drafter depth (decoder layers)")
    t.add_argument("--init-from", help="resume from this model directory (HF; the drafter's own for a drafter; "
                   "confu: a trained EAGLE-3 to start from, or a ConFu run to resume)")
    t.add_argument("--max-tokens", type=_num(int, 0), default=0, help="eagle3, dflash, specblock, confu: stop after "
                   "this many training tokens (or --minutes, whichever comes first; 0: minutes only): two runs on "
                   "the same token budget")
    t.add_argument("--soft-prompts", type=_num(int, 0, 4096), default=None,
                   help="confu: s, soft-prompt key/value entries per target layer (default 16; 0: none)")
    t.add_argument("--experts", type=_num(int, 1, 4096), default=None,
                   help="confu: experts of each MoE (default 8; 1: a static embedding, the paper's ablation without "
                   "MoE)")
    t.add_argument("--expert-topk", type=_num(int, 1, 4096), default=None,
                   help="confu: experts mixed per row (default 2)")
    t.add_argument("--replicate", type=_num(int, 0, 4096), default=3,
                   help="confu: l, rows after an anchor that reuse its future vector (0: none, the ablation)")
    t.add_argument("--anchors", type=_num(int, 0, 1 << 20), default=0, help="confu: K_train anchors per window, "
                   "drawn at random (0: one every l + 1 rows)")
    t.add_argument("--lr", type=_num(float, 1e-8, 1.0), default=None,
                   help="peak learning rate (default: the zoo recipe's)")
    t.add_argument("--seed", type=_num(int, 0, 2**63 - 1), default=0)
    t.add_argument("--threads", type=_num(int, 1, 256), default=2, help="eagle3, dflash: torch threads (two runs side "
                   "by side on a 2-core machine: 1 each)")
    t.set_defaults(fn=cmd_train)

    d = sub.add_parser("data", help="drafter training data: the target's own continuations of corpus prompts")
    ds = d.add_subparsers(dest="data_cmd", required=True)
    dr = ds.add_parser("regenerate", help="continue prompts cut from every domain's corpus splits with the target, "
                       "batched, resumable (README \"Training data\")")
    dr.add_argument("--out", required=True, help="folder for <domain>.<split>.npz and provenance.json; a rerun with "
                    "the same settings resumes")
    dr.add_argument("--mode", choices=["greedy", "sample", "mix"], default="mix",
                    help="greedy continuations, sampled at temperature 1, or every other row sampled")
    dr.add_argument("--train-sequences", type=_positive_int, default=1024, help="per domain")
    dr.add_argument("--val-sequences", type=_positive_int, default=32, help="per domain, from the validation split")
    dr.add_argument("--prompt-len", type=_positive_int, default=64, help="prompt tokens cut from the corpus")
    dr.add_argument("--new-tokens", type=_positive_int, default=192, help="tokens the target writes per prompt")
    dr.add_argument("--batch", type=_num(int, 1, 4096), default=64, help="sequences per forward")
    dr.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto")
    dr.add_argument("--target", help="the target (default: the zoo's)")
    dr.add_argument("--corpus", help="the text corpus the prompts are cut from (default: data/corpus)")
    dr.add_argument("--seed", type=_num(int, 0, 2**31 - 1), default=0)
    d.set_defaults(fn=cmd_data)

    z = sub.add_parser("zoo", help="build or evaluate the zoo models in data/zoo")
    zs = z.add_subparsers(dest="zoo_cmd", required=True)
    zb = zs.add_parser("build", help="re-create corpus, tokenizer, target, draft, the drafters and their regenerated "
                       "training data (long: hours on CPU)")
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
    zb.add_argument("--regen-modes", type=_modes, default="greedy,sample",
                    help="how the target continues the prompts of the drafters' second training, one folder each "
                    "(README \"Training the drafters\")")
    zb.add_argument("--v2-minutes", type=_num(float, 0.01), default=60.0,
                    help="both drafters on the regenerated data, side by side")
    zb.add_argument("--seed", type=_num(int, 0, 2**63 - 1), default=0)
    zb.add_argument("--work-dir", default="build/zoo", help="the run directory of each step, before its model is "
                    "installed in data/zoo")
    ze = zs.add_parser("eval", help="per-domain validation loss and bits per byte of the zoo models")
    ze.add_argument("--eval-tokens", type=_positive_int, default=65536)
    z.set_defaults(fn=cmd_zoo)
