"""`speclab flashhead build | costs`: a drafter's FlashHead index (equal-size spherical k-means of its head's rows,
stored beside the drafter: `speclab.flashhead`), and the head's latency dense against flash (the FlashHead
thesis's Tables 4.1-4.2: mean, P50 and P95 per call)."""
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
