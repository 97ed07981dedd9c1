"""FlashHead's experiments (`speclab flashhead build | costs | agreement | tables`), on models already loaded: a
drafter's index built and stored beside it (`build_head_index`), the head's latency dense against flash
(`head_costs`: the FlashHead thesis's Tables 4.1-4.2, mean, P50 and P95 per call), its top-1 agreement with the
dense head while decoding (`agreement`), and the thesis's Tables 4.1-4.6 per drafter at one (c, p)
(`flash_tables`: the head alone, the drafter's step per round, end to end). Each returns data frames; its
`*_report` turns them into the `viz.Report` the command writes."""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from speclab.bench.costs import timeit_interleaved
from speclab.core.engine import decode
from speclab.drafters.flashhead import FlashHead, FlashIndex, build_index, find_index, index_dir
from speclab.drafters.registry import build_drafter, drafters
from speclab.metrics import drafter_ms_per_round, latency_quantiles, speedup, tau, tokens_per_s
from speclab.progress import Progress
from speclab.viz import Report, bench_bars, lines_figure


def head_roles() -> dict:
    """Model role -> (its drafter's registry entry, the head weight of (model, target)) for every drafter whose
    registry build takes the head option."""
    return {e.model.role: (e, e.build.head_weight) for e in drafters().values()
            if e.model is not None and getattr(e.build, "head_weight", None) is not None}


def decode_prompt(target, drafter, prompt: dict, max_new_tokens: int, listeners=()):
    """One greedy decode of a suite prompt with `drafter` (None: AR), untraced unless a listener listens."""
    ids = target.tokenizer(prompt["prompt"], return_tensors="pt")["input_ids"][0]
    return decode(target, ids, {drafter.name: drafter} if drafter is not None else {},
                  max_new_tokens=max_new_tokens, listeners=listeners)


def _dense(weight: torch.Tensor):
    """The dense head on `weight`: fp32 logits of every token."""
    return lambda x: torch.nn.functional.linear(x, weight).float()


def _where(weight: torch.Tensor) -> str:
    return f"{weight.device.type}, {str(weight.dtype).replace('torch.', '')}"


# -- build ----------------------------------------------------------------------------------------------------------
def build_head_index(weight: torch.Tensor, model_dir: str, role: str, clusters: int, seed: int = 0,
                     iters: int = 25) -> tuple[FlashIndex, Path]:
    """The FlashHead index of `clusters` clusters of the head `weight` of the `role` drafter in `model_dir`, built
    (with a progress line) and saved beside it: (the index, its folder)."""
    from speclab.zoo import display_path
    bar = Progress(iters, f"flashhead build {role} c={clusters}")
    idx = build_index(weight, clusters, seed=seed, iters=iters,
                      progress=lambda i, n, obj, moved: bar.update(i, cosine=f"{obj:.3f}", moved=moved),
                      meta={"role": role, "drafter": display_path(model_dir)})
    bar.update(iters)
    return idx, idx.save(index_dir(model_dir, clusters))


def build_line(idx: FlashIndex, out: Path, weight: torch.Tensor) -> str:
    """What `speclab flashhead build` prints: where the index went, its shape and how well it fits."""
    return (f"{out}: {idx.clusters} clusters of {idx.cluster_size} tokens over the [{weight.shape[0]}, "
            f"{weight.shape[1]}] head; mean cosine to the centroid {idx.meta['objective_mean_cosine']:.3f} after "
            f"{idx.meta['iters']} iterations{' (converged)' if idx.meta['converged'] else ''}, "
            f"{idx.meta['build_s']:.1f} s")


