"""Training commands: `speclab train target | draft | eagle3 | dflash | router`, `speclab data regenerate` and
`speclab zoo build | eval`."""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from speclab.cli.common import _num, _positive_int, add_ray_args, cluster_args
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


def router_args(r, roles: tuple[str, ...]) -> None:
    """The options `train router` and `train route` share: the drafter models they profile, the corpus, the target,
    the decodes' dtype, the learning rate and the seed."""
    for role in roles:
        r.add_argument(f"--{'eagle' if role == 'eagle3' else role}", help=f"the {role} model (default: the zoo's)")
    r.add_argument("--corpus", help="folder of <domain>.train.txt / .val.txt (default: data/corpus)")
    r.add_argument("--teacher", help="the target (default: the zoo target)")
    r.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                   help="the decodes' dtype (the router's profiles and round timings)")
    r.add_argument("--lr", type=_num(float, 1e-8, 1.0), default=None, help="peak learning rate (default 1e-3)")
    r.add_argument("--seed", type=_num(int, 0, 2**63 - 1), default=0)
    r.set_defaults(fn=cmd_train)


def _train_route(a: argparse.Namespace, corpus: str) -> int:
    """`speclab train route`: the arms checked against the registry before any model loads, then the models they
    need loaded, the N-arm profiles collected (resumable), each arm's round time measured and the router fitted."""
    from speclab.methods import get_method
    from speclab.models import ModelPaths, load_models
    from speclab.routing.arms import check, parse_arms
    from speclab.train.route import DEFAULT_ARMS, RouteTrainConfig, train_route
    arms = a.arms or DEFAULT_ARMS
    spec = f"route:arms={arms}+router=rule"
    check({"arms": arms, "router": "rule"}, None)  # the arms, checked by name before any model loads
    if len(parse_arms(arms)) < 2:
        raise SpeclabError("train route: give at least two arms to choose between")
    paths = ModelPaths(a.teacher, {"eagle3": a.eagle, "dflash": a.dflash, "draft": a.draft},
                       dtype="auto" if a.precision == "auto" else a.precision)
    target, models = load_models(paths, roles=get_method(spec).needs, fam="speculative")
    cfg = RouteTrainConfig(corpus_dir=corpus, out_dir=a.out, arms=arms, sequences=a.sequences, seed=a.seed,
                           lr=a.lr or 1e-3, new_tokens=a.new_tokens, cost_prompts=a.cost_prompts, epochs=a.epochs,
                           objective=a.objective)
    s = train_route(cfg, target, models, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps({k: s[k] for k in ("collect_minutes", "heldout", "al_profiled", "costs", "machine")}, indent=1))
    return 0


def cmd_train(a: argparse.Namespace) -> int:
    from speclab import zoo
    from speclab.core.target import check_model_dir, quiet_loads
    from speclab.train.lm import TrainConfig, train_lm
    from speclab.train.zoo_build import DRAFT_SHAPE, TARGET_SHAPE
    quiet_loads()
    entry = trainings().get(a.what)  # a drafter's training (its registry entry), or None
    corpus = getattr(a, "corpus", None) or str(zoo.REPO_ROOT / "data" / "corpus")
    if a.what not in ("router", "route", "curve") or getattr(a, "corpus", None):
        check_data(corpus, regenerated_ok=entry is not None)
    check_out(a.out, "the run", "curve.json" if a.what == "curve" else "train_log.jsonl")
    if getattr(a, "teacher", None):
        check_model_dir(a.teacher)
    if getattr(a, "init_from", None):
        if entry is not None:
            from speclab.drafters.checkpoint import check_dir
            check_dir(a.init_from, entry.init_from)
            if entry.check_resume:
                check = getattr(importlib.import_module(entry.module), entry.check_resume)
                try:
                    check(a.init_from, _given(a, entry))
                except ValueError as e:
                    raise SpeclabError(str(e)) from e
        else:
            check_model_dir(a.init_from)
    elif entry is not None and entry.needs_init:
        raise SpeclabError(entry.needs_init)
    if a.what == "curve":
        return _curve(a)
    if entry is not None:
        return _train_drafter(a, entry, corpus)
    if a.what == "router":
        cl = cluster_args(a)  # --ray's address checked before any model loads
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
        log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
        profiles = None
        if cl is not None:  # the pairs on the cluster's workers, each with the models in this target's dtype
            from speclab import cluster
            from speclab.train.router import setup
            _, prompts = setup(cfg, target)
            dirs = [a.teacher or zoo.default_target(), a.eagle or zoo.default_eagle3(),
                    a.dflash or zoo.default_dflash()]
            profiles = cluster.router_profiles(cl, *(str(Path(p).resolve()) for p in dirs), target, prompts,
                                               cfg.new_tokens, log)
        try:
            summary = train_router(cfg, target, models, log=log, profiles=profiles)
        finally:
            if cl is not None:
                cluster.stop(cl)
        print(json.dumps({k: summary[k] for k in ("collect_minutes", "heldout", "al_profiled")}, indent=1))
        print(f"hardware-aware threshold: {summary['hardware_threshold']['threshold']:.3f} "
              f"({json.dumps(summary['hardware_threshold'])})")
        print(curve_table(summary["curve"]))
        return 0
    if a.what == "route":
        return _train_route(a, corpus)
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


