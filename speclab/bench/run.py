"""Benchmarks: suites x methods, interleaved, traced, with Hugging Face's own speculative decoding as peers.

For every prompt the methods run in a rotated order (machine drift hits all alike) after a warm-up. Every
speclab run is a traced run tagged with the bench id; the peers (`hf_assisted`: `generate(assistant_model=
draft)`, `hf_pld`: `generate(prompt_lookup_num_tokens=k)`) are recorded as runs without rounds. Metrics come
from `speclab.metrics` (one SQL definition each); greedy output equality with AR is checked per run
through `runs.output_hash`; where an output differs, the first differing position and the target's top-2 logit
gap there go to `runs.diverges_at` / `runs.top2_gap` and the report says whether it is a numerical near-tie.
Every speclab method also runs untraced (`<method>-untraced`, a run row without rounds, like the peers): the peer
comparison uses those, traced / untraced time is the tracing overhead, and on CPU their `model_call_share` is the
share of decode time spent inside model forwards (the rest is the engine's own work).
"""
from __future__ import annotations

import json
import resource
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from speclab.equality import first_divergence, output_hash
from speclab.errors import InvalidInput
from speclab.files import write_atomic
from speclab.generate import encode_prompt, generate, model_ms, run_device
from speclab.methods import get_method, parse_spec
from speclab.metrics import tau, tokens_per_s
from speclab.core.precision import dtype_name
from speclab.progress import Progress
from speclab.core.sampling import Sampling
from speclab.bench.suites import load_suite
from speclab.core.target import Target, crop_cache
from speclab.trace import TraceStore

PEERS = ("hf_assisted", "hf_pld")


@dataclass
class BenchConfig:
    suite: str = "zoo"
    methods: list[str] = field(default_factory=lambda: ["ar", "sps", "pld"])
    limit: int | None = 8  # prompts per category
    max_new_tokens: int = 128
    k: dict = field(default_factory=lambda: {"sps": 4, "pld": 8})
    tree_topk: int = 1
    stop_prob: float = 0.0  # sps: stop a chain after a draft token below this probability (hf_assisted gets the same)
    peers: bool = True
    untraced: bool = True  # also time every method with tracing off (peer comparison, tracing overhead)
    warmup: int = 1


def format_prompt(target: Target, row: dict) -> torch.Tensor:
    """Chat prompts go through the tokenizer's chat template when it has one (real chat models on GPU)."""
    tok = target.tokenizer
    if row.get("chat") and getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True)
        return torch.tensor(ids, dtype=torch.long)
    return encode_prompt(target, row["prompt"])


@torch.inference_mode()
def peer_generate(kind: str, target: Target, draft: Target | None, ids: torch.Tensor, max_new_tokens: int, k: int,
                  stop_prob: float = 0.0):
    """Hugging Face's own assisted generation / prompt lookup, greedy, on the same models, configured like
    speclab's method: k draft tokens a round (constant schedule) and the same early-stop threshold
    (`assistant_confidence_threshold`; HF's default is 0.4, 0 turns it off). Returns (ids, seconds)."""
    kw = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=target.eos_ids or None,
              pad_token_id=target.tokenizer.pad_token_id or (target.eos_ids or [0])[0])
    if kind == "hf_assisted":
        draft.model.generation_config.num_assistant_tokens = k
        draft.model.generation_config.num_assistant_tokens_schedule = "constant"
        draft.model.generation_config.assistant_confidence_threshold = stop_prob
        kw.update(assistant_model=draft.model)
    elif kind == "hf_pld":
        kw.update(prompt_lookup_num_tokens=k, max_matching_ngram_size=3)
    inp = ids.view(1, -1).to(target.device)
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = target.model.generate(input_ids=inp, attention_mask=torch.ones_like(inp), **kw)
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    return out[0, inp.shape[1]:].cpu(), time.perf_counter() - t0