# -- costs ----------------------------------------------------------------------------------------------------------
def head_costs(weight: torch.Tensor, idx: FlashIndex, probes: list[int], rows: list[int], reps: int) -> pd.DataFrame:
    """The head's time per call, dense against flash at each probe count, on random rows (`rows` per call), the
    variants taking turns (`timeit_interleaved`): mean, P50 and P95 ms, calls/s and the speedup over dense."""
    sync = torch.cuda.synchronize if weight.device.type == "cuda" else (lambda: None)
    dense = _dense(weight)
    g = torch.Generator().manual_seed(0)
    out = []
    for r in rows:
        h = torch.randn(r, weight.shape[1], generator=g).to(weight.device, weight.dtype)
        fns = {"dense": lambda h=h: (dense(h), sync())}
        for p in probes:
            head = FlashHead(weight, idx, p)
            fns[f"flash p={p}"] = lambda h=h, head=head: (head(h), sync())
        for fn in fns.values():
            for _ in range(3):
                fn()
        stats = timeit_interleaved(fns, reps, quantiles=True)
        base = stats["dense"]["mean"]
        for name, s in stats.items():
            out.append({"rows": r, "head": name, "mean_ms": s["mean"], "p50_ms": s["p50"], "p95_ms": s["p95"],
                        "calls_per_s": 1e3 / s["mean"], "speedup": base / s["mean"]})
    return pd.DataFrame(out)


def head_costs_report(df: pd.DataFrame, role: str, weight: torch.Tensor, idx: FlashIndex) -> Report:
    """`speclab flashhead costs`'s report: the table and the speedup over the dense head by probes, per rows."""
    title = (f"FlashHead on the {role} head [{weight.shape[0]}, {weight.shape[1]}], c = {idx.clusters}, "
             f"b = {idx.cluster_size}; {_where(weight)}")
    fig = lines_figure(df[df["head"] != "dense"].assign(probes=lambda d: d["head"].str.slice(8).astype(int)),
                       "probes", "speedup", "rows", f"{title}: speedup over the dense head by probes")
    return Report(f"speclab flashhead costs: {role}",
                  f"# {title}\n\n" + df.to_markdown(index=False, floatfmt=".3f") + "\n", [fig])


# -- agreement ------------------------------------------------------------------------------------------------------
def agreement(target, role: str, model, weight: torch.Tensor, clusters: list[int], probes: list[int],
              margins: list[float], prompts: list[dict], max_new_tokens: int, reps: int) -> pd.DataFrame:
    """Greedy decodes of `prompts` per index (its `clusters`), probe count and margin: once with the drafter's
    FlashHead in audit mode (top-1 agreement with the dense head, recall of its top token over every row the
    drafter scored), once plain (tau, tokens/s and the drafter's ms per round); and the head's own time per call
    on one row. The first row is the dense head's."""
    for c in clusters:  # each index against the loaded head
        find_index(model.name, c, weight, role)
    entry = head_roles()[role][0]
    models = {role: model}
    points = [None] + [(c, p, m) for c in clusters for m in margins for p in probes]
    bar = Progress(len(prompts) * (2 * len(points) - 1), f"flashhead agreement {role}")
    done, rows = 0, []
    h = torch.randn(1, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.device, weight.dtype)
    for point in points:
        head = {} if point is None else {"head": "flash", "clusters": point[0], "probes": point[1],
                                         "margin": point[2]}
        d = build_drafter(entry.name, target, models, **head)
        if point is not None:
            d.flash.audit = []
            for q in prompts:  # audited: agreement and recall
                decode_prompt(target, d, q, max_new_tokens)
                done += 1
                bar.update(done, clusters=point[0], probes=point[1])
            audit = torch.cat(d.flash.audit).float().mean(0).tolist()
            d.flash.audit = None
        stats = dict.fromkeys(("committed", "rounds", "elapsed_s", "drafter_ms"), 0.0)
        for q in prompts:  # plain: tau, tokens/s and the drafter's time per round
            res = decode_prompt(target, d, q, max_new_tokens)
            for k, v in (("committed", res.new_ids.numel()), ("rounds", res.rounds), ("elapsed_s", res.elapsed_s),
                         ("drafter_ms", res.timings_ms["catchup"] + res.timings_ms["draft"])):
                stats[k] += v
            done += 1
            bar.update(done, clusters=point[0] if point else "dense")
        head_ms = float("nan")  # adaptive probes: the head's time depends on the rows (their tokens/s tell)
        if point is None or point[2] == 0:  # timed on one random row
            call = functools.partial(_dense(weight) if point is None else d.flash, h)
            for _ in range(5):
                call()
            head_ms = timeit_interleaved({"head": call}, reps)["head"]
        rows.append({"head": "dense" if point is None else f"flash c={point[0]} p={point[1]} margin={point[2]:g}",
                     "clusters": 0 if point is None else point[0], "probes": 0 if point is None else point[1],
                     "margin": 0.0 if point is None else point[2], "head_ms": head_ms,
                     "drafter_ms_per_round": drafter_ms_per_round(stats["drafter_ms"], stats["rounds"]),
                     "top1_agreement": 1.0 if point is None else audit[0],
                     "recall": 1.0 if point is None else audit[1], "tau": tau(stats["committed"], stats["rounds"]),
                     "tokens_per_s": tokens_per_s(stats["committed"], stats["elapsed_s"])})
    return pd.DataFrame(rows)


