"""A bench's results, all from the trace: one query per question, every figure from `speclab.metrics` (tau,
acceptance, tokens/s, speedup over AR, per-position acceptance, equality with AR), and the bench's report
(`bench_report`: markdown tables and plotly figures; `speclab.cli.common.write_report` writes it)."""
from __future__ import annotations

import json

import pandas as pd

from speclab.metrics import AR_SQL, RATIOS, RUN_SUMS_SQL, SPEEDUP_SQL, paired_gains, position_acceptance_sql, speedup
from speclab.trace import TraceStore
from speclab.viz import Report


def bench_table(store: TraceStore, bench_id: str) -> pd.DataFrame:
    """Per category and method: its dtype, tau, acceptance, tokens/s, speedup vs the fastest AR of the bench (AR in
    each dtype the bench ran it in), equality with AR in the method's own dtype."""
    return store.query(f"""
        WITH s AS (SELECT * FROM ({RUN_SUMS_SQL}) WHERE bench_id = ?),
        per AS (SELECT category, method, string_agg(DISTINCT dtype, '+') AS dtype, count(*) AS prompts,
                       sum(new_tokens) AS tokens, {RATIOS}
                FROM s GROUP BY category, method),
        ar AS (SELECT category, max(tokens_per_s) AS ar_tokens_per_s FROM per WHERE {AR_SQL} GROUP BY category)
        SELECT per.category, per.method, dtype, prompts, tokens, tau, acceptance_rate, tokens_per_s,
               {SPEEDUP_SQL} AS speedup, draft_time_share, drafter_ms_per_round, verify_ms_per_round,
               target_calls_per_token, equal_to_ar, near_tie, bug
        FROM per JOIN ar USING (category)
        ORDER BY category, per.method""", [bench_id])


def bench_overall(store: TraceStore, bench_id: str) -> pd.DataFrame:
    """The same table pooled over all categories of the bench."""
    return store.query(f"""
        WITH s AS (SELECT * FROM ({RUN_SUMS_SQL}) WHERE bench_id = ?),
        per AS (SELECT method, string_agg(DISTINCT dtype, '+') AS dtype, count(*) AS prompts,
                       sum(new_tokens) AS tokens, {RATIOS} FROM s GROUP BY method),
        ar AS (SELECT max(tokens_per_s) AS ar_tokens_per_s FROM per WHERE {AR_SQL})
        SELECT per.*, {SPEEDUP_SQL} AS speedup
        FROM per LEFT JOIN ar ON true ORDER BY method""", [bench_id])


def bench_workers(store: TraceStore, bench_id: str) -> pd.DataFrame:
    """A cluster bench (`speclab.cluster`) per worker: its prompts, each method's tokens/s there and speedup over
    AR on the same worker (AR in the fastest dtype it ran there); empty for a bench decoded in one process."""
    return store.query(f"""
        WITH s AS (SELECT * FROM ({RUN_SUMS_SQL}) WHERE bench_id = ? AND worker IS NOT NULL),
        per AS (SELECT node, worker, method, count(DISTINCT prompt_id) AS prompts, {RATIOS} FROM s GROUP BY ALL),
        ar AS (SELECT worker, max(tokens_per_s) AS ar_tokens_per_s FROM per WHERE {AR_SQL} GROUP BY worker)
        SELECT node, worker, method, prompts, tokens_per_s, {SPEEDUP_SQL} AS speedup
        FROM per JOIN ar USING (worker) ORDER BY worker, method""", [bench_id])


def bench_positions(store: TraceStore, bench_id: str) -> pd.DataFrame:
    """Per-position acceptance per method, pooled over the bench's runs (`speclab.metrics.position_acceptance_sql`)."""
    return store.query(position_acceptance_sql("r.method", "WHERE r.bench_id = ?") + " ORDER BY r.method, n.depth",
                       [bench_id])


def bench_divergences(store: TraceStore, bench_id: str) -> pd.DataFrame:
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
                            "peer_tokens_per_s": tps[peer], "ratio": speedup(tps[variant], tps[peer])})
    return out