def run_bench(cfg: BenchConfig, target: Target, models: dict, store: TraceStore, log=print) -> str:
    """Run the benchmark of `cfg.methods` (method specs) with the drafter models by role (`models`: "draft" also
    drives the hf_assisted peer); returns its bench id (rows in `runs` / `benches` of the store)."""
    draft = models.get("draft")
    for m in cfg.methods:
        get_method(m)
    if "ar" not in cfg.methods:
        raise InvalidInput("a benchmark needs 'ar' among its methods: speedups and equality are measured against it")
    rows, skipped = [], []
    for r in load_suite(cfg.suite, cfg.limit):
        ids = format_prompt(target, r)
        (rows if ids.numel() + cfg.max_new_tokens <= target.max_context else skipped).append((r, ids))
    if not rows:
        raise InvalidInput(f"no prompt of suite '{cfg.suite}' fits the context ({target.max_context} tokens)")
    peers = [p for p in PEERS if cfg.peers and (p != "hf_assisted" or draft is not None)]
    bench_id = f"{cfg.suite}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    store.append_row("benches", bench_id=bench_id, suite=cfg.suite, methods=",".join(cfg.methods + peers),
                     config_json=json.dumps(asdict(cfg)), device=str(target.device), status="running")
    if skipped:
        log(f"skipping {len(skipped)} prompt(s) longer than the context ({target.max_context} tokens)")

    def params(m):
        """The bench's settings for sps and pld; a spec's own parameters override them, others keep defaults."""
        name = parse_spec(m)[0]
        return {"sps": {"k": cfg.k.get("sps"), "tree_topk": cfg.tree_topk, "stop_prob": cfg.stop_prob},
                "pld": {"k": cfg.k.get("pld")}}.get(name, {})

    def run_method(m, r, ids, trace):
        res = generate(target, ids, m, **models, max_new_tokens=cfg.max_new_tokens, trace=trace,
                       prompt_id=r["prompt_id"], category=r["category"], bench_id=bench_id, **params(m))
        return res.run_id, res.token_ids

    def run_untraced(m, r, ids):
        res = generate(target, ids, m, **models, max_new_tokens=cfg.max_new_tokens, **params(m))
        rid = store.start_run(method=f"{m}-untraced", target=target.name, params=params(m), prompt_id=r["prompt_id"],
                              category=r["category"], **run_device(target), bench_id=bench_id,
                              prompt_tokens=ids.numel())
        store.finish_run(rid, "done", new_tokens=len(res.token_ids), elapsed_s=res.elapsed_s, wall_s=res.decode.wall_s,
                         prefill_ms=res.decode.prefill_ms, model_ms=model_ms(target, res.decode),
                         target_calls=res.decode.target_calls, output_hash=output_hash(res.token_ids))
        return rid, res.token_ids

    def run_peer(p, r, ids):
        k = cfg.k.get("sps" if p == "hf_assisted" else "pld", 4)
        out, secs = peer_generate(p, target, draft, ids, cfg.max_new_tokens, k, cfg.stop_prob)
        peer_params = {"k": k, "stop_prob": cfg.stop_prob} if p == "hf_assisted" else {"k": k}
        rid = store.start_run(method=p, target=target.name, drafters=draft.name if p == "hf_assisted" else None,
                              params=peer_params, prompt_id=r["prompt_id"], category=r["category"],
                              **{**run_device(target), "logits_dtype": dtype_name(target.dtype),
                                 "exact": False},  # transformers' own forward and head
                              bench_id=bench_id, prompt_tokens=ids.numel())
        store.finish_run(rid, "done", new_tokens=out.numel(), elapsed_s=secs, output_hash=output_hash(out.tolist()),
                         output_text=target.tokenizer.decode(out.tolist(), skip_special_tokens=True))
        return rid, out.tolist()

    with TraceStore(":memory:") as scratch:  # warm-up: every code path once, untraced and traced, unrecorded
        for r, ids in rows[: cfg.warmup]:
            for m in cfg.methods:
                for trace in (None, scratch):
                    generate(target, ids, m, **models, max_new_tokens=16, trace=trace, **params(m))
            for p in peers:
                peer_generate(p, target, draft, ids, 16, 4, cfg.stop_prob)

    untraced = [f"{m}-untraced" for m in cfg.methods] if cfg.untraced else []
    order = cfg.methods + untraced + peers
    prog = Progress(len(rows) * len(order), f"bench {cfg.suite}")
    done = 0
    try:
        for i, (r, ids) in enumerate(rows):
            outputs = {}  # method -> (run id, generated ids) for this prompt
            for m in order[i % len(order):] + order[: i % len(order)]:
                if target.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                if m in peers:
                    outputs[m] = run_peer(m, r, ids)
                elif m in untraced:
                    outputs[m] = run_untraced(m.removesuffix("-untraced"), r, ids)
                else:
                    outputs[m] = run_method(m, r, ids, store)
                    store.drain()  # its trace lands before the next run starts timing (no overlap with it)
                    if target.device.type == "cuda":
                        store.finish_run(outputs[m][0], "done", peak_mem_mb=torch.cuda.max_memory_allocated() / 2**20)
                done += 1
                prog.update(done, prompt=r["prompt_id"], method=m)
            record_divergences(store, target, ids, outputs)
    except BaseException as e:  # Ctrl-C / SIGTERM / a failure: the bench row says so (its runs say it themselves)
        store.execute("UPDATE benches SET status = ? WHERE bench_id = ?",
                      ["interrupted" if isinstance(e, KeyboardInterrupt) else "failed", bench_id])
        raise
    overhead = None
    if untraced:  # traced / untraced decode time over every prompt and method, same run, same outputs
        t = store.query("SELECT method, sum(elapsed_s) AS s FROM runs WHERE bench_id = ? GROUP BY method", [bench_id])
        t = dict(zip(t.method, t.s))
        overhead = sum(t[m] for m in cfg.methods) / sum(t[f"{m}-untraced"] for m in cfg.methods)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    store.execute("UPDATE benches SET trace_overhead = ?, peak_rss_mb = ?, status = 'done' WHERE bench_id = ?",
                  [overhead, peak_rss, bench_id])
    return bench_id