def agreement_report(df: pd.DataFrame, role: str, suite: str, n_prompts: int) -> Report:
    """`speclab flashhead agreement`'s report: the table; tau and tokens/s against the head's ms per call (fixed
    probes), tokens/s by clusters, probes and margin, and the agreement and recall by probes."""
    title = f"FlashHead of the {role} drafter on {suite} ({n_prompts} prompts, greedy)"
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
    return Report(f"speclab flashhead agreement: {role}",
                  f"# {title}\n\n" + df.to_markdown(index=False, floatfmt=".3f") + "\n", figs)


# -- the thesis's tables --------------------------------------------------------------------------------------------
def flash_vs_dense(target, role: str, models: dict, weight: torch.Tensor, cfg: dict, prompts: list[dict],
                   max_new_tokens: int, reps: int, bar: Progress) -> tuple[list, list, list]:
    """One drafter's rows of the tables: (the head alone, its step per round, end to end), dense against the
    flash head of `cfg` (head, clusters, probes, margin)."""
    entry = head_roles()[role][0]
    kinds = {"dense": build_drafter(entry.name, target, models),
             "flash": build_drafter(entry.name, target, models, **cfg)}
    flash = kinds["flash"].flash
    step: dict[str, list[float]] = {"dense": [], "flash": []}
    last_rows: list[int] = []

    def listener(kind: str):
        def listen(ev):
            step[kind].append(ev.timings_ms["catchup"] + ev.timings_ms["draft"])
            if kind == "flash" and flash.last_candidates is not None:
                last_rows.append(flash.last_candidates[..., 0].numel())
        return listen
    for q in prompts:  # the drafter's step per round (catch-up + draft), dense and flash in turn
        for kind, d in kinds.items():
            decode_prompt(target, d, q, max_new_tokens, listeners=(listener(kind),))
            bar.update(bar.done + 1, drafter=role, phase="step")
    e2e = {k: dict.fromkeys(("committed", "rounds", "elapsed_s"), 0.0) for k in ("ar", "dense", "flash")}
    for q in prompts:  # end to end, untraced, in turn
        for kind, sums in e2e.items():
            res = decode_prompt(target, kinds.get(kind), q, max_new_tokens)
            for k, v in (("committed", res.new_ids.numel()), ("rounds", res.rounds), ("elapsed_s", res.elapsed_s)):
                sums[k] += v
            bar.update(bar.done + 1, drafter=role, phase="end to end")
    head = []
    for rows in sorted({1, int(np.median(last_rows)) if last_rows else 1}):  # the head alone
        h = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.device,
                                                                                             weight.dtype)
        fns = {"dense": functools.partial(_dense(weight), h), "flash": functools.partial(flash, h)}
        for fn in fns.values():
            for _ in range(5):
                fn()
        for kind, st in timeit_interleaved(fns, reps, quantiles=True).items():
            head.append({"rows": rows, "head": kind, "mean_ms": st["mean"], "p50_ms": st["p50"],
                         "p95_ms": st["p95"], "calls_per_s": 1e3 / st["mean"]})
    steps = []
    for kind, v in step.items():
        q = latency_quantiles(v)
        steps.append({"head": kind, "mean_ms": q["mean"], "p50_ms": q["p50"], "p95_ms": q["p95"],
                      "rounds_per_s": 1e3 / q["mean"], "rounds": len(v)})
    tps = {k: tokens_per_s(v["committed"], v["elapsed_s"]) for k, v in e2e.items()}
    ends = [{"ar_tokens_per_s": tps["ar"], "dense_tokens_per_s": tps["dense"], "flash_tokens_per_s": tps["flash"],
             "dense_speedup": speedup(tps["dense"], tps["ar"]), "flash_speedup": speedup(tps["flash"], tps["ar"]),
             "flash_over_dense": speedup(tps["flash"], tps["dense"]),
             "dense_tau": tau(e2e["dense"]["committed"], e2e["dense"]["rounds"]),
             "flash_tau": tau(e2e["flash"]["committed"], e2e["flash"]["rounds"])}]
    return head, steps, ends


