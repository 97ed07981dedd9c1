"""`speclab flashhead build | costs | agreement`: a drafter's FlashHead index (equal-size spherical k-means of its
head's rows, stored beside the drafter: `speclab.drafters.flashhead`), the head's latency dense against flash (the
FlashHead thesis's Tables 4.1-4.2: mean, P50 and P95 per call), and its top-1 agreement with the dense head while
decoding."""
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


def _check_role(a: argparse.Namespace) -> None:
    roles = head_roles()
    if a.drafter not in roles:
        raise SpeclabError(f"--drafter {a.drafter}: one of {', '.join(roles)}")


def _index_sizes(a: argparse.Namespace, role: str, clusters: list[int], probes: list[int]) -> list[int]:
    """The clusters of each index asked for beside the role's drafter, found and checked against the probes from
    their files, before any model is loaded."""
    from speclab.drafters.flashhead import locate_index
    sizes = [locate_index(ModelPaths.from_args(a).model_path(role), c, role)[1] for c in clusters]
    if max(probes) > min(sizes):
        raise SpeclabError(f"--probes {','.join(map(str, probes))}: at most the {min(sizes)} clusters of the "
                           f"{role} index")
    return sizes


def _load(a: argparse.Namespace):
    _check_role(a)
    roles = head_roles()
    target, models = load_models(ModelPaths.from_args(a), roles=(a.drafter,))
    model = models[a.drafter]
    return target, model, roles[a.drafter][1](model, target)


def cmd_build(a: argparse.Namespace) -> int:
    from speclab.drafters.flashhead import build_index, index_dir
    from speclab.progress import Progress
    from speclab.zoo import display_path
    target, model, weight = _load(a)
    if weight.shape[0] % a.clusters:
        from speclab.drafters.flashhead import _divisors_near
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
    from speclab.drafters.flashhead import FlashHead, find_index
    from speclab.viz import Report, lines_figure
    probes = _int_list(a.probes, "--probes")
    rows_list = _int_list(a.rows, "--rows")
    _check_role(a)
    _index_sizes(a, a.drafter, [a.clusters], probes)
    target, model, weight = _load(a)
    idx = find_index(model.name, a.clusters, weight, a.drafter)
    sync = torch.cuda.synchronize if weight.device.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(0)
    rows = []
    for r in rows_list:
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
    """Greedy decodes of a suite per index (clusters), probe count and margin: once with the drafter's FlashHead in
    audit mode (top-1 agreement with the dense head, recall of its top token over every row the drafter scored),
    once plain (tau, tokens/s and the drafter's ms per round); and the head's own time per call on one row. The
    curve over clusters x probes: tau and tokens/s against head ms."""
    import functools

    import pandas as pd
    import torch

    from speclab.bench.costs import timeit_interleaved
    from speclab.cli.common import write_report
    from speclab.drafters.flashhead import find_index
    from speclab.drafters.registry import build_drafter
    from speclab.metrics import drafter_ms_per_round, tau, tokens_per_s
    from speclab.progress import Progress
    from speclab.viz import Report, lines_figure
    probes = _int_list(a.probes, "--probes")
    margins = _float_list(a.margins, "--margins")
    clusters = _int_list(a.clusters, "--clusters", low=0)
    prompts = _prompts(a)
    _check_role(a)
    sizes = _index_sizes(a, a.drafter, clusters, probes)
    target, model, weight = _load(a)
    for c in sizes:  # each index against the loaded head
        find_index(model.name, c, weight, a.drafter)
    entry = head_roles()[a.drafter][0]
    models = {a.drafter: model}
    points = [None] + [(c, p, m) for c in sizes for m in margins for p in probes]
    bar = Progress(len(prompts) * (2 * len(points) - 1), f"flashhead agreement {a.drafter}")
    done, rows = 0, []
    h = torch.randn(1, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.device, weight.dtype)
    for point in points:
        head = {} if point is None else {"head": "flash", "clusters": point[0], "probes": point[1],
                                         "margin": point[2]}
        d = build_drafter(entry.name, target, models, **head)
        if point is not None:
            d.flash.audit = []
            for q in prompts:  # audited: agreement and recall
                _decode(target, d, q, a.max_new_tokens)
                done += 1
                bar.update(done, clusters=point[0], probes=point[1])
            audit = torch.cat(d.flash.audit).float().mean(0).tolist()
            d.flash.audit = None
        stats = dict.fromkeys(("committed", "rounds", "elapsed_s", "drafter_ms"), 0.0)
        for q in prompts:  # plain: tau, tokens/s and the drafter's time per round
            res = _decode(target, d, q, a.max_new_tokens)
            for k, v in (("committed", res.new_ids.numel()), ("rounds", res.rounds), ("elapsed_s", res.elapsed_s),
                         ("drafter_ms", res.timings_ms["catchup"] + res.timings_ms["draft"])):
                stats[k] += v
            done += 1
            bar.update(done, clusters=point[0] if point else "dense")
        head_ms = float("nan")  # adaptive probes: the head's time depends on the rows (their tokens/s tell)
        if point is None or point[2] == 0:  # timed on one random row
            fn = (lambda x: torch.nn.functional.linear(x, weight).float()) if point is None else d.flash
            call = functools.partial(fn, h)
            for _ in range(5):
                call()
            head_ms = timeit_interleaved({"head": call}, a.reps)["head"]
        rows.append({"head": "dense" if point is None else f"flash c={point[0]} p={point[1]} margin={point[2]:g}",
                     "clusters": 0 if point is None else point[0], "probes": 0 if point is None else point[1],
                     "margin": 0.0 if point is None else point[2], "head_ms": head_ms,
                     "drafter_ms_per_round": drafter_ms_per_round(stats["drafter_ms"], stats["rounds"]),
                     "top1_agreement": 1.0 if point is None else audit[0],
                     "recall": 1.0 if point is None else audit[1], "tau": tau(stats["committed"], stats["rounds"]),
                     "tokens_per_s": tokens_per_s(stats["committed"], stats["elapsed_s"])})
    df = pd.DataFrame(rows)
    title = f"FlashHead of the {a.drafter} drafter on {a.suite} ({len(prompts)} prompts, greedy)"
    flash = df[df.probes > 0].assign(
        curve=lambda x: "c=" + x.clusters.astype(str) + x.margin.map(lambda m: f", margin {m:g}" if m else ""),
        label=lambda x: "p=" + x.probes.astype(str))
    dense = df[df.probes == 0].iloc[0]
    fixed = flash[flash.margin == 0]
    figs = [lines_figure(fixed, "head_ms", y, "curve", f"{title}: {y} against the head's ms per call, fixed probes "
                         f"(dense: {dense.head_ms:.3f} ms, {y} {dense[y]:.2f})", hover="label")
            for y in ("tau", "tokens_per_s")]
    figs.append(lines_figure(flash, "probes", "tokens_per_s", "curve", f"{title}: tokens/s by clusters, probes and "
                             f"margin (dense: {dense.tokens_per_s:.1f})"))
    figs.append(lines_figure(flash.melt(["probes", "curve"], ["top1_agreement", "recall"], "figure", "share")
                             .assign(curve=lambda x: x.figure + ", " + x.curve),
                             "probes", "share", "curve", f"{title}: agreement with the dense head and its recall"))
    write_report(Report(f"speclab flashhead agreement: {a.drafter}",
                        f"# {title}\n\n" + df.to_markdown(index=False, floatfmt=".3f") + "\n", figs), a.report)
    return 0


