"""`speclab flashhead build | costs | agreement`: a drafter's FlashHead index (equal-size spherical k-means of its
head's rows, stored beside the drafter: `speclab.flashhead`), the head's latency dense against flash (the FlashHead
thesis's Tables 4.1-4.2: mean, P50 and P95 per call), and its top-1 agreement with the dense head while decoding."""
from __future__ import annotations

import argparse

from speclab.cli.common import _num, _positive_int
from speclab.errors import SpeclabError
from speclab.models import ModelPaths, add_model_args, load_models


def head_roles() -> dict:
    """Model role -> (its drafter's registry entry, the head weight of (model, target)) for every drafter whose
    registry build takes the head option."""
    from speclab.drafters.registry import drafters
    return {e.model.role: (e, e.build.head_weight) for e in drafters().values()
            if e.model is not None and getattr(e.build, "head_weight", None) is not None}


def _load(a: argparse.Namespace):
    roles = head_roles()
    if a.drafter not in roles:
        raise SpeclabError(f"--drafter {a.drafter}: one of {', '.join(roles)}")
    target, models = load_models(ModelPaths.from_args(a), roles=(a.drafter,))
    model = models[a.drafter]
    return target, model, roles[a.drafter][1](model, target)


def cmd_build(a: argparse.Namespace) -> int:
    from speclab.flashhead import build_index, index_dir
    from speclab.progress import Progress
    from speclab.zoo import display_path
    target, model, weight = _load(a)
    if weight.shape[0] % a.clusters:
        from speclab.flashhead import _divisors_near
        raise SpeclabError(f"--clusters {a.clusters} must divide the head's {weight.shape[0]} rows (e.g. "
                           f"{_divisors_near(weight.shape[0])})")
    bar = Progress(a.iters, f"flashhead build {a.drafter} c={a.clusters}")
    idx = build_index(weight, a.clusters, seed=a.seed, iters=a.iters,
                      progress=lambda i, n, obj, moved: bar.update(i, cosine=f"{obj:.3f}", moved=moved),
                      meta={"role": a.drafter, "drafter": display_path(model.name)})
    bar.update(a.iters)
    out = idx.save(index_dir(model.name, a.clusters))
    print(f"{out}: {idx.clusters} clusters of {idx.cluster_size} tokens over the [{weight.shape[0]}, "
          f"{weight.shape[1]}] head; mean cosine to the centroid {idx.meta['objective_mean_cosine']:.3f} after "
          f"{idx.meta['iters']} iterations{' (converged)' if idx.meta['converged'] else ''}, "
          f"{idx.meta['build_s']:.1f} s")
    return 0


def cmd_costs(a: argparse.Namespace) -> int:
    import torch

    from speclab.bench.costs import timeit_interleaved
    from speclab.cli.common import write_report
    from speclab.flashhead import FlashHead, find_index
    from speclab.viz import Report, lines_figure
    probes = _int_list(a.probes, "--probes")
    target, model, weight = _load(a)
    idx = find_index(model.name, a.clusters, weight, a.drafter)
    if max(probes) > idx.clusters:
        raise SpeclabError(f"--probes {a.probes}: at most the index's {idx.clusters} clusters")
    sync = torch.cuda.synchronize if weight.device.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(0)
    rows = []
    for r in _int_list(a.rows, "--rows"):
        h = torch.randn(r, weight.shape[1], generator=g).to(weight.device, weight.dtype)
        fns = {"dense": lambda h=h: (torch.nn.functional.linear(h, weight).float(), sync())}
        for p in probes:
            head = FlashHead(weight, idx, p)
            fns[f"flash p={p}"] = lambda h=h, head=head: (head(h), sync())
        for fn in fns.values():
            for _ in range(3):
                fn()
        stats = timeit_interleaved(fns, a.reps, quantiles=True)
        dense = stats["dense"]["mean"]
        for name, s in stats.items():
            rows.append({"rows": r, "head": name, "mean_ms": s["mean"], "p50_ms": s["p50"], "p95_ms": s["p95"],
                         "calls_per_s": 1e3 / s["mean"], "speedup": dense / s["mean"]})
    import pandas as pd
    df = pd.DataFrame(rows)
    title = (f"FlashHead on the {a.drafter} head [{weight.shape[0]}, {weight.shape[1]}], c = {idx.clusters}, "
             f"b = {idx.cluster_size}; {weight.device.type}, {str(weight.dtype).replace('torch.', '')}")
    fig = lines_figure(df[df["head"] != "dense"].assign(probes=lambda d: d["head"].str.slice(8).astype(int)),
                       "probes", "speedup", "rows", f"{title}: speedup over the dense head by probes")
    write_report(Report(f"speclab flashhead costs: {a.drafter}",
                        f"# {title}\n\n" + df.to_markdown(index=False, floatfmt=".3f") + "\n", [fig]), a.report)
    return 0