def record_divergences(store: TraceStore, target: Target, prompt_ids: torch.Tensor, outputs: dict) -> None:
    """For every output that differs from AR's on this prompt: where, and the target's top-2 logit gap there."""
    ar = outputs.get("ar")
    for m, (rid, ids) in outputs.items():
        div = first_divergence(target, prompt_ids, ar[1], ids) if ar and m != "ar" else None
        if div is not None:
            store.record_divergence(rid, div)


# ---- results: one query per question, all from the trace ----

def bench_table(store: TraceStore, bench_id: str):
    """Per category and method: tau, acceptance, tokens/s, speedup vs AR (same run), equality with AR."""
    from speclab.metrics import RATIOS, RUN_SUMS_SQL
    return store.query(f"""
        WITH s AS (SELECT * FROM ({RUN_SUMS_SQL}) WHERE bench_id = ?),
        per AS (SELECT category, method, count(*) AS prompts, sum(new_tokens) AS tokens, {RATIOS}
                FROM s GROUP BY ALL),
        ar AS (SELECT category, tokens_per_s AS ar_tps FROM per WHERE method = 'ar')
        SELECT per.category, per.method, prompts, tokens, tau, acceptance_rate, tokens_per_s,
               tokens_per_s / ar.ar_tps AS speedup, draft_time_share, target_calls_per_token, equal_to_ar, near_tie, bug
        FROM per JOIN ar USING (category)
        ORDER BY category, per.method""", [bench_id])


def bench_overall(store: TraceStore, bench_id: str):
    """The same table pooled over all categories of the bench."""
    from speclab.metrics import RATIOS, RUN_SUMS_SQL
    return store.query(f"""
        WITH s AS (SELECT * FROM ({RUN_SUMS_SQL}) WHERE bench_id = ?),
        per AS (SELECT method, count(*) AS prompts, sum(new_tokens) AS tokens, {RATIOS} FROM s GROUP BY method)
        SELECT per.*, tokens_per_s / (SELECT tokens_per_s FROM per WHERE method = 'ar') AS speedup
        FROM per ORDER BY method""", [bench_id])


def bench_positions(store: TraceStore, bench_id: str):
    """Per-position acceptance per method (pooled over the bench's runs)."""
    return store.query("""
        SELECT r.method, n.depth, count(DISTINCT (n.run_id, n.round)) AS rounds_reaching,
               count(DISTINCT CASE WHEN n.accepted THEN (n.run_id, n.round) END) / count(DISTINCT (n.run_id, n.round)) AS acceptance
        FROM draft_nodes n JOIN runs r USING (run_id) WHERE r.bench_id = ?
        GROUP BY ALL ORDER BY r.method, n.depth""", [bench_id])


def bench_divergences(store: TraceStore, bench_id: str):
    """Outputs that differ from AR: first differing position, top-2 logit gap there, and whether that is a
    numerical near-tie for the target's dtype (speclab.equality)."""
    return store.query("""SELECT method, category, prompt_id, diverges_at, top2_gap, tie_tolerance,
                                 coalesce(top2_gap <= tie_tolerance, false) AS near_tie
                          FROM runs WHERE bench_id = ? AND diverges_at IS NOT NULL ORDER BY method, prompt_id""",
                       [bench_id])


