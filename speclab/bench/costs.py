"""Cost micro-benchmarks (`speclab costs forward|catchup|switch|block|kernels`): milliseconds per model call, per
catch-up, per switch and per DFlash block on this machine, all timed by one interleaved loop
(`timeit_interleaved`: the variants take turns every repetition, so machine drift hits all alike; medians), and
their reports (tables and curves)."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd
import torch

from speclab.core.sampling import Sampling
from speclab.core.target import Target, crop_cache, row_call
from speclab.metrics import latency_quantiles, speedup
from speclab.progress import Progress
from speclab.viz import Report, lines_figure

WIDTHS = (1, 2, 4, 8, 16, 32, 64)


def timeit_interleaved(fns: dict[Any, Callable[[], object]], reps: int, calls: int = 1, each: bool = False,
                       on_rep: Callable[[], None] | None = None, quantiles: bool = False,
                       before: dict[Any, Callable[[], object]] | None = None) -> dict:
    """Median milliseconds per call of each function (called without arguments). Every repetition calls each
    function `calls` times in turn (interleaved); a repetition's figure is the mean of its calls timed together,
    or with `each` the median of the calls timed one by one (robust to a stray slow call). `before` (with `each`):
    per function, untimed work run before each of its timed calls. `on_rep` runs after every repetition
    (progress). With `quantiles`, each function's {mean, p50, p95} over the repetitions
    (`metrics.latency_quantiles`)."""
    if before is not None and not each:
        raise ValueError("timeit_interleaved: `before` runs before each call timed one by one (each=True)")
    times: dict[Any, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            if each:
                per = []
                for _ in range(calls):
                    if before is not None:
                        before[name]()
                    t0 = time.perf_counter()
                    fn()
                    per.append(time.perf_counter() - t0)
                times[name].append(float(np.median(per)) * 1e3)
            else:
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                times[name].append((time.perf_counter() - t0) / calls * 1e3)
        if on_rep is not None:
            on_rep()
    if quantiles:
        return {name: latency_quantiles(v) for name, v in times.items()}
    return {name: float(np.median(v)) for name, v in times.items()}


class _Bar:
    """A progress line counting repetitions (the `on_rep` of `timeit_interleaved`)."""

    def __init__(self, total: int, label: str):
        self.bar, self.done, self.info = Progress(total, label), 0, {}

    def __call__(self) -> None:
        self.done += 1
        self.bar.update(self.done, **self.info)


@torch.inference_mode()
def forward_costs(models: dict[str, Target], ns=(1, 5, 9), context: int = 200, reps: int = 15,
                  calls: int = 20) -> pd.DataFrame:
    """Median milliseconds per forward of n tokens after a `context`-token cache, speclab's lean forward against
    the transformers forward on the same weights (interleaved, so drift hits both alike); `speedup` = lean's calls
    per second over transformers' (`speclab.metrics.speedup`). On CPU this is the currency of speculative
    decoding: a round is a few draft calls and one verification call."""
    rows, todo = [], [(name, n) for name, t in models.items() if t.lean for n in ns]
    bar = _Bar(len(todo) * reps, "forward costs")
    for name, n in todo:
        t = models[name]
        pair = {"lean": t, "hf": Target(t.model, t.tokenizer, backend="hf")}
        g = torch.Generator().manual_seed(0)
        prefix = torch.randint(2, t.vocab_size, (context,), generator=g)
        x = torch.randint(2, t.vocab_size, (n,), generator=g)
        caches = {b: m.new_cache() for b, m in pair.items()}
        for b, m in pair.items():
            m.prefill(prefix, caches[b])

        def call(m, cache, x=x):
            return lambda: (m.forward(x, cache), crop_cache(cache, context))
        bar.info = {"model": name, "n": n}
        med = timeit_interleaved({b: call(m, caches[b]) for b, m in pair.items()}, reps, calls, on_rep=bar)
        rows.append({"model": name, "params_m": sum(p.numel() for p in t.model.parameters()) / 1e6, "n": n,
                     "lean_ms": med["lean"], "hf_ms": med["hf"],
                     "speedup": speedup(1e3 / med["lean"], 1e3 / med["hf"])})
    return pd.DataFrame(rows)


@torch.inference_mode()
def contemplate_costs(target: Target, confu, nodes=(1, 2, 4, 8, 16), context: int = 200, reps: int = 15,
                      calls: int = 5) -> pd.DataFrame:
    """ConFu's verification cost, in the session's dtype: median ms of a deferred verification of the root and a
    chain of n nodes after a `context`-token cache, plain (n + 1 rows), wide (plus n + 1 contemplate rows in the
    same call) and after (plain, then one contemplate row in a call of its own); `confu` is a ConFu drafter model
    (its soft prompts and [con] MoE). Per n the three are interleaved."""
    from speclab.core.lean import ConRows
    from speclab.core.tree import DraftTree, tree_rows
    from speclab.drafters.contemplate import contemplate, last_token_rows
    if target.lean is None or target.lean.exact:
        raise ValueError("the wide schedule needs the lean forward outside exact mode")
    c = confu.confu.contemplation
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(2, target.vocab_size, (context,), generator=g)
    cache = target.new_cache(context + 2 * max(nodes) + 4)
    feats = target.prefill(prefix, cache, layers=confu.config.target_layers).features
    emb = c.con(feats[-1:].to(c.soft_k.dtype))
    rows, bar = [], _Bar(len(nodes) * reps, "contemplate costs")
    for n in nodes:
        x = torch.randint(2, target.vocab_size, (n + 1,), generator=g)
        tree = DraftTree.chain(x[1:], torch.ones(n))
        pos, visible = tree_rows(tree.ancestors, tree.depth, context, with_root=True)
        con = ConRows(emb.expand(n + 1, -1), pos, visible, c.soft_k, c.soft_v)
        after = last_token_rows(context + 1, context + n + 1)

        def plain(x=x):
            target.forward(x, cache)
            crop_cache(cache, context)

        def wide(x=x, con=con):
            target.forward(x, cache, con=con)
            crop_cache(cache, context)

        def then(x=x, after=after):
            target.forward(x, cache)
            contemplate(target, cache, emb, *after, c.soft_k, c.soft_v)
            crop_cache(cache, context)
        bar.info = {"nodes": n}
        med = timeit_interleaved({"plain": plain, "wide": wide, "after": then}, reps, calls, on_rep=bar)
        rows.append({"nodes": n, "rows": n + 1, "plain_ms": med["plain"], "wide_ms": med["wide"],
                     "after_ms": med["after"], "wide_extra_ms": med["wide"] - med["plain"],
                     "after_extra_ms": med["after"] - med["plain"]})
    return pd.DataFrame(rows)


@torch.inference_mode()
def dtype_costs(load, dtypes=("fp32", "bf16"), ns=WIDTHS, context: int = 200, reps: int = 9,
                calls: int = 5) -> pd.DataFrame:
    """Median milliseconds per call by width (rows per call) and dtype, for the target (fast and exact mode) and
    every drafter model at hand (`drafter_calls`: the sps draft, EAGLE-3's drafter for a frontier of n nodes,
    DFlash's block of n rows, ...). `load(dtype)` returns (target, exact target, drafter models by
    role) in that dtype. Per model and dtype the widths are interleaved over `reps`, each a median of `calls`."""
    from speclab.core.precision import cpu_label
    rows = []
    bar = _Bar(len(dtypes) * reps, "forward costs by dtype")
    for dt in dtypes:
        target, exact, models = load(dt)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, target.vocab_size, (context + max(ns) + 1,), generator=g)
        callers = {"target": row_call(target, ids, context), "target (exact)": row_call(exact, ids, context),
                   **drafter_calls(target, models, ids, context)}
        # every (model, width) that has a call (no DFlash block of 1 row), called once untimed on the way
        fns = {(name, n): (lambda call=call, n=n: call(n)) for name, call in callers.items() for n in ns
               if call(n) is not False}
        bar.info = {"dtype": dt}
        med = timeit_interleaved(fns, reps, calls, each=True, on_rep=bar)
        rows += [{"model": name, "dtype": dt, "rows": n, "ms": ms} for (name, n), ms in med.items()]
    df = pd.DataFrame(rows)
    df.attrs["cpu"] = cpu_label()
    return df


def round_programs(models: dict) -> dict[str, dict[str, list[tuple[str, int, int]]]]:
    """The calls of one round of each method, at its default settings (`speclab.methods`), as (model, rows, calls):
    AR one target row; prompt lookup a verification of k + 1 rows; sps and EAGLE-3 one of k + 1 rows plus k one-row
    drafter calls; DFlash one of a block's rows plus one drafter call over the block. By family (`precision.FAMILIES`):
    'ar', and 'speculative' with every method whose drafter is in `models` (role -> model)."""
    from speclab.methods import METHODS
    d = {n: METHODS[n].defaults for n in ("sps", "pld", "eagle3", "dflash")}
    spec = {"pld": [("target", d["pld"]["k"] + 1, 1)]}
    if models.get("draft") is not None:
        spec["sps"] = [("target", d["sps"]["k"] + 1, 1), ("draft", 1, d["sps"]["k"])]
    if models.get("eagle3") is not None:
        spec["eagle3"] = [("target", d["eagle3"]["depth"] + 1, 1), ("eagle3", 1, d["eagle3"]["depth"])]
    if models.get("dflash") is not None:
        b = d["dflash"]["block_size"]
        spec["dflash"] = [("target", b, 1), ("dflash", b, 1)]
    return {"ar": {"ar": [("target", 1, 1)]}, "speculative": spec}


def role_programs(models: dict) -> dict[str, dict[str, list[tuple[str, int, int]]]]:
    """The calls of one round made by each drafter model that runs in its own dtype (`ModelRole.own_dtype`), at
    its method's defaults: the sps draft's k one-row calls and its catch-up of about two rows. By role."""
    from speclab.methods import METHODS, ROLES
    progs = {}
    for role, r in ROLES.items():
        user = next((m for m in METHODS.values() if role in m.needs and "k" in m.defaults), None)
        if r.own_dtype and models.get(role) is not None and user is not None:
            progs[role] = {user.name: [(role, 1, user.defaults["k"]), (role, 2, 1)]}
    return progs


def median_ci(x) -> tuple[float, float, float]:
    """(median, lower, upper): the median of paired samples and its distribution-free 95% interval (the order
    statistics a sign test puts around it): a slow outlier (another process taking the core for a while) moves
    neither, where it would move a mean and a t interval."""
    x = np.sort(np.asarray(x, dtype=float))
    n = len(x)
    j = max(int(np.floor((n - 1.96 * n**0.5) / 2)), 0)
    return float(np.median(x)), float(x[min(j, n - 1)]), float(x[max(n - 1 - j, 0)])


def settle(log_ratios, tie: float = 0.03) -> str | None:
    """The verdict of paired log(bf16 / fp32) samples: 'bf16' or 'fp32' when the median's 95% interval
    (`median_ci`) excludes equality, 'tie' when it lies within +-`tie`, None while unresolved."""
    _, lo, hi = median_ci(log_ratios)
    return "bf16" if hi < 0 else "fp32" if lo > 0 else "tie" if -np.log1p(tie) < lo and hi < np.log1p(tie) else None


@torch.inference_mode()
def dtype_decision(load, min_reps: int = 12, max_reps: int = 60, calls: int = 3, context: int = 200,
                   tie: float = 0.03, budget_s: float = 30.0, progress: bool = True) -> tuple[dict, pd.DataFrame]:
    """`--dtype auto`, measured: every method family's round (`round_programs`) in fp32 and in bf16 on this machine,
    the two dtypes taking turns every repetition (which goes first alternates), each call the fastest of `calls`
    (load only ever adds time). Per repetition and family the log of bf16 / fp32 round ms is one paired sample;
    after `min_reps` the loop stops as soon as every family is settled: the 95% interval of the median ratio
    (`median_ci`) excludes 1 (the faster dtype wins) or lies within 1 +- `tie` (a tie: `precision.TIE_DTYPE`); at
    `max_reps`, or after `budget_s` seconds of timing (a busy machine), an unresolved family is a tie too.
    `load(dtype)` returns (target, drafter models by role) in that dtype. The calls of each drafter model that runs
    in its own dtype (`role_programs`) are settled the same way, keyed by role. Returns ({family or role: costs},
    the samples)."""
    from speclab.core.precision import TIE_DTYPE
    sets = {dt: load(dt) for dt in ("fp32", "bf16")}
    progs = {**round_programs(sets["fp32"][1]), **role_programs(sets["fp32"][1])}
    fns = {}
    for dt, (target, models) in sets.items():
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, target.vocab_size, (context + max(WIDTHS) + 1,), generator=g)
        callers = {"target": row_call(target, ids, context), **drafter_calls(target, models, ids, context)}
        needed = {(model, rows) for fam in progs.values() for calls_ in fam.values() for model, rows, _ in calls_}
        fns[dt] = {(model, rows): (lambda c=callers[model], n=rows: c(n)) for model, rows in sorted(needed)}
        for fn in fns[dt].values():  # warm-up: every call twice
            fn(), fn()
    samples, settled, t_start = [], {}, time.perf_counter()
    bar = Progress(max_reps, "--dtype auto: timing the decode's calls in fp32 and bf16 (the ETA is an upper bound)") \
        if progress else None
    for rep in range(max_reps):
        ms = {}
        for dt in (("fp32", "bf16") if rep % 2 == 0 else ("bf16", "fp32")):
            for key, fn in fns[dt].items():
                best = float("inf")
                for _ in range(calls):
                    t0 = time.perf_counter()
                    fn()
                    best = min(best, time.perf_counter() - t0)
                ms[dt, key] = best * 1e3
        for fam, methods in progs.items():
            cost = {dt: sum(n * ms[dt, (model, rows)] for calls_ in methods.values() for model, rows, n in calls_)
                    for dt in ("fp32", "bf16")}
            samples.append({"rep": rep, "family": fam, "fp32_ms": cost["fp32"], "bf16_ms": cost["bf16"],
                            "log_ratio": float(np.log(cost["bf16"] / cost["fp32"]))})
        if bar is not None:
            bar.update(rep + 1)
        last = rep + 1 == max_reps or time.perf_counter() - t_start > budget_s
        if rep + 1 < min_reps and not last:
            continue
        df = pd.DataFrame(samples)
        for fam in progs:
            f = df[df.family == fam]
            verdict, (mid, lo, hi) = settle(f.log_ratio, tie), median_ci(f.log_ratio)
            if verdict or last:
                verdict = verdict or "tie"
                settled[fam] = {"verdict": verdict, "dtype": TIE_DTYPE if verdict == "tie" else verdict,
                                "fp32_ms": float(f.fp32_ms.median()), "bf16_ms": float(f.bf16_ms.median()),
                                "ratio": float(np.exp(mid)), "lo": float(np.exp(lo)), "hi": float(np.exp(hi)),
                                "reps": len(f), "methods": sorted(progs[fam])}
            else:
                settled.pop(fam, None)
        if len(settled) == len(progs) or last:
            settled = {fam: settled[fam] for fam in progs}
            break
    if bar is not None and bar.done < max_reps:
        bar.update(max_reps)
    return settled, pd.DataFrame(samples)


def drafter_calls(target: Target, models: dict, ids: torch.Tensor, context: int) -> dict:
    """One call builder (`call(rows)`: `speclab.drafters.registry.ModelRole.call`) per drafter model at hand, by
    role ("draft", "eagle3", "dflash", ...), for every role of the registry that declares one."""
    from speclab.methods import ROLES
    return {role: r.call(target, models[role], ids, context) for role, r in ROLES.items()
            if r.call is not None and models.get(role) is not None}


@torch.inference_mode()
def catchup_costs(target: Target, eagle, backlogs=(1, 4, 16, 64), context: int = 200, reps: int = 15,
                  calls: int = 20) -> pd.DataFrame:
    """Median milliseconds of one EAGLE-3 catch-up over a backlog of m tokens after a `context`-token drafter
    cache: KV-only prefill (k/v projections for the backlog, the whole layer and head for its last token) against
    a full forward of the backlog (attention, MLP and head on every row). Interleaved; real target features."""
    from speclab.drafters.eagle3 import Eagle3Drafter
    g = torch.Generator().manual_seed(0)
    n = context + max(backlogs) + 1
    ids = torch.randint(2, target.vocab_size, (n,), generator=g)
    layers = eagle.config.target_layers
    feats = target.forward(ids, target.new_cache(), layers=layers).features
    drafters = {mode: Eagle3Drafter(eagle, target, depth=4, tree_topk=1, total_tokens=8,
                                    kv_only=mode == "kv_only") for mode in ("kv_only", "full")}
    for d in drafters.values():
        d.reset(ids[: context + 1], feats[:context])
        d.catch_up(ids[:0], None)
    rows = []
    bar = _Bar(len(backlogs) * reps, "catch-up costs")
    for m in backlogs:
        new_ids, new_feats = ids[context + 1 : context + 1 + m], feats[context : context + m]

        def catch_up(d, new_ids=new_ids, new_feats=new_feats):
            def call():
                d.catch_up(new_ids, new_feats)
                d.known = context  # forget the backlog again (the cache is overwritten in place)
                d.cache.crop(context)
            return call
        bar.info = {"backlog": m}
        med = timeit_interleaved({mode: catch_up(d) for mode, d in drafters.items()}, reps, calls, on_rep=bar)
        rows.append({"backlog": m, "kv_only_ms": med["kv_only"], "full_ms": med["full"],
                     "saving": 1 - med["kv_only"] / med["full"]})
    return pd.DataFrame(rows)


@torch.inference_mode()
def switch_costs(target: Target, models: dict, contexts=(64, 128, 256, 512), backlogs=(1, 8, 16, 32, 64, 128),
                 reps: int = 7) -> pd.DataFrame:
    """WhiFlash's Table 4 here: EAGLE-3's KV-only catch-up of a backlog (`catchup_costs`) as a share of one round's
    latency at that context: EAGLE-3 drafting with its CPU defaults + the target's verification of the tree
    (median over `reps`). Contexts x backlogs that do not fit the context window are skipped."""
    from speclab.core.tree import tree_attention_mask, tree_position_ids
    from speclab.methods import build_method, method_params

    eagle = models["eagle3"]
    rows = []
    g = torch.Generator().manual_seed(1)
    for c in contexts:
        fits = [b for b in backlogs if c + b + 1 <= target.max_context]
        if not fits:
            continue
        ids = torch.randint(2, target.vocab_size, (c + 1,), generator=g)
        drafters, _ = build_method("eagle3", target, models, method_params("eagle3", {}, target))
        d = drafters["eagle3"]
        cache = target.new_cache()
        feats = target.forward(ids[:c], cache, layers=d.layers).features
        d.reset(ids, feats)
        d.catch_up(ids[:0], None)
        trees = []

        def one_round(d=d, cache=cache, ids=ids, c=c, trees=trees):
            tree = d.propose(64, Sampling(), None)
            mask = tree_attention_mask(tree.ancestors, c, target.dtype, with_root=True)
            pos = tree_position_ids(tree.depth, c, True)
            target.forward(torch.cat([ids[c:], tree.tokens]), cache, pos, mask)
            crop_cache(cache, c)
            d.cache.crop(d.known)  # drop the draft nodes, keep the root's state: every repetition drafts the same tree
            trees[:] = [tree]
        round_ms = timeit_interleaved({"round": one_round}, reps)["round"]
        if not len(trees[0]):
            raise RuntimeError("switch_costs: the EAGLE-3 drafter proposed no tree to verify")
        cu = catchup_costs(target, eagle, backlogs=fits, context=c, reps=reps)
        for x in cu.itertuples():
            rows.append({"context": c, "backlog": x.backlog, "catchup_ms": x.kv_only_ms, "round_ms": round_ms,
                         "share_of_round": x.kv_only_ms / round_ms})
    return pd.DataFrame(rows)


@torch.inference_mode()
def block_costs(target: Target, dflash, block_sizes=(2, 4, 8, 16), context: int = 200, reps: int = 15,
                calls: int = 10) -> pd.DataFrame:
    """What a DFlash block costs on this machine, per block size (median ms, interleaved): one drafter call
    (plain, and with DSpark's Markov head decoded left to right when the drafter has one; `markov_extra_ms` is
    the head's own cost) and the target's verification forward of the block's rows (the root and the drafted
    tokens) after a `context`-token cache. Real target features."""
    from speclab.drafters.dflash import DFlashDrafter
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, target.vocab_size, (context + 1,), generator=g)
    feats = target.forward(ids, target.new_cache(), layers=dflash.config.target_layer_ids).features
    modes = ["plain"] + (["markov"] if dflash.has_markov else [])
    rows = []
    bar = _Bar(len(block_sizes) * reps, "block costs")
    for b in block_sizes:
        drafters = {mode: DFlashDrafter(dflash, target, block_size=b, markov=mode == "markov", tree_topk=1,
                                       total_tokens=16) for mode in modes}
        for d in drafters.values():
            d.reset(ids, feats[:context])
            d.catch_up(ids[:0], None)
        cache = target.new_cache()
        target.forward(ids[:context], cache)
        block = ids[context - b + 1 : context + 1] if b <= context else ids[:b]

        def verify(cache=cache, block=block):
            target.forward(block, cache)
            crop_cache(cache, context)
        fns = {mode: (lambda d=d, b=b: d.propose(b, Sampling(), None)) for mode, d in drafters.items()}
        bar.info = {"block": b}
        med = timeit_interleaved({**fns, "verify": verify}, reps, calls, on_rep=bar)
        row = {"block_size": b, "draft_ms": med["plain"]}
        if "markov" in med:
            row.update(draft_markov_ms=med["markov"], markov_extra_ms=med["markov"] - med["plain"])
        row["verify_ms"] = med["verify"]
        rows.append(row)
    return pd.DataFrame(rows)


# ---- reports: the tables and curves `speclab costs ...` print and write ----

def forward_costs_report(df: pd.DataFrame, context: int) -> Report:
    """Lean vs transformers: the table and bars of ms per call."""
    from speclab.viz import bench_bars
    table = df.to_markdown(index=False, floatfmt=".2f")
    long = df.melt(id_vars=["model", "n"], value_vars=["lean_ms", "hf_ms"], var_name="method", value_name="ms")
    long["method"] = long["method"].str.removesuffix("_ms")
    long["category"] = long["model"] + " n=" + long["n"].astype(str)
    return Report("Milliseconds per forward: lean vs transformers", table,
                  [bench_bars(long, "ms", f"ms per call after a {context}-token cache (lower is better)")])


def dtype_costs_report(df: pd.DataFrame, context: int) -> Report:
    """ms per call by width and dtype: one row per (model, dtype), one column per width, and the curves."""
    wide = df.pivot_table(index=["model", "dtype"], columns="rows", values="ms", sort=False).reset_index()
    wide.columns = [c if isinstance(c, str) else f"{c} rows" for c in wide.columns]
    table = wide.to_markdown(index=False, floatfmt=".2f")
    text = f"ms per call after a {context}-token cache (median), on {df.attrs['cpu']}\n\n{table}"
    curves = df.assign(**{"model / dtype": df["model"] + " " + df["dtype"]})
    fig = lines_figure(curves, "rows", "ms", "model / dtype", f"ms per call after a {context}-token cache, by rows "
                       "per call (lower is better)", "rows per call", "ms per call")
    return Report(f"Milliseconds per call by width and dtype ({df.attrs['cpu']})", text, [fig])


def dtype_decision_report(d) -> Report:
    """`speclab costs dtype`: what --dtype auto chose per method family on this machine and why (a
    `precision.DtypeDecision`): each family's round in both dtypes, the ratio and its interval, and, when measured
    now, the ratio of every paired repetition."""
    from speclab.core.precision import FAMILIES, cache_path, cpu_label
    rows = [{"family": f if f in d.dtypes else f"{f} model", "dtype": d.dtypes.get(f) or d.roles.get(f),
             **{k: c.get(k) for k in ("verdict", "fp32_ms", "bf16_ms", "ratio", "lo", "hi", "reps")},
             "methods": ", ".join(c.get("methods", []))} for f, c in d.costs.items()]
    table = pd.DataFrame(rows).to_markdown(index=False, floatfmt=".3f") if rows else "(no measurement needed)"
    lines = [f"--dtype auto on {cpu_label()}, {d.source}" + (f" ({d.measured_at})" if d.measured_at and
                                                               d.source != "measured now" else ""),
             f"cache: {cache_path()} (key {d.key or '-'})", "",
             "ms of one round of each family at its methods' default settings (medians of paired repetitions); "
             "ratio = bf16 / fp32 (< 1: bf16 faster) with the 95% interval of its median; a tie (interval within "
             "+-3%, or unresolved) picks fp32, the exact reference. A drafter model that computes apart from the "
             "target (the sps draft) is timed alone, its calls of a round, and runs in its own faster dtype (a tie: "
             "the speculative family's).", "", table, ""]
    lines += [f"- {f} ({FAMILIES[f]}): {d.line(f)}" for f in d.dtypes]
    lines += [f"- {r} model: --dtype auto -> {dt}: {d.role_reason[r]}" for r, dt in d.roles.items()]
    figs = []
    if d.samples is not None and len(d.samples):
        sm = d.samples.assign(ratio=np.exp(d.samples.log_ratio))
        figs.append(lines_figure(sm, "rep", "ratio", "family", "bf16 / fp32 ms per round, each paired repetition "
                                 "(< 1: bf16 faster)", "repetition", "bf16 / fp32"))
    return Report(f"--dtype auto on this machine ({cpu_label()})", "\n".join(lines), figs)


def cost_curves_report(df: pd.DataFrame, x: str, cols: list[str], legend: str, title: str, subtitle: str,
                       x_title: str) -> Report:
    """A cost table with its curves: ms over `x`, one line per column of `cols` (catch-up and block costs)."""
    from speclab.viz import lines_figure
    long = df.melt(id_vars=[x], value_vars=cols, var_name=legend, value_name="ms")
    return Report(title, df.to_markdown(index=False, floatfmt=".3f"),
                  [lines_figure(long, x, "ms", legend, subtitle, x_title=x_title)])


def switch_costs_report(df: pd.DataFrame) -> Report:
    """The switch cost as a share of round latency: by context x backlog, the full table, and the curves."""
    from speclab.viz import lines_figure
    wide = df.pivot_table(index="context", columns="backlog", values="share_of_round").reset_index()
    text = ("EAGLE-3 catch-up (KV-only prefill) of a backlog as a share of a WhiFlash round's latency (EAGLE-3 "
            "drafting + verification) at that context\n\n" + wide.to_markdown(index=False, floatfmt=".3f")
            + "\n\n" + df.to_markdown(index=False, floatfmt=".3f"))
    fig = lines_figure(df.assign(context=df.context.astype(str) + " tokens"), "backlog", "share_of_round", "context",
                       "Switch cost as a share of round latency", x_title="backlog tokens", y_title="share of round")
    return Report("WhiFlash switch cost", text, [fig])


def kernels_report(df: pd.DataFrame, device: str) -> Report:
    """Torch twin vs Triton kernel per op and size (`kernels.bench.run`'s rows)."""
    from speclab.viz import bench_bars
    long = df.melt(id_vars=["op", "size"], value_vars=["torch_us", "triton_us"], var_name="method", value_name="us")
    long = long[long.us.notna()].assign(category=lambda d: d.op + " " + d["size"])
    fig = bench_bars(long, "us", f"Median microseconds per call on {device} (lower is better)")
    return Report("speclab costs kernels", df.to_markdown(index=False), [fig])


@torch.inference_mode()
def measure_profile(target: Target, models: dict, name: str, widths=(1, 2, 4, 8, 16, 32), backlogs=(1, 4, 16, 64),
                    prompts=(16, 64, 128), context: int = 200, reps: int = 9, calls: int = 5, decode_tokens: int = 48):
    """A hardware cost profile of this machine in the target's dtype (`speclab.routing.hardware`): the target's
    forward by rows after `context` tokens, its prefill by prompt length, its head on one row; per routed drafter
    (EAGLE-3 and DFlash at their default parameters) one propose, its catch-up by backlog, and the rest of a round
    (routing, commit, recording) from a short greedy decode. One interleaved timing loop per table (medians);
    progress with ETA."""
    import platform

    from speclab.core.precision import cpu_label
    from speclab.generate import generate
    from speclab.methods import build_method, method_params
    from speclab.routing.hardware import HardwareProfile, cost_model
    from speclab.routing.replay import DRAFTERS

    g = torch.Generator().manual_seed(0)
    n_ids = context + max(max(widths), max(backlogs), max(prompts)) + 2
    ids = torch.randint(3, target.vocab_size, (n_ids,), generator=g)
    bar = _Bar(reps * (4 + len(DRAFTERS)), "measuring costs")
    fw = row_call(target, ids, context)
    bar.info = {"table": "target forward"}
    forward = timeit_interleaved({n: (lambda n=n: fw(n)) for n in widths}, reps, calls, each=True, on_rep=bar)
    bar.info = {"table": "prefill"}
    prefill = timeit_interleaved({p: (lambda p=p: target.forward(ids[:p], target.new_cache(p + 1)))
                                  for p in prompts}, reps, max(1, calls // 2), on_rep=bar)
    h = torch.randn(1, target.hidden_size, generator=g).to(target.device, target.dtype)
    bar.info = {"table": "head"}
    head = timeit_interleaved({"head": lambda: target.head(h)}, reps, calls, on_rep=bar)["head"]
    drafters = {}
    for dname in DRAFTERS:
        built, _ = build_method(dname, target, models, method_params(dname, {}, target))
        d = built[dname]
        feats = target.forward(ids, target.new_cache(), layers=d.layers).features
        d.reset(ids[: context + 1], feats[:context])
        d.catch_up(ids[:0], None)
        known, widths_seen = d.known, []

        def propose(d=d, known=known, widths_seen=widths_seen):
            tree = d.propose(64, Sampling(), None)
            widths_seen.append(len(tree))
            d.cache.crop(known)  # drop the draft: every repetition drafts from the same state

        def catch_up(m, d=d, known=known, feats=feats):
            d.catch_up(ids[context + 1 : context + 1 + m], feats[context : context + m])
            d.known = known  # forget the backlog again (the cache is overwritten in place)
            d.cache.crop(known)
        bar.info = {"table": f"{dname} draft and catch-up"}
        med = timeit_interleaved({"draft": propose, **{m: (lambda m=m: catch_up(m)) for m in backlogs}}, reps, calls,
                                 on_rep=bar)
        drafters[dname] = {"draft_ms": med["draft"], "width": float(np.median(widths_seen)),
                           "catchup_ms": {str(m): med[m] for m in backlogs}}
    other = {dname: [] for dname in DRAFTERS}

    def keep(ev):
        if ev.drafter in other:
            other[ev.drafter].append(sum(ev.timings_ms.get(k, 0.0) for k in ("route", "commit", "record")))
    bar.info = {"table": "rest of a round"}
    for _ in range(reps):
        for dname in DRAFTERS:
            generate(target, "def fibonacci(n):\n", dname, models=models, max_new_tokens=decode_tokens, on_round=keep)
        bar()
    for dname in DRAFTERS:
        drafters[dname]["other_ms"] = float(np.median(other[dname])) if other[dname] else 0.0
    measured = {"context": context, "target_forward_ms": {str(n): v for n, v in forward.items()},
                "prefill_ms": {str(p): v for p, v in prefill.items()}, "head_ms": head, "drafters": drafters}
    machine = {"device": str(target.device.type), "cpu": cpu_label(), "threads": torch.get_num_threads(),
               "torch": torch.__version__, "python": platform.python_version(),
               "gpu": torch.cuda.get_device_name(target.device) if target.device.type == "cuda" else None}
    roles = {"target": target, **{k: models.get(k) for k in DRAFTERS}}
    mods = {role: {"name": getattr(m, "name", None), "fingerprint": getattr(m, "fingerprint", None)}
            for role, m in roles.items() if m is not None}
    return HardwareProfile(name, "measured", machine, str(target.precision["dtype"]), cost_model(measured), mods,
                           measured)


def profile_report(p) -> Report:
    """A cost profile's tables: the target by rows, the drafters, and the fitted round-cost model."""
    m = p.measured
    fw = pd.DataFrame({"rows": [int(k) for k in m["target_forward_ms"]], "ms": list(m["target_forward_ms"].values())})
    dr = pd.DataFrame([{"drafter": k, "draft_ms": v["draft_ms"], "nodes": v["width"], "other_ms": v["other_ms"],
                        **{f"catchup_{b}_ms": x for b, x in v["catchup_ms"].items()}}
                       for k, v in m["drafters"].items()])
    text = "\n\n".join([
        f"## Cost profile {p.label}\n\nmachine: {p.machine}\n\nhead (one row): {m['head_ms']:.3f} ms; prefill: "
        + ", ".join(f"{k} tokens {v:.2f} ms" for k, v in m["prefill_ms"].items()),
        f"### Target forward after {m['context']} tokens (ms)\n\n" + fw.to_markdown(index=False, floatfmt=".3f"),
        "### Drafters (ms)\n\n" + dr.to_markdown(index=False, floatfmt=".3f"),
        "### Round-cost model fitted to it\n\n" + p.cost.table().to_markdown(index=False, floatfmt=".3f")])
    fig = lines_figure(fw.assign(model="target"), "rows", "ms", "model", f"Target forward by rows: {p.label}",
                       "rows per call", "ms per call")
    return Report(f"cost profile {p.name}", text, [fig])