LLAMACPP = ("llamacpp", "llamacpp_pld", "llamacpp_sps")  # the llama.cpp peers (`speclab.bench.llamacpp`)


def llamacpp_table(table: pd.DataFrame, overall: pd.DataFrame) -> pd.DataFrame:
    """Per category and over all: speclab's fastest method against llama.cpp's fastest peer, tokens/s over the
    same prompts, and their ratio (above 1: speclab ahead). speclab's methods count untraced where the bench timed
    them so (llama.cpp traces nothing); empty when the bench ran no llama.cpp peer."""
    both = pd.concat([table, overall.assign(category="all")])
    if not both.method.isin(LLAMACPP).any():
        return pd.DataFrame()
    ours = both[~both.method.isin(LLAMACPP) & ~both.method.str.startswith("hf_")]
    if ours.method.str.endswith("-untraced").any():
        ours = ours[ours.method.str.endswith("-untraced")]
    rows = []
    for cat, grp in both.groupby("category", sort=False):
        mine, peer = ours[ours.category == cat], grp[grp.method.isin(LLAMACPP)]
        if len(mine) and len(peer):
            a, b = mine.loc[mine.tokens_per_s.idxmax()], peer.loc[peer.tokens_per_s.idxmax()]
            rows.append({"category": cat, "speclab_best": a.method, "speclab_tokens_per_s": a.tokens_per_s,
                         "llamacpp_best": b.method, "llamacpp_tokens_per_s": b.tokens_per_s,
                         "ratio": speedup(a.tokens_per_s, b.tokens_per_s)})
    return pd.DataFrame(rows)


def precision_lines(config_json: str, overall: pd.DataFrame) -> list[str]:
    """The report's word on dtypes: which dtype each method ran in and why (the bench's `dtype_why`), and, where
    they differ, what the speedup and equality columns compare against."""
    import json
    why = json.loads(config_json or "{}").get("dtype_why") or {}
    dts = dict(zip(overall.method, overall.dtype))
    out = ["Precision: " + ", ".join(f"{m} {d}" for m, d in dts.items() if not m.endswith("-untraced")) + "."]
    out += [f"- {line}" for line in why.values()]
    if len({d for d in dts.values() if d}) > 1:
        out += ["", "The methods ran in more than one dtype: `speedup` is over the fastest AR of the bench (AR in "
                "each dtype a method ran in), equality with AR is against AR in the method's own dtype."]
    return out