def flash_tables(target, models: dict, roles: list[str], clusters: int, probes: int, margin: float,
                 prompts: list[dict], max_new_tokens: int, reps: int
                 ) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, dict[str, FlashIndex]]:
    """The FlashHead thesis's Tables 4.1-4.6 for each drafter (`roles`) at one (c, p, margin), in the target's
    dtype: the head alone (dense against flash, on one row and on the rows the drafter's last head call of a round
    had: mean, P50 and P95 ms per call), the drafter's step (its catch-up and draft per round, from decodes with a
    listener: mean, P50, P95), and end to end (tokens/s and tau of AR, the dense drafter and the flash one decoding
    each prompt in turn, untraced). Returns (head, steps, ends, each drafter's index)."""
    weight_of = head_roles()
    weights = {r: weight_of[r][1](models[r], target) for r in roles}
    indexes = {r: find_index(models[r].name, clusters, weights[r], r) for r in roles}
    bar = Progress(len(roles) * len(prompts) * 5, "flashhead tables")
    head_rows, step_rows, e2e_rows = [], [], []
    for r in roles:
        cfg = {"head": "flash", "clusters": indexes[r].clusters, "probes": probes, "margin": margin}
        one = flash_vs_dense(target, r, models, weights[r], cfg, prompts, max_new_tokens, reps, bar)
        for rows, got in zip((head_rows, step_rows, e2e_rows), one):
            rows += [{"drafter": r, **x} for x in got]
    return pd.DataFrame(head_rows), pd.DataFrame(step_rows), pd.DataFrame(e2e_rows), indexes


def _versus(df: pd.DataFrame, by: list[str], what: str) -> pd.DataFrame:
    """Dense against flash, one row per group, with flash's speedup."""
    w = df.pivot_table(index=by, columns="head", values="mean_ms", sort=False).reset_index()
    return w.assign(speedup=w["dense"] / w["flash"]).rename(columns={"dense": f"dense {what} ms",
                                                                     "flash": f"flash {what} ms"})


def flash_tables_report(head: pd.DataFrame, steps: pd.DataFrame, ends: pd.DataFrame,
                        indexes: dict[str, FlashIndex], target, probes: int, margin: float, suite: str,
                        n_prompts: int, max_new_tokens: int) -> Report:
    """`speclab flashhead tables`'s report: the five tables (like the thesis's 4.1-4.6) and the speedups as bars."""
    head_vs, step_vs = _versus(head, ["drafter", "rows"], "head"), _versus(steps, ["drafter"], "step")
    where = (f"c = the drafter's index, p = {probes}" + (f", margin {margin:g}" if margin else "")
             + f"; {target.device.type}, {str(target.dtype).replace('torch.', '')}; {suite}, {n_prompts} "
             f"prompts, {max_new_tokens} new tokens, greedy")
    fmt = functools.partial(pd.DataFrame.to_markdown, index=False, floatfmt=".3f")
    text = (f"# FlashHead against the dense head ({where})\n\n"
            f"Clusters: {', '.join(f'{r} {x.clusters} of {x.cluster_size}' for r, x in indexes.items())}.\n\n"
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
    return Report("speclab flashhead tables", text, [fig])
