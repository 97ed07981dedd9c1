"""Parameter grids: tokens/s, tau and speedup over AR of every combination of a method's parameters (how the
CPU defaults are picked: `speclab grid`), and the grid's report."""
from __future__ import annotations

import itertools

import pandas as pd

from speclab.bench.run import format_prompt
from speclab.bench.suites import load_suite
from speclab.core.target import Target
from speclab.errors import InvalidInput
from speclab.generate import generate
from speclab.methods import get_method
from speclab.metrics import speedup, tau, tokens_per_s
from speclab.progress import Progress
from speclab.viz import Report


def parse_grid(text: str) -> dict[str, list]:
    """'depth=2,3;tree_topk=1,2' -> {'depth': ['2', '3'], 'tree_topk': ['1', '2']} (values checked by the method)."""
    grid = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        key, eq, values = part.partition("=")
        vals = [v.strip() for v in values.split(",") if v.strip()]
        if not eq or not vals:
            raise InvalidInput(f"grid '{part}' is not param=v1,v2,... (parameters separated by ';')")
        grid[key.strip()] = vals
    return grid


def check_grid_keys(method: str, keys) -> None:
    known = get_method(method).defaults
    for key in keys:
        if key not in known:
            raise InvalidInput(f"'{key}' is not a parameter of {method} ({', '.join(known) or 'it has none'})")


def param_grid(target: Target, models: dict, method: str, grid: dict[str, list], suite: str = "zoo",
               limit: int = 2, max_new_tokens: int = 128, extra: list[dict] | None = None,
               log=print) -> pd.DataFrame:
    """tokens/s, tau and speedup vs AR of every combination of a method's parameters (plus `extra` points, a GPU
    preset say), untraced, on `limit` prompts per category of a suite. Per prompt every combination and AR run
    in a rotated order (drift hits all alike); each decode is checked against AR (greedy). Combinations that
    are the same decode (a chain ignores total_tokens) run once."""
    from speclab.methods import method_params
    check_grid_keys(method, [*grid, *(k for p in extra or [] for k in p)])
    same_decode = get_method(method).same_decode or (lambda p: p)
    combos, seen = [], set()
    for values in itertools.product(*grid.values()):
        p = method_params(method, dict(zip(grid, values)), target)  # checked (and defaults filled) up front
        key = tuple(sorted(same_decode(p).items()))
        if key not in seen:
            seen.add(key)
            combos.append(p)
    for p in extra or []:
        combos.append(method_params(method, p, target))
    rows = [(r, format_prompt(target, r)) for r in load_suite(suite, limit)]
    rows = [(r, ids) for r, ids in rows if ids.numel() + max_new_tokens <= target.max_context]
    if not rows:
        raise InvalidInput(f"no prompt of suite '{suite}' fits the context ({target.max_context} tokens)")
    for p in combos[:1]:  # warm-up
        generate(target, rows[0][1], method, models=models, max_new_tokens=16, **p)
    runs = ["ar"] + list(range(len(combos)))
    stats = {j: {"tokens": 0, "s": 0.0, "rounds": 0, "equal": 0} for j in runs}
    prog = Progress(len(rows) * len(runs), f"grid {method}")
    done = 0
    for i, (r, ids) in enumerate(rows):
        out = {}
        for j in runs[i % len(runs):] + runs[: i % len(runs)]:
            res = generate(target, ids, "ar" if j == "ar" else method, models=models, max_new_tokens=max_new_tokens,
                           **({} if j == "ar" else combos[j]))
            out[j] = res.token_ids
            st = stats[j]
            st["tokens"] += len(res.token_ids)
            st["s"] += res.elapsed_s
            st["rounds"] += res.decode.rounds
            done += 1
            prog.update(done, prompt=r["prompt_id"])
        for j in runs:
            stats[j]["equal"] += out[j] == out["ar"]
    ar_tps = tokens_per_s(stats["ar"]["tokens"], stats["ar"]["s"])
    table = []
    for j, p in enumerate(combos):
        st = stats[j]
        tps = tokens_per_s(st["tokens"], st["s"])
        table.append({**p, "tau": tau(st["tokens"], st["rounds"]), "tokens_per_s": tps, "speedup": speedup(tps, ar_tps),
                      "equal_to_ar": st["equal"] / len(rows), "preset": j >= len(combos) - len(extra or [])})
    log(f"AR: {ar_tps:.1f} tokens/s over {len(rows)} prompts")
    return pd.DataFrame(table).sort_values("tokens_per_s", ascending=False, ignore_index=True)


def grid_report(df: pd.DataFrame, method: str, grid: dict[str, list], x: str | None = None, suite: str = "zoo",
                limit: int = 2, max_new_tokens: int = 128) -> Report:
    """The grid's table (fastest first), its fastest point, and tokens/s and tau curves over parameter `x` (default:
    the grid's last), one line per combination of the others (the extra points left out)."""
    from speclab.viz import lines_figure
    table = df.to_markdown(index=False, floatfmt=".3f")
    best = df.iloc[0]
    fastest = (f"fastest: {', '.join(f'{k}={best[k]}' for k in grid)} at {best.tokens_per_s:.1f} tokens/s "
               f"(speedup {best.speedup:.2f}, tau {best.tau:.2f})")
    x = x or list(grid)[-1]
    others = [k for k in grid if k != x]
    plot = df[~df.preset].copy()
    plot["shape"] = plot[others].astype(str).agg(lambda r: " ".join(f"{k}={v}" for k, v in zip(others, r)), axis=1) \
        if others else method
    figs = [lines_figure(plot, x, "tokens_per_s", "shape", f"{method}: tokens/s over {suite} "
                         f"({limit} prompts per category, {max_new_tokens} tokens)", hover="tau"),
            lines_figure(plot, x, "tau", "shape", f"{method}: acceptance length tau")]
    return Report(f"speclab grid: {method}", f"{table}\n\n{fastest}", figs)