def cmd_agreement(a: argparse.Namespace) -> int:
    """Greedy decodes of a suite per probe count and margin: once with the drafter's FlashHead in audit mode (top-1
    agreement with the dense head, recall of its top token over every row the drafter scored), once plain (tau and
    tokens/s); and the head's own time per call on one row. The curve: tau and tokens/s against head ms."""
    import functools

    import pandas as pd
    import torch

    from speclab.bench.costs import timeit_interleaved
    from speclab.bench.suites import load_suite
    from speclab.cli.common import write_report
    from speclab.core.engine import decode
    from speclab.drafters.registry import build_drafter
    from speclab.metrics import tau, tokens_per_s
    from speclab.progress import Progress
    from speclab.viz import Report, lines_figure
    probes = _int_list(a.probes, "--probes")
    margins = _float_list(a.margins, "--margins")
    prompts = load_suite(a.suite, a.limit)
    if not prompts:
        raise SpeclabError(f"suite '{a.suite}' has no prompts")
    target, model, weight = _load(a)
    entry = head_roles()[a.drafter][0]
    models = {a.drafter: model}
    points = [None] + [(p, m) for m in margins for p in probes]
    bar = Progress(len(prompts) * (2 * len(points) - 1), f"flashhead agreement {a.drafter}")
    done, rows = 0, []
    h = torch.randn(1, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.device, weight.dtype)
    for point in points:
        head = {} if point is None else {"head": "flash", "clusters": a.clusters, "probes": point[0],
                                         "margin": point[1]}
        d = build_drafter(entry.name, target, models, **head)
        stats = {"committed": 0, "rounds": 0, "elapsed_s": 0.0}
        for audited in ([False] if point is None else [True, False]):
            if point is not None:
                d.flash.audit = [] if audited else None
            for q in prompts:
                ids = target.tokenizer(q["prompt"], return_tensors="pt")["input_ids"][0]
                res = decode(target, ids, {d.name: d}, max_new_tokens=a.max_new_tokens)
                if not audited:
                    stats = {"committed": stats["committed"] + res.new_ids.numel(),
                             "rounds": stats["rounds"] + res.rounds, "elapsed_s": stats["elapsed_s"] + res.elapsed_s}
                done += 1
                bar.update(done, probes=point[0] if point else "dense")
            if audited:
                audit = torch.cat(d.flash.audit).float().mean(0).tolist()
        head_ms = float("nan")  # adaptive probes: the head's time depends on the rows (their tokens/s tell)
        if point is None or point[1] == 0:  # timed on one random row
            fn = (lambda x: torch.nn.functional.linear(x, weight).float()) if point is None else d.flash
            call = functools.partial(fn, h)
            for _ in range(5):
                call()
            head_ms = timeit_interleaved({"head": call}, a.reps)["head"]
        rows.append({"head": "dense" if point is None else f"flash p={point[0]} margin={point[1]:g}",
                     "probes": 0 if point is None else point[0], "margin": 0.0 if point is None else point[1],
                     "head_ms": head_ms, "top1_agreement": 1.0 if point is None else audit[0],
                     "recall": 1.0 if point is None else audit[1], "tau": tau(stats["committed"], stats["rounds"]),
                     "tokens_per_s": tokens_per_s(stats["committed"], stats["elapsed_s"])})
    df = pd.DataFrame(rows)
    title = f"FlashHead of the {a.drafter} drafter on {a.suite} ({len(prompts)} prompts, greedy)"
    flash = df[df.probes > 0].assign(curve=lambda x: "margin " + x.margin.map("{:g}".format),
                                     label=lambda x: "p=" + x.probes.astype(str))
    dense = df[df.probes == 0].iloc[0]
    fixed = flash[flash.margin == 0]
    figs = [lines_figure(fixed, "head_ms", y, "curve", f"{title}: {y} against the head's ms per call, fixed probes "
                         f"(dense: {dense.head_ms:.3f} ms, {y} {dense[y]:.2f})", hover="label")
            for y in ("tau", "tokens_per_s")]
    figs.append(lines_figure(flash, "probes", "tokens_per_s", "curve", f"{title}: tokens/s by probes and margin "
                             f"(dense: {dense.tokens_per_s:.1f})"))
    figs.append(lines_figure(flash.melt(["probes", "curve"], ["top1_agreement", "recall"], "figure", "share")
                             .assign(curve=lambda x: x.figure + ", " + x.curve),
                             "probes", "share", "curve", f"{title}: agreement with the dense head and its recall"))
    write_report(Report(f"speclab flashhead agreement: {a.drafter}",
                        f"# {title}\n\n" + df.to_markdown(index=False, floatfmt=".3f") + "\n", figs), a.report)
    return 0