def cmd_tables(a: argparse.Namespace) -> int:
    """The FlashHead thesis's Tables 4.1-4.6 for each drafter at one (c, p, margin), in the session's dtype: the head
    alone (dense against flash, on one row and on the rows the drafter's last head call of a round had: mean, P50
    and P95 ms per call), the drafter's step (its catch-up and draft per round, from decodes with a listener: mean,
    P50, P95), and end to end (tokens/s and tau of AR, the dense drafter and the flash one decoding each prompt in
    turn, untraced)."""
    import functools

    import pandas as pd

    from speclab.cli.common import write_report
    from speclab.drafters.flashhead import find_index
    from speclab.progress import Progress
    from speclab.viz import Report, bench_bars
    roles = head_roles()
    names = list(roles) if a.drafters == "all" else [x.strip() for x in a.drafters.split(",") if x.strip()]
    bad = [x for x in names if x not in roles]
    if not names or bad:
        raise SpeclabError(f"--drafters {a.drafters}: 'all' or comma-separated roles from {', '.join(roles)}")
    prompts = _prompts(a)
    for r in names:
        _index_sizes(a, r, [a.clusters], [a.probes])
    target, models = load_models(ModelPaths.from_args(a), roles=tuple(names))
    weights = {r: roles[r][1](models[r], target) for r in names}
    indexes = {r: find_index(models[r].name, a.clusters, weights[r], r) for r in names}
    bar = Progress(len(names) * len(prompts) * 5, "flashhead tables")
    head_rows, step_rows, e2e_rows = [], [], []
    for r in names:
        cfg = {"head": "flash", "clusters": indexes[r].clusters, "probes": a.probes, "margin": a.margin}
        one = _flash_vs_dense(a, target, roles[r][0], models, weights[r], cfg, prompts, bar)
        for rows, got in zip((head_rows, step_rows, e2e_rows), one):
            rows += [{"drafter": r, **x} for x in got]
    head, steps, ends = pd.DataFrame(head_rows), pd.DataFrame(step_rows), pd.DataFrame(e2e_rows)

    def versus(df, by, what):  # dense against flash, one row per group
        w = df.pivot_table(index=by, columns="head", values="mean_ms", sort=False).reset_index()
        return w.assign(speedup=w["dense"] / w["flash"]).rename(columns={"dense": f"dense {what} ms",
                                                                         "flash": f"flash {what} ms"})
    head_vs, step_vs = versus(head, ["drafter", "rows"], "head"), versus(steps, ["drafter"], "step")
    where = (f"c = the drafter's index, p = {a.probes}" + (f", margin {a.margin:g}" if a.margin else "")
             + f"; {target.device.type}, {str(target.dtype).replace('torch.', '')}; {a.suite}, {len(prompts)} "
             f"prompts, {a.max_new_tokens} new tokens, greedy")
    fmt = functools.partial(pd.DataFrame.to_markdown, index=False, floatfmt=".3f")
    text = (f"# FlashHead against the dense head ({where})\n\n"
            f"Clusters: {', '.join(f'{r} {indexes[r].clusters} of {indexes[r].cluster_size}' for r in names)}.\n\n"
            f"## Like Table 4.1: the head alone, per call\n\n{fmt(head)}\n\n"
            f"## Like Table 4.2: head speedup\n\n{fmt(head_vs)}\n\n"
            f"## Like Table 4.3: the drafter's step (catch-up and draft per round)\n\n{fmt(steps)}\n\n"
            f"## Like Table 4.4: step speedup\n\n{fmt(step_vs)}\n\n"
            f"## Like Tables 4.5-4.6: end to end\n\n{fmt(ends)}\n")
    bars = pd.concat([
        head_vs.groupby("drafter", sort=False).last().reset_index().assign(method="head (the drafter's rows)"),
        step_vs.assign(method="drafter step"),
        ends.assign(method="end to end", speedup=ends["flash_over_dense"])])
    fig = bench_bars(bars.rename(columns={"drafter": "category"})[["method", "category", "speedup"]], "speedup",
                     f"FlashHead over the dense head ({where})")
    write_report(Report("speclab flashhead tables", text, [fig]), a.report)
    return 0