def trainings() -> dict:
    """Drafter name -> its training (`registry.TrainEntry`), for every registered drafter that has one, and the
    trainings of its model's parts (`DrafterEntry.trainings`: `dspark`)."""
    from speclab.drafters.registry import drafters
    out = {n: e.train for n, e in drafters().items() if e.train is not None}
    for e in drafters().values():
        out.update(e.trainings)
    return out


def _options(entry) -> list:
    """The options of a drafter's training, generated from its config's fields that `speclab.train.lm.option`
    declares: (field, option, kind, default, help, lo, hi). The default is the config's (shown in --help); the
    parsed value is None when the option is not given, so the config's default applies."""
    import dataclasses
    import typing
    config = entry.load()[0]
    hints = typing.get_type_hints(config)
    out = []
    for f in dataclasses.fields(config):
        if "help" not in f.metadata:
            continue
        kind = next(t for t in (bool, int, float, str) if t is hints[f.name] or t in typing.get_args(hints[f.name]))
        out.append((f.name, f.metadata["flag"] or "--" + f.name.replace("_", "-"), kind, f.default,
                    f.metadata["help"], f.metadata["lo"], f.metadata["hi"]))
    return out


def _given(a: argparse.Namespace, entry) -> dict:
    """The config fields of the training's own options that were given on the command line."""
    return {name: getattr(a, name) for name, *_ in _options(entry) if getattr(a, name) is not None}


def _train_drafter(a: argparse.Namespace, entry, corpus: str) -> int:
    """`speclab train <drafter>`: the run's settings every drafter training shares, its own options (those given;
    the config's defaults otherwise), the training, then its validation table."""
    from speclab import zoo
    config, train, val_table = entry.load()
    if a.minutes is None:
        raise SpeclabError(f"train {a.what} needs --minutes (its wall-clock budget)")
    run = dict(target_dir=a.teacher or str(zoo.default_target()), corpus_dir=corpus, out_dir=a.out,
               max_minutes=a.minutes, seed=a.seed, init_from=a.init_from, precision=_precision(a.precision),
               threads=a.threads, domain_weights=_domain_weights(a.without), max_tokens=a.max_tokens)
    if a.lr is not None:
        run["lr"] = a.lr
    summary = train(config(**run, **_given(a, entry)), log=lambda s: print(s, file=sys.stderr, flush=True))
    print(json.dumps({k: summary[k] for k in ("params", "steps", "tokens", "minutes")}, indent=1))
    print(val_table(summary["val"]))
    return 0


def _domain_weights(without: str | None) -> dict:
    """The training mix, without one domain when asked."""
    from speclab.train.lm import DOMAIN_WEIGHTS
    return {d: w for d, w in DOMAIN_WEIGHTS.items() if d != without}