def _float_list(text: str, opt: str) -> list[float]:
    import math
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or not all(math.isfinite(v) and v >= 0 for v in vals):
        raise SpeclabError(f"{opt} {text}: comma-separated numbers from 0")
    return vals


def _int_list(text: str, opt: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise SpeclabError(f"{opt} {text}: comma-separated whole numbers from 1")
    return vals


def add_parsers(sub) -> None:
    p = sub.add_parser("flashhead", help="FlashHead, a clustered draft LM head: build a drafter's index, time it")
    fsub = p.add_subparsers(dest="flashhead_cmd", required=True)
    b = fsub.add_parser("build", help="equal-size spherical k-means of a drafter's head rows, stored beside it")
    c = fsub.add_parser("costs", help="the head's latency per call, dense against flash, by probes and rows")
    for q in (b, c):
        add_model_args(q)
        q.add_argument("--drafter", required=True, help="the model role: draft (sps), eagle3, dflash, specblock")
    b.add_argument("--clusters", type=_positive_int, required=True, help="c (must divide the head's rows)")
    b.add_argument("--seed", type=_num(int, 0, 2**63 - 1), default=0)
    b.add_argument("--iters", type=_num(int, 1, 1000), default=25, help="k-means iterations at most")
    b.set_defaults(fn=cmd_build)
    c.add_argument("--clusters", type=_num(int, 0, 1 << 24), default=0,
                   help="the index to time (0 = the one beside the drafter)")
    c.add_argument("--probes", default="1,2,4,8,16", help="comma-separated")
    c.add_argument("--rows", default="1,4,8", help="rows per call, comma-separated")
    c.add_argument("--reps", type=_num(int, 5, 100000), default=200)
    c.add_argument("--report", default="reports/flashhead_costs.md")
    c.set_defaults(fn=cmd_costs)
    g = fsub.add_parser("agreement", help="greedy decodes with the head audited: top-1 agreement with the dense "
                        "head, its recall and tau, by probes")
    add_model_args(g)
    g.add_argument("--drafter", required=True, help="the model role: draft (sps), eagle3, dflash, specblock")
    g.add_argument("--clusters", type=_num(int, 0, 1 << 24), default=0,
                   help="the index (0 = the one beside the drafter)")
    g.add_argument("--probes", default="1,2,4,8,16,32", help="comma-separated")
    g.add_argument("--suite", default="zoo")
    g.add_argument("--limit", type=_positive_int, default=2, help="prompts per category")
    g.add_argument("--margins", default="0", help="adaptive probes: margins in logits, comma-separated (0 = fixed)")
    g.add_argument("--max-new-tokens", type=_positive_int, default=64)
    g.add_argument("--reps", type=_num(int, 5, 100000), default=100, help="timed calls of the head per point")
    g.add_argument("--report", default="reports/flashhead_agreement.md")
    g.set_defaults(fn=cmd_agreement)
