"""`speclab flashhead build | costs | agreement | tables`: a drafter's FlashHead index (equal-size spherical k-means
of its head's rows, stored beside the drafter: `speclab.drafters.flashhead`), the head's latency dense against flash
(the FlashHead thesis's Tables 4.1-4.2: mean, P50 and P95 per call), its top-1 agreement with the dense head while
decoding, and the thesis's Tables 4.1-4.6. The experiments are `speclab.bench.flashhead`'s; a command checks its
options (one line each, before any model loads), loads the models, calls and writes."""
from __future__ import annotations

import argparse

from speclab.cli.common import _num, _positive_int
from speclab.errors import SpeclabError
from speclab.models import ModelPaths, add_model_args, load_models


def _roles() -> dict:
    from speclab.bench.flashhead import head_roles
    return head_roles()


def _check_role(a: argparse.Namespace) -> None:
    roles = _roles()
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
    target, models = load_models(ModelPaths.from_args(a), roles=(a.drafter,))
    model = models[a.drafter]
    return target, model, _roles()[a.drafter][1](model, target)


def cmd_build(a: argparse.Namespace) -> int:
    from speclab.bench.flashhead import build_head_index, build_line
    target, model, weight = _load(a)
    if weight.shape[0] % a.clusters:
        from speclab.drafters.flashhead import _divisors_near
        raise SpeclabError(f"--clusters {a.clusters} must divide the head's {weight.shape[0]} rows (e.g. "
                           f"{_divisors_near(weight.shape[0])})")
    idx, out = build_head_index(weight, model.name, a.drafter, a.clusters, seed=a.seed, iters=a.iters)
    print(build_line(idx, out, weight))
    return 0


def cmd_costs(a: argparse.Namespace) -> int:
    from speclab.bench.flashhead import head_costs, head_costs_report
    from speclab.cli.common import write_report
    from speclab.drafters.flashhead import find_index
    probes = _int_list(a.probes, "--probes")
    rows = _int_list(a.rows, "--rows")
    _check_role(a)
    _index_sizes(a, a.drafter, [a.clusters], probes)
    target, model, weight = _load(a)
    idx = find_index(model.name, a.clusters, weight, a.drafter)
    df = head_costs(weight, idx, probes, rows, a.reps)
    write_report(head_costs_report(df, a.drafter, weight, idx), a.report)
    return 0


def cmd_agreement(a: argparse.Namespace) -> int:
    """Greedy decodes of a suite per index, probe count and margin, audited and plain (`bench.flashhead.agreement`);
    the curve over clusters x probes: tau and tokens/s against head ms."""
    from speclab.bench.flashhead import agreement, agreement_report
    from speclab.cli.common import write_report
    probes = _int_list(a.probes, "--probes")
    margins = _float_list(a.margins, "--margins")
    clusters = _int_list(a.clusters, "--clusters", low=0)
    prompts = _prompts(a)
    _check_role(a)
    sizes = _index_sizes(a, a.drafter, clusters, probes)
    target, model, weight = _load(a)
    df = agreement(target, a.drafter, model, weight, sizes, probes, margins, prompts, a.max_new_tokens, a.reps)
    write_report(agreement_report(df, a.drafter, a.suite, len(prompts)), a.report)
    return 0


def cmd_tables(a: argparse.Namespace) -> int:
    """The FlashHead thesis's Tables 4.1-4.6 for each drafter at one (c, p, margin) (`bench.flashhead.flash_tables`)."""
    from speclab.bench.flashhead import flash_tables, flash_tables_report
    from speclab.cli.common import write_report
    roles = _roles()
    names = list(roles) if a.drafters == "all" else [x.strip() for x in a.drafters.split(",") if x.strip()]
    bad = [x for x in names if x not in roles]
    if not names or bad:
        raise SpeclabError(f"--drafters {a.drafters}: 'all' or comma-separated roles from {', '.join(roles)}")
    prompts = _prompts(a)
    for r in names:
        _index_sizes(a, r, [a.clusters], [a.probes])
    target, models = load_models(ModelPaths.from_args(a), roles=tuple(names))
    head, steps, ends, indexes = flash_tables(target, models, names, a.clusters, a.probes, a.margin, prompts,
                                              a.max_new_tokens, a.reps)
    write_report(flash_tables_report(head, steps, ends, indexes, target, a.probes, a.margin, a.suite, len(prompts),
                                     a.max_new_tokens), a.report)
    return 0


def _prompts(a: argparse.Namespace) -> list[dict]:
    from speclab.bench.suites import load_suite
    prompts = load_suite(a.suite, a.limit)
    if not prompts:
        raise SpeclabError(f"suite '{a.suite}' has no prompts")
    return prompts


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