def peer_ratios(overall) -> list[dict]:
    """speclab's tokens/s over Hugging Face's for the matching method (same models, prompts and run): untraced
    (like HF) where the bench timed it, and traced."""
    tps = dict(zip(overall.method, overall.tokens_per_s))
    out = []
    for ours, peer in (("sps", "hf_assisted"), ("pld", "hf_pld")):
        for variant in (f"{ours}-untraced", ours):
            if variant in tps and peer in tps:
                out.append({"speclab": variant, "peer": peer, "speclab_tokens_per_s": tps[variant],
                            "peer_tokens_per_s": tps[peer], "ratio": tps[variant] / tps[peer]})
    return out


def write_report(store: TraceStore, bench_id: str, md_path: str | Path) -> tuple[Path, Path]:
    """Markdown tables and a self-contained HTML report (plotly) next to it."""
    import pandas as pd

    from speclab import viz
    table, overall, pos = bench_table(store, bench_id), bench_overall(store, bench_id), bench_positions(store, bench_id)
    bench = store.query("SELECT * FROM benches WHERE bench_id = ?", [bench_id]).iloc[0]
    peers = pd.DataFrame(peer_ratios(overall))
    fmt = dict(index=False, floatfmt=".3f")
    how = store.query("SELECT any_value(dtype) AS dtype, any_value(logits_dtype) AS logits, any_value(exact) AS exact, "
                      "any_value(cpu) AS cpu FROM runs WHERE bench_id = ? AND method = 'ar'", [bench_id]).iloc[0]
    md = [f"# speclab bench `{bench_id}`", "",
          (f"suite `{bench.suite}`, methods {bench.methods}, device {bench.device} ({how.cpu}), dtype {how.dtype} "
           f"(logits {how.logits}{', exact mode' if how.exact else ''}); config `{bench.config_json}`"), "",
          ("Equality with AR (greedy): `equal_to_ar`, `near_tie` (differs where the target's top-2 logits are within "
           "rounding) and `bug` (differs otherwise) are shares of each method's outputs."), "",
          "## All categories", "", overall.to_markdown(**fmt), "",
          "tokens_per_s is over decode time (prefill + the run's own phases); model_call_share is the share of it "
          "spent inside target and drafter forwards (CPU only: a CUDA forward returns before its kernels end), "
          "the rest is the engine's own work; `-untraced` rows are the engine's fast path.", ""]
    if len(peers):
        md += ["## speclab vs Hugging Face (same target, draft, prompts; greedy)", "", peers.to_markdown(**fmt), ""]
    if bench.trace_overhead == bench.trace_overhead and bench.trace_overhead is not None:
        md += [f"Tracing overhead: traced / untraced decode time, all methods and prompts = **{bench.trace_overhead:.3f}**", ""]
    divs = bench_divergences(store, bench_id)
    if len(divs):
        md += ["## Outputs that differ from AR", "", "First differing token and the target's top-2 logit gap there "
               "(a near-tie is rounding; anything else is a bug until proven otherwise).", "",
               divs.to_markdown(index=False, floatfmt=".3g"), ""]
    md += [f"Peak RSS of the bench process: {bench.peak_rss_mb:.0f} MB", "", "## Per category", "",
           table.to_markdown(**fmt), "", "## Per-position acceptance", "", pos.to_markdown(**fmt), ""]
    md_path = Path(md_path)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(md_path, "\n".join(md))
    html_path = md_path.with_suffix(".html")
    figs = [viz.bench_bars(table, "speedup", "Speedup vs AR (tokens/s ratio, same run)"),
            viz.bench_bars(table, "tau", "Acceptance length tau (tokens per target verification)"),
            viz.position_acceptance(pos)]
    if overall.model_call_share.notna().any():
        figs.append(viz.bench_bars(overall.assign(category="all categories"), "model_call_share",
                                   "Share of decode time inside model forwards (target + drafter)"))
    viz.write_html_report(html_path, f"speclab bench {bench_id}", figs, "\n".join(md))
    return md_path, html_path