def _flash_vs_dense(a, target, entry, models, weight, cfg: dict, prompts, bar) -> tuple[list, list, list]:
    """One drafter's rows of `speclab flashhead tables`: (the head alone, its step per round, end to end)."""
    import functools

    import numpy as np
    import torch

    from speclab.bench.costs import timeit_interleaved
    from speclab.drafters.registry import build_drafter
    from speclab.metrics import speedup, tau, tokens_per_s
    drafters = {"dense": build_drafter(entry.name, target, models),
                "flash": build_drafter(entry.name, target, models, **cfg)}
    flash = drafters["flash"].flash
    step: dict[str, list[float]] = {"dense": [], "flash": []}
    last_rows: list[int] = []

    def listener(kind: str):
        def listen(ev):
            step[kind].append(ev.timings_ms["catchup"] + ev.timings_ms["draft"])
            if kind == "flash" and flash.last_candidates is not None:
                last_rows.append(flash.last_candidates[..., 0].numel())
        return listen
    for q in prompts:  # the drafter's step per round (catch-up + draft), dense and flash in turn
        for kind, d in drafters.items():
            _decode(target, d, q, a.max_new_tokens, listeners=(listener(kind),))
            bar.update(bar.done + 1, drafter=entry.model.role, phase="step")
    e2e = {k: dict.fromkeys(("committed", "rounds", "elapsed_s"), 0.0) for k in ("ar", "dense", "flash")}
    for q in prompts:  # end to end, untraced, in turn
        for kind, sums in e2e.items():
            res = _decode(target, drafters.get(kind), q, a.max_new_tokens)
            for k, v in (("committed", res.new_ids.numel()), ("rounds", res.rounds), ("elapsed_s", res.elapsed_s)):
                sums[k] += v
            bar.update(bar.done + 1, drafter=entry.model.role, phase="end to end")
    head = []
    for rows in sorted({1, int(np.median(last_rows)) if last_rows else 1}):  # the head alone
        h = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.device,
                                                                                             weight.dtype)
        fns = {"dense": functools.partial(lambda x: torch.nn.functional.linear(x, weight).float(), h),
               "flash": functools.partial(flash, h)}
        for fn in fns.values():
            for _ in range(5):
                fn()
        for kind, st in timeit_interleaved(fns, a.reps, quantiles=True).items():
            head.append({"rows": rows, "head": kind, "mean_ms": st["mean"], "p50_ms": st["p50"],
                         "p95_ms": st["p95"], "calls_per_s": 1e3 / st["mean"]})
    steps = [{"head": kind, "mean_ms": float(np.mean(v)), "p50_ms": float(np.median(v)),
              "p95_ms": float(np.percentile(v, 95)), "rounds_per_s": 1e3 / float(np.mean(v)), "rounds": len(v)}
             for kind, v in step.items()]
    tps = {k: tokens_per_s(v["committed"], v["elapsed_s"]) for k, v in e2e.items()}
    ends = [{"ar_tokens_per_s": tps["ar"], "dense_tokens_per_s": tps["dense"], "flash_tokens_per_s": tps["flash"],
             "dense_speedup": speedup(tps["dense"], tps["ar"]), "flash_speedup": speedup(tps["flash"], tps["ar"]),
             "flash_over_dense": speedup(tps["flash"], tps["dense"]),
             "dense_tau": tau(e2e["dense"]["committed"], e2e["dense"]["rounds"]),
             "flash_tau": tau(e2e["flash"]["committed"], e2e["flash"]["rounds"])}]
    return head, steps, ends


