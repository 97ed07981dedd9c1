"""Parameter grids: tokens/s, tau and speedup over AR of every combination of a method's parameters (how the
CPU defaults are picked: `speclab grid`), and the grid's report."""
from __future__ import annotations

import itertools
import math

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
        if key.strip() in grid:  # the second would silently replace the first
            raise InvalidInput(f"grid names {key.strip()} twice: give its values once, param=v1,v2,...")
        grid[key.strip()] = vals
    return grid


def check_grid_keys(method: str, keys) -> None:
    known = get_method(method).defaults
    for key in keys:
        if key not in known:
            raise InvalidInput(f"'{key}' is not a parameter of {method} ({', '.join(known) or 'it has none'})")


class Grid:
    """A grid's decoding, prompt by prompt: every distinct combination of a method's parameters (plus `extra`
    points, a GPU preset say) and AR, untraced, on `limit` prompts per category of a suite. `param_grid` decodes
    every prompt in one process; `speclab.cluster` gives each Ray worker its own Grid and the prompts to decode."""

    def __init__(self, target: Target, models: dict, method: str, grid: dict[str, list], suite: str = "zoo",
                 limit: int = 2, max_new_tokens: int = 128, extra: list[dict] | None = None,
                 temperature: float = 0.0, seed: int = 0):
        from speclab.methods import method_params
        check_grid_keys(method, [*grid, *(k for p in extra or [] for k in p)])
        same_decode = get_method(method).same_decode or (lambda p: p)
        self.combos, seen = [], set()
        for values in itertools.product(*grid.values()):  # checked (and the defaults at this T filled) up front
            p = method_params(method, dict(zip(grid, values)), target, sampled=temperature > 0)
            key = tuple(sorted(same_decode(p).items()))
            if key not in seen:
                seen.add(key)
                self.combos.append(p)
        for p in extra or []:
            self.combos.append(method_params(method, p, target, sampled=temperature > 0))
        rows = [(r, format_prompt(target, r)) for r in load_suite(suite, limit)]
        self.rows = [(r, ids) for r, ids in rows if ids.numel() + max_new_tokens <= target.max_context]
        if not self.rows:
            raise InvalidInput(f"no prompt of suite '{suite}' fits the context ({target.max_context} tokens)")
        self.target, self.models, self.method, self.max_new_tokens = target, models, method, max_new_tokens
        self.temperature, self.seed = temperature, seed  # T > 0: every decode of prompt i samples at seed + i
        self.runs = ["ar"] + list(range(len(self.combos)))

    def warm_up(self) -> None:
        for p in self.combos[:1]:
            generate(self.target, self.rows[0][1], self.method, models=self.models, max_new_tokens=16, **p)

    def decode(self, i: int, done=lambda: None) -> dict:
        """Prompt i decoded by AR and every combination in the prompt's rotated order (drift hits all alike), each at
        the prompt's seed under sampling: run -> {tokens, s, rounds, equal (to AR's output; nan under sampling)}."""
        ids, runs = self.rows[i][1], self.runs
        sampled = {"temperature": self.temperature, "seed": self.seed + i} if self.temperature > 0 else {}
        out, stats = {}, {}
        for j in runs[i % len(runs):] + runs[: i % len(runs)]:
            res = generate(self.target, ids, "ar" if j == "ar" else self.method, models=self.models,
                           max_new_tokens=self.max_new_tokens, **sampled,
                           **({} if j == "ar" else self.combos[j]))
            out[j] = res.token_ids
            stats[j] = {"tokens": len(res.token_ids), "s": res.elapsed_s, "rounds": res.decode.rounds}
            done()
        for j in runs:  # sampled decodes are not compared with AR's (nan)
            stats[j]["equal"] = out[j] == out["ar"] if self.temperature <= 0 else math.nan
        return stats

    @staticmethod
    def table(combos: list[dict], prompts: list[dict], n_extra: int = 0, log=print) -> pd.DataFrame:
        """The grid's table from every prompt's `decode`: tokens/s, tau, speedup over AR (the same prompts) and the
        share of outputs equal to AR's, per combination, fastest first."""
        def total(j, key):
            return sum(p[j][key] for p in prompts)
        ar_tps = tokens_per_s(total("ar", "tokens"), total("ar", "s"))
        table = []
        for j, p in enumerate(combos):
            tps = tokens_per_s(total(j, "tokens"), total(j, "s"))
            table.append({**p, "tau": tau(total(j, "tokens"), total(j, "rounds")), "tokens_per_s": tps,
                          "speedup": speedup(tps, ar_tps), "equal_to_ar": total(j, "equal") / len(prompts),
                          "preset": j >= len(combos) - n_extra})
        log(f"AR: {ar_tps:.1f} tokens/s over {len(prompts)} prompts")
        return pd.DataFrame(table).sort_values("tokens_per_s", ascending=False, ignore_index=True)


def param_grid(target: Target, models: dict, method: str, grid: dict[str, list], suite: str = "zoo",
               limit: int = 2, max_new_tokens: int = 128, extra: list[dict] | None = None,
               log=print, temperature: float = 0.0, seed: int = 0) -> pd.DataFrame:
    """tokens/s, tau and speedup vs AR of every combination of a method's parameters (plus `extra` points, a GPU
    preset say), untraced, on `limit` prompts per category of a suite (`Grid`), in this process. Each decode is
    checked against AR (greedy). Combinations that are the same decode (a chain ignores total_tokens) run once.
    `temperature` > 0: every decode samples (prompt i at `seed` + i), so the defaults can be chosen per temperature."""
    g = Grid(target, models, method, grid, suite, limit, max_new_tokens, extra, temperature, seed)
    g.warm_up()
    prog = Progress(len(g.rows) * len(g.runs), f"grid {method}")
    prompts = []
    for i, (r, _) in enumerate(g.rows):
        prompts.append(g.decode(i, lambda r=r: prog.update(prog.done + 1, prompt=r["prompt_id"])))
    return Grid.table(g.combos, prompts, len(extra or []), log=log)


def grid_report(df: pd.DataFrame, method: str, grid: dict[str, list], x: str | None = None, suite: str = "zoo",
                limit: int = 2, max_new_tokens: int = 128, temperature: float = 0.0) -> Report:
    """The grid's table (fastest first), its fastest point, and tokens/s and tau curves over parameter `x` (default:
    the grid's last), one line per combination of the others (the extra points left out)."""
    from speclab.viz import lines_figure
    table = df.to_markdown(index=False, floatfmt=".3f")
    best = df.iloc[0]
    at = f" at T = {temperature:g}" if temperature > 0 else ""
    fastest = (f"fastest{at}: {', '.join(f'{k}={best[k]}' for k in grid)} at {best.tokens_per_s:.1f} tokens/s "
               f"(speedup {best.speedup:.2f}, tau {best.tau:.2f})")
    x = x or list(grid)[-1]
    others = [k for k in grid if k != x]
    plot = df[~df.preset].copy()
    plot["shape"] = plot[others].astype(str).agg(lambda r: " ".join(f"{k}={v}" for k, v in zip(others, r)), axis=1) \
        if others else method
    figs = [lines_figure(plot, x, "tokens_per_s", "shape", f"{method}: tokens/s over {suite} "
                         f"({limit} prompts per category, {max_new_tokens} tokens{at})", hover="tau"),
            lines_figure(plot, x, "tau", "shape", f"{method}: acceptance length tau")]
    return Report(f"speclab grid: {method}", f"{table}\n\n{fastest}", figs)