@torch.inference_mode()
def forward_costs(models: dict[str, Target], ns=(1, 5, 9), context: int = 200, reps: int = 15, calls: int = 20):
    """Median milliseconds per forward of n tokens after a `context`-token cache, speclab's lean forward against
    the transformers forward on the same weights (interleaved, so drift hits both alike). On CPU this is the
    currency of speculative decoding: a round is a few draft calls and one verification call."""
    import pandas as pd

    rows, todo = [], [(name, n) for name, t in models.items() if t.lean for n in ns]
    bar = Progress(len(todo) * reps, "forward costs")
    done = 0
    for name, n in todo:
        t = models[name]
        pair = {"lean": t, "hf": Target(t.model, t.tokenizer, backend="hf")}
        g = torch.Generator().manual_seed(0)
        prefix = torch.randint(2, t.vocab_size, (context,), generator=g)
        x = torch.randint(2, t.vocab_size, (n,), generator=g)
        caches = {b: m.new_cache() for b, m in pair.items()}
        for b, m in pair.items():
            m.prefill(prefix, caches[b])
        times = {b: [] for b in pair}
        for _ in range(reps):
            for b, m in pair.items():
                t0 = time.perf_counter()
                for _ in range(calls):
                    m.forward(x, caches[b])
                    crop_cache(caches[b], context)
                times[b].append((time.perf_counter() - t0) / calls * 1e3)
            done += 1
            bar.update(done, model=name, n=n)
        med = {b: float(np.median(v)) for b, v in times.items()}
        rows.append({"model": name, "params_m": sum(p.numel() for p in t.model.parameters()) / 1e6, "n": n,
                     "lean_ms": med["lean"], "hf_ms": med["hf"], "speedup": med["hf"] / med["lean"]})
    return pd.DataFrame(rows)


WIDTHS = (1, 2, 4, 8, 16, 32, 64)


@torch.inference_mode()
def dtype_costs(load, dtypes=("fp32", "bf16"), ns=WIDTHS, context: int = 200, reps: int = 9, calls: int = 5):
    """Median milliseconds per call by width (rows per call) and dtype, for the target (fast and exact mode) and
    every drafter: the sps draft model, EAGLE-3's drafter (one call for a frontier of n nodes) and DFlash's (one
    block of n rows: the root and n - 1 masks). `load(dtype)` returns (target, exact target, drafter models by
    role) in that dtype. Per model and dtype the widths are interleaved over `reps`, each a median of `calls`."""
    import pandas as pd

    from speclab.core.precision import cpu_label
    rows = []
    bar = Progress(len(dtypes) * reps, "forward costs by dtype")
    done = 0
    for dt in dtypes:
        target, exact, models = load(dt)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, target.vocab_size, (context + max(ns) + 1,), generator=g)
        callers = {"target": _target_call(target, ids, context), "target (exact)": _target_call(exact, ids, context)}
        if models.get("draft") is not None:
            callers["sps draft"] = _target_call(models["draft"], ids, context)
        if models.get("eagle3") is not None:
            callers["eagle3 drafter"] = _eagle3_call(target, models["eagle3"], ids, context)
        if models.get("dflash") is not None:
            callers["dflash drafter"] = _dflash_call(target, models["dflash"], ids, context)
        times = {(name, n): [] for name in callers for n in ns}
        for _ in range(reps):
            for name, call in callers.items():
                for n in ns:
                    if call(n) is False:
                        continue
                    per = []
                    for _ in range(calls):
                        t0 = time.perf_counter()
                        call(n)
                        per.append(time.perf_counter() - t0)
                    times[name, n].append(float(np.median(per)) * 1e3)
            done += 1
            bar.update(done, dtype=dt)
        for (name, n), v in times.items():
            if v:
                rows.append({"model": name, "dtype": dt, "rows": n, "ms": float(np.median(v))})
    df = pd.DataFrame(rows)
    df.attrs["cpu"] = cpu_label()
    return df


def _target_call(t: Target, ids: torch.Tensor, context: int):
    """One forward of n rows after a `context`-token cache, rolled back after the call."""
    cache = t.new_cache(context + max(WIDTHS) + 8)
    t.forward(ids[:context], cache)

    def call(n):
        t.forward(ids[context : context + n], cache)
        crop_cache(cache, context)
    return call


def _eagle3_call(target: Target, eagle, ids: torch.Tensor, context: int):
    """One EAGLE-3 drafter call for a frontier of n nodes at depth 1 after a `context`-token drafter cache."""
    from speclab.drafters.eagle3 import Eagle3Drafter
    d = Eagle3Drafter(eagle, target)
    d.reset(ids[: context + 1], target.forward(ids[:context], target.new_cache(), layers=d.layers).features)
    d.catch_up(ids[:0], None)

    def call(n):
        d._forward_nodes(ids[context : context + n], d.root_h.expand(n, -1), 1, None)
        d.cache.crop(d.known)
    return call