def _prompts(a: argparse.Namespace) -> list[dict]:
    from speclab.bench.suites import load_suite
    prompts = load_suite(a.suite, a.limit)
    if not prompts:
        raise SpeclabError(f"suite '{a.suite}' has no prompts")
    return prompts


def _decode(target, drafter, prompt: dict, max_new_tokens: int, listeners=()):
    from speclab.core.engine import decode
    ids = target.tokenizer(prompt["prompt"], return_tensors="pt")["input_ids"][0]
    return decode(target, ids, {drafter.name: drafter} if drafter is not None else {},
                  max_new_tokens=max_new_tokens, listeners=listeners)


def _float_list(text: str, opt: str) -> list[float]:
    import math
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or not all(math.isfinite(v) and v >= 0 for v in vals):
        raise SpeclabError(f"{opt} {text}: comma-separated numbers from 0")
    return vals


def _int_list(text: str, opt: str, low: int = 1) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < low:
        raise SpeclabError(f"{opt} {text}: comma-separated whole numbers from {low}")
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
    g.add_argument("--clusters", default="0",
                   help="the indexes, comma-separated, by their clusters (0 = the one beside the drafter)")
    g.add_argument("--probes", default="1,2,4,8,16,32", help="comma-separated")
    g.add_argument("--suite", default="zoo")
    g.add_argument("--limit", type=_positive_int, default=2, help="prompts per category")
    g.add_argument("--margins", default="0", help="adaptive probes: margins in logits, comma-separated (0 = fixed)")
    g.add_argument("--max-new-tokens", type=_positive_int, default=64)
    g.add_argument("--reps", type=_num(int, 5, 100000), default=100, help="timed calls of the head per point")
    g.add_argument("--report", default="reports/flashhead_agreement.md")
    g.set_defaults(fn=cmd_agreement)
    t = fsub.add_parser("tables", help="the thesis's Tables 4.1-4.6 per drafter at one (c, p): the head alone, the "
                        "drafter's step and end to end, dense against flash")
    add_model_args(t)
    t.add_argument("--drafters", default="all", help="comma-separated model roles, or all")
    t.add_argument("--clusters", type=_num(int, 0, 1 << 24), default=0,
                   help="each drafter's index (0 = the one beside it)")
    t.add_argument("--probes", type=_positive_int, default=8)
    t.add_argument("--margin", type=_num(float, 0.0, 1e6), default=0.0, help="adaptive probes (0 = fixed)")
    t.add_argument("--suite", default="zoo")
    t.add_argument("--limit", type=_positive_int, default=2, help="prompts per category")
    t.add_argument("--max-new-tokens", type=_positive_int, default=64)
    t.add_argument("--reps", type=_num(int, 5, 100000), default=200, help="timed calls of the head")
    t.add_argument("--report", default="reports/flashhead_tables.md")
    t.set_defaults(fn=cmd_tables)