def add_parsers(sub) -> None:
    """`train` and `zoo`."""
    from speclab.train.corpus import DOMAINS
    t = sub.add_parser("train", help="train the zoo target, distil the zoo draft, train a drafter online from the "
                       "frozen target, or WhiFlash's neural router from profiles (long)")
    ts = t.add_subparsers(dest="what", required=True, metavar="{target,draft,<drafter>,router,route,curve}")

    def run_options(q, *, teacher: str, init_from: str, lr: str = "peak learning rate"):
        q.add_argument("--out", required=True, help="run directory (checkpoints in OUT/model, log in "
                       "OUT/train_log.jsonl)")
        q.add_argument("--minutes", type=_num(float, 0.01), help="wall-clock budget; the LR schedule follows it")
        q.add_argument("--corpus", help="folder of <domain>.train.txt / .val.txt (default: data/corpus)")
        q.add_argument("--teacher", help=teacher)
        q.add_argument("--init-from", help=init_from)
        q.add_argument("--lr", type=_num(float, 1e-8, 1.0), default=None, help=lr)
        q.add_argument("--seed", type=_num(int, 0, 2**63 - 1), default=0)

    for what, shape in (("target", "the zoo target from the corpus"), ("draft", "the zoo draft, distilled from "
                                                                         "the target")):
        q = ts.add_parser(what, help=f"train {shape}")
        run_options(q, teacher="draft: the target to distil from (default: the zoo target)",
                    init_from="resume from this model directory (HF)", lr="peak learning rate (default: the zoo "
                    "recipe's)")
        q.set_defaults(fn=cmd_train)

    for name, entry in trainings().items():  # every registered drafter with a training: options from its config
        q = ts.add_parser(name, help=entry.help)
        config = entry.load()[0]
        run_options(q, teacher="the target to learn from (default: the zoo target)",
                    init_from=f"resume from (or start from) a {entry.init_from} directory",
                    lr=f"peak learning rate (default {config.__dataclass_fields__['lr'].default:g})")
        q.set_defaults(fn=cmd_train)
        q.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                       help="the drafter in fp32 or in bf16 autocast (the target then in bf16); auto: bf16 where this "
                       "machine's speculative decodes run in bf16 (README \"Training the drafters\")")
        q.add_argument("--without", choices=list(DOMAINS), default=None,
                       help="leave one domain out of the training mix (a domain shift to adapt to)")
        q.add_argument("--max-tokens", type=_num(int, 0), default=0, help="stop after this many training tokens "
                       "(or --minutes, whichever comes first; 0: minutes only): two runs on the same token budget")
        q.add_argument("--threads", type=_num(int, 1, 256), default=2,
                       help="torch threads (two runs side by side on a 2-core machine: 1 each)")
        for field, option, kind, default, text, lo, hi in _options(entry):
            if kind is bool:
                q.add_argument(option, dest=field, action="store_const", const=not default, default=None,
                               help=text)
            else:
                q.add_argument(option, dest=field, type=_num(kind, lo, hi) if kind in (int, float) else kind,
                               default=None, help=f"{text} (default {default})")

    r = ts.add_parser("router", help="WhiFlash's neural router from profiles of corpus text")
    r.add_argument("--out", required=True, help="run directory")
    r.add_argument("--sequences", type=_positive_int, default=240, help="corpus prompts profiled (their "
                   "greedy continuations give the (h_t, Delta AL) pairs; a fifth held out)")
    r.add_argument("--new-tokens", type=_positive_int, default=96, help="tokens generated per prompt")
    r.add_argument("--epochs", type=_positive_int, default=12, help="passes over the pairs (the profiles "
                   "are collected once and reused from OUT/pairs.pt when the run is repeated)")
    r.add_argument("--cost-prompts", type=_positive_int, default=6, help="prompts decoded live to fit the "
                   "cost model of the hardware-aware threshold")
    router_args(r, ("eagle3", "dflash"))
    add_ray_args(r, "each worker profiles whole prompts; the pairs are kept in prompt order (and resume) as they "
                 "come")

    r = ts.add_parser("route", help="routing v2's learned router from N-arm profiles of corpus text")
    r.add_argument("--out", required=True, help="run directory")
    r.add_argument("--arms", default=None, help="the arms it learns, '+'-joined (default "
                   "eagle3+dflash+pld+pld.eagle3+none)")
    r.add_argument("--sequences", type=_positive_int, default=160, help="corpus prompts profiled (a fifth held out)")
    r.add_argument("--new-tokens", type=_positive_int, default=96, help="tokens generated per prompt")
    r.add_argument("--epochs", type=_positive_int, default=40, help="passes over the rows (the profiles are "
                   "collected once and reused from OUT/profiles.pt when the run is repeated)")
    r.add_argument("--cost-prompts", type=_positive_int, default=4, help="prompts decoded live per arm to measure "
                   "its round time")
    r.add_argument("--objective", choices=("rate", "mse"), default="rate", help="rate: the decision's lost tokens "
                   "per ms against the best arm's at each row (default); mse: the accept lengths alone")
    router_args(r, ("eagle3", "dflash", "draft"))

    c = ts.add_parser("curve", help="decode the zoo prompts with every checkpoint a drafter training (--out) kept")
    c.add_argument("--out", required=True, help="the training run's directory")
    c.add_argument("--drafter", choices=[n for n, e in trainings().items()],
                   help="the kind of drafter --out trained")
    c.add_argument("--limit", type=_positive_int, default=2, help="zoo prompts per category")
    c.add_argument("--new-tokens", type=_positive_int, default=96, help="tokens generated per prompt")
    c.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto", help="the decodes' dtype")
    c.set_defaults(fn=cmd_train)

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