def _dflash_call(target: Target, dflash, ids: torch.Tensor, context: int):
    """One DFlash drafter call for a block of n rows (the root and n - 1 masks; no block of 1: returns False)."""
    from speclab.drafters.dflash import DFlashDrafter
    blocks = {}

    def call(n):
        if n < 2:
            return False
        if n not in blocks:
            d = blocks[n] = DFlashDrafter(dflash, target, block_size=n, markov=False)
            d.reset(ids[: context + 1], target.forward(ids[:context], target.new_cache(), layers=d.layers).features)
            d.catch_up(ids[:0], None)
        blocks[n].propose(n, Sampling(), None)
    return call


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
    known = get_method(method).params
    for key in keys:
        if key not in known:
            raise InvalidInput(f"'{key}' is not a parameter of {method} ({', '.join(known) or 'it has none'})")


def param_grid(target: Target, models: dict, method: str, grid: dict[str, list], suite: str = "zoo",
               limit: int = 2, max_new_tokens: int = 128, extra: list[dict] | None = None, log=print):
    """tokens/s, tau and speedup vs AR of every combination of a method's parameters (plus `extra` points, a GPU
    preset say), untraced, on `limit` prompts per category of a suite. Per prompt every combination and AR run
    in a rotated order (drift hits all alike); each decode is checked against AR (greedy). Combinations that
    are the same decode (a chain ignores total_tokens) run once."""
    import itertools

    import pandas as pd

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
        generate(target, rows[0][1], method, **models, max_new_tokens=16, **p)
    runs = ["ar"] + list(range(len(combos)))
    stats = {j: {"tokens": 0, "s": 0.0, "rounds": 0, "equal": 0} for j in runs}
    prog = Progress(len(rows) * len(runs), f"grid {method}")
    done = 0
    for i, (r, ids) in enumerate(rows):
        out = {}
        for j in runs[i % len(runs):] + runs[: i % len(runs)]:
            res = generate(target, ids, "ar" if j == "ar" else method, **models, max_new_tokens=max_new_tokens,
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
        table.append({**p, "tau": tau(st["tokens"], st["rounds"]), "tokens_per_s": tps, "speedup": tps / ar_tps,
                      "equal_to_ar": st["equal"] / len(rows), "preset": j >= len(combos) - len(extra or [])})
    log(f"AR: {ar_tps:.1f} tokens/s over {len(rows)} prompts")
    return pd.DataFrame(table).sort_values("tokens_per_s", ascending=False, ignore_index=True)


@torch.inference_mode()
def catchup_costs(target: Target, eagle, backlogs=(1, 4, 16, 64), context: int = 200, reps: int = 15,
                  calls: int = 20):
    """Median milliseconds of one EAGLE-3 catch-up over a backlog of m tokens after a `context`-token drafter
    cache: KV-only prefill (k/v projections for the backlog, the whole layer and head for its last token) against
    a full forward of the backlog (attention, MLP and head on every row). Interleaved; real target features."""
    import pandas as pd

    from speclab.drafters.eagle3 import Eagle3Drafter
    g = torch.Generator().manual_seed(0)
    n = context + max(backlogs) + 1
    ids = torch.randint(2, target.vocab_size, (n,), generator=g)
    layers = eagle.config.target_layers
    feats = target.forward(ids, target.new_cache(), layers=layers).features
    drafters = {mode: Eagle3Drafter(eagle, target, kv_only=mode == "kv_only") for mode in ("kv_only", "full")}
    for d in drafters.values():
        d.reset(ids[: context + 1], feats[:context])
        d.catch_up(ids[:0], None)
    rows = []
    bar = Progress(len(backlogs) * reps, "catch-up costs")
    done = 0
    for m in backlogs:
        times = {mode: [] for mode in drafters}
        new_ids, new_feats = ids[context + 1 : context + 1 + m], feats[context : context + m]
        for _ in range(reps):
            for mode, d in drafters.items():
                t0 = time.perf_counter()
                for _ in range(calls):
                    d.catch_up(new_ids, new_feats)
                    d.known = context  # forget the backlog again (the cache is overwritten in place)
                    d.cache.crop(context)
                times[mode].append((time.perf_counter() - t0) / calls * 1e3)
            done += 1
            bar.update(done, backlog=m)
        med = {mode: float(np.median(v)) for mode, v in times.items()}
        rows.append({"backlog": m, "kv_only_ms": med["kv_only"], "full_ms": med["full"],
                     "saving": 1 - med["kv_only"] / med["full"]})
    return pd.DataFrame(rows)


@torch.inference_mode()
def switch_costs(target: Target, models: dict, contexts=(64, 128, 256, 512), backlogs=(1, 8, 16, 32, 64, 128),
                 reps: int = 7):
    """WhiFlash's Table 4 here: EAGLE-3's KV-only catch-up of a backlog (`catchup_costs`) as a share of one round's
    latency at that context: EAGLE-3 drafting with its CPU defaults + the target's verification of the tree
    (median over `reps`). Contexts x backlogs that do not fit the context window are skipped."""
    import pandas as pd

    from speclab.methods import build_method, method_params
    from speclab.core.sampling import Sampling
    from speclab.core.tree import tree_attention_mask, tree_position_ids

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
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            tree = d.propose(64, Sampling(), None)
            mask = tree_attention_mask(tree.ancestors, c, target.dtype, with_root=True)
            pos = tree_position_ids(tree.depth, c, True)
            target.forward(torch.cat([ids[c:], tree.tokens]), cache, pos, mask)
            crop_cache(cache, c)
            d.cache.crop(d.known)  # drop the draft nodes, keep the root's state: every repetition drafts the same tree
            times.append((time.perf_counter() - t0) * 1e3)
        round_ms = float(np.median(times))
        if not len(tree):
            raise RuntimeError("switch_costs: the EAGLE-3 drafter proposed no tree to verify")
        cu = catchup_costs(target, eagle, backlogs=fits, context=c, reps=reps)
        for x in cu.itertuples():
            rows.append({"context": c, "backlog": x.backlog, "catchup_ms": x.kv_only_ms, "round_ms": round_ms,
                         "share_of_round": x.kv_only_ms / round_ms})
    return pd.DataFrame(rows)


@torch.inference_mode()
def block_costs(target: Target, dflash, block_sizes=(2, 4, 8, 16), context: int = 200, reps: int = 15,
                calls: int = 10):
    """What a DFlash block costs on this machine, per block size (median ms, interleaved): one drafter call
    (plain, and with DSpark's Markov head decoded left to right when the drafter has one; `markov_extra_ms` is
    the head's own cost) and the target's verification forward of the block's rows (the root and the drafted
    tokens) after a `context`-token cache. Real target features."""
    import pandas as pd

    from speclab.drafters.dflash import DFlashDrafter
    from speclab.core.sampling import Sampling
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, target.vocab_size, (context + 1,), generator=g)
    feats = target.forward(ids, target.new_cache(), layers=dflash.config.target_layer_ids).features
    modes = ["plain"] + (["markov"] if dflash.has_markov else [])
    rows = []
    bar = Progress(len(block_sizes) * reps, "block costs")
    done = 0
    for b in block_sizes:
        drafters = {mode: DFlashDrafter(dflash, target, block_size=b, markov=mode == "markov") for mode in modes}
        for d in drafters.values():
            d.reset(ids, feats[:context])
            d.catch_up(ids[:0], None)
        cache = target.new_cache()
        target.forward(ids[:context], cache)
        block = ids[context - b + 1 : context + 1] if b <= context else ids[:b]
        times = {m: [] for m in [*modes, "verify"]}
        for _ in range(reps):
            for mode, d in drafters.items():
                t0 = time.perf_counter()
                for _ in range(calls):
                    d.propose(b, Sampling(), None)
                times[mode].append((time.perf_counter() - t0) / calls * 1e3)
            t0 = time.perf_counter()
            for _ in range(calls):
                target.forward(block, cache)
                crop_cache(cache, context)
            times["verify"].append((time.perf_counter() - t0) / calls * 1e3)
            done += 1
            bar.update(done, block=b)
        med = {m: float(np.median(v)) for m, v in times.items()}
        row = {"block_size": b, "draft_ms": med["plain"]}
        if "markov" in med:
            row.update(draft_markov_ms=med["markov"], markov_extra_ms=med["markov"] - med["plain"])
        row["verify_ms"] = med["verify"]
        rows.append(row)
    return pd.DataFrame(rows)