def bench_report(store: TraceStore, bench_id: str) -> Report:
    """The bench's report: markdown tables (all categories, speclab vs Hugging Face, tracing overhead, outputs that
    differ from AR, per category, per-position acceptance) and figures; the command prints the pooled table and
    the peer comparison."""
    from speclab import viz
    table, overall, pos = bench_table(store, bench_id), bench_overall(store, bench_id), bench_positions(store, bench_id)
    bench = store.query("SELECT * FROM benches WHERE bench_id = ?", [bench_id]).iloc[0]
    peers = pd.DataFrame(peer_ratios(overall))
    fmt = dict(index=False, floatfmt=".3f")
    how = store.query("SELECT string_agg(DISTINCT dtype, '+') AS dtype, any_value(logits_dtype) AS logits, "
                      "any_value(exact) AS exact, any_value(cpu) AS cpu FROM runs WHERE bench_id = ?",
                      [bench_id]).iloc[0]
    md = [f"# speclab bench `{bench_id}`", "",
          (f"suite `{bench.suite}`, methods {bench.methods}, device {bench.device} ({how['cpu']}), "
           f"dtype {how['dtype']} (logits {how['logits']}{', exact mode' if how['exact'] else ''}); "
           f"config `{bench.config_json}`"), "", *precision_lines(bench.config_json, overall), "",
          ("Equality with AR (greedy): `equal_to_ar`, `near_tie` (differs where the target's top-2 logits are within "
           "rounding) and `bug` (differs otherwise) are shares of each method's outputs."), "",
          "## All categories", "", overall.to_markdown(**fmt), "",
          "tokens_per_s is over decode time (prefill + the run's own phases); model_call_share is the share of it "
          "spent inside target and drafter forwards (CPU only: a CUDA forward returns before its kernels end), "
          "the rest is the engine's own work; `-untraced` rows are the engine's fast path.", ""]
    summary = [*precision_lines(bench.config_json, overall), "", overall.to_markdown(**fmt)]
    if len(peers):
        md += ["## speclab vs Hugging Face (same target, draft, prompts; greedy)", "", peers.to_markdown(**fmt), ""]
        summary += ["", peers.to_markdown(**fmt)]
    lcpp = llamacpp_table(table, overall)
    if len(lcpp):
        cfg = json.loads(bench.config_json or "{}")
        peer = store.query("SELECT any_value(json_extract(params_json, '$.threads')) AS n, any_value(engine_version) "
                           "AS v, any_value(json_extract_string(params_json, '$.type')) AS t FROM runs WHERE "
                           "bench_id = ? AND engine = 'llama.cpp'", [bench_id]).iloc[0]
        text = ["## speclab vs llama.cpp (the same models in GGUF, prompts and token budget; greedy)", "",
                (f"llama.cpp: {peer.v}; {peer.n} threads, {peer.t} GGUF (speclab: {cfg.get('threads', '?')} torch "
                 "threads); speclab's methods untraced. `ratio`: speclab's fastest over llama.cpp's fastest, "
                 "tokens/s (above 1: speclab ahead)."), "", lcpp.to_markdown(**fmt), ""]
        md += text
        summary += ["", *text[2:]]
    if bench.trace_overhead == bench.trace_overhead and bench.trace_overhead is not None:
        md += [f"Tracing overhead: traced / untraced decode time, all methods and prompts = "
               f"**{bench.trace_overhead:.3f}**", ""]
    pairs = paired_gains(store, bench_id)
    if len(pairs):
        md += ["## Method against method, paired by prompt", "",
               ("Mean per-prompt gain of `method` over `against` (tau and tokens/s ratios minus 1) on the prompts both "
                "ran, with the half-width of its 95% confidence interval (Student's t): an interval that covers 0 "
                "is no measured difference."), "", pairs.to_markdown(**fmt), ""]
        summary += ["", "Paired by prompt (gain of method over against, 95% CI half-width):", pairs.to_markdown(**fmt)]
    workers = bench_workers(store, bench_id)
    if len(workers):
        wide = workers.pivot_table(index=["node", "worker", "prompts"], columns="method", values="speedup",
                                   aggfunc="first").reset_index()
        text = ["## Where it ran", "",
                (f"{bench.cluster}; {int(bench.retries or 0)} task(s) retried after a worker died. Every prompt's "
                 "runs, AR's included, ran on one worker: the speedups above compare each method with AR over the same "
                 "prompts, each prompt decoded by both on one worker. Absolute tokens/s are each worker's own and are "
                 "not compared across workers. Speedup over AR on each worker:"), "", wide.to_markdown(**fmt), ""]
        md += text
        summary += ["", *text[2:]]
    divs = bench_divergences(store, bench_id)
    if len(divs):
        md += ["## Outputs that differ from AR", "", "First differing token and the target's top-2 logit gap there "
               "(a near-tie is rounding; anything else is a bug until proven otherwise).", "",
               divs.to_markdown(index=False, floatfmt=".3g"), ""]
    md += [f"Peak RSS of the bench process: {bench.peak_rss_mb:.0f} MB", "", "## Per category", "",
           table.to_markdown(**fmt), "", "## Per-position acceptance", "", pos.to_markdown(**fmt), ""]
    figs = [viz.bench_bars(table, "speedup", "Speedup vs AR (tokens/s ratio, same bench)"),
            viz.bench_bars(table, "tau", "Acceptance length tau (tokens per target verification)"),
            viz.position_acceptance(pos)] + ([viz.paired_gains(pairs)] if len(pairs) else [])
    if overall.model_call_share.notna().any():
        figs.append(viz.bench_bars(overall.assign(category="all categories"), "model_call_share",
                                   "Share of decode time inside model forwards (target + drafter)"))
    return Report(f"speclab bench {bench_id}", "\n".join(md), figs, summary="\n".join(summary))
