"""Speculative-decoding metrics, each defined once, here (Spec-Bench definitions): in SQL over the trace, and as
Python functions for live figures (the CLI summary, the app's columns) where they use the same formula.

- tau (acceptance length): tokens committed per target verification round, bonus token included.
- acceptance rate: accepted draft tokens / drafted tokens (over rounds that drafted).
- per-position acceptance: P(the node at depth d on the accepted path exists | the tree reached depth d).
- tokens/s: new tokens / decode time. Decode time (`runs.elapsed_s`) is the run's own time: the prefill, every
  round's phases (route, catchup, draft, verify, commit, record) and the trace's final flush, never the time a
  consumer held the decode (the app interleaves runs); `runs.wall_s` keeps the wall time.
- speedup: tokens/s over AR's tokens/s measured in the same bench (same prompts, same process).
- model error (the round-cost model of `speclab.routing.replay` against live runs): modeled tokens/s / measured
  tokens/s - 1, so a positive error means the model promises more tokens/s than were measured.
- draft-time share: draft phase time / time of all phases.
- drafter ms per round: the drafter's own time (catch-up and draft phases) per verification round: the drafting
  cost that SpecBlock's Table 1 compares.
- model-call share: time inside model forwards (target and drafters) / decode time (exact on CPU).
- target calls: a run's target forwards, prefill included (`runs.target_calls`; live, `RoundEvent.run_calls`).
- target calls per token: target calls / new tokens.
- mean entropy: the target's next-token entropy (nats, softmax at T=1) averaged over committed tokens.
- implied tau (training-time validation, `implied_tau`): the tau a chain of S drafted steps would have, from each
  step's acceptance a_s on held-out rows: 1 + mean over rows of sum_s prod_{j<=s} a_j (a_j 1/0: the step's draft
  matches the target's token; or the per-step acceptance probabilities sum min(p, q) of one sampled draft,
  taken as independent steps). Every drafter training's validation reports it.
- equality with AR (greedy benches): each output is `equal` to the AR output of the same bench and prompt, differs
  at a `near-tie` (the target's top-2 logit gap at the first difference within `speclab.equality`'s tolerance:
  rounding), or differs otherwise: a `bug`. `equal_to_ar`, `near_tie` and `bug` are the shares of compared runs.

The same SQL is installed as views (`run_metrics`, `position_acceptance`) in every trace file, so the app's
SQL box and notebooks see exactly these definitions.
"""
from __future__ import annotations

import math

import numpy as np

# one line per metric a page shows (the app's tooltips): the definitions above, shortened
METRIC_HELP = {
    "tok/s": "tokens/s: new tokens per second of decode time (prefill, every round's phases, the trace's flush)",
    "tau": "tau, acceptance length: tokens committed per target verification round, bonus token included",
    "speedup": ("tokens/s over AR's in the same decode (same prompt, same process). Below 1x, drafting and the "
                "wider verification cost more time than the extra tokens per round save: see the time bar"),
    "acceptance": "acceptance rate: accepted draft tokens / drafted tokens",
    "rounds": "target verification rounds (one target forward each)",
    "target calls": "target forwards, prefill included: the run's count in the trace",
    "tokens": "new tokens committed",
    "switches": "rounds whose drafter differs from the previous round's",
    "EAGLE-3 rounds": "share of rounds the router gave to EAGLE-3",
    "drafted rounds": ("share of rounds the router gave a drafter; in the rest the target stepped alone (a route's "
                       "none arm, or a method standing down where drafting does not pay: its pays)"),
}

# where a run's decode time went, in four parts (the app's time bar): engine phases -> part
TIME_PARTS = {"draft": ("draft",), "verify": ("verify",), "catch-up": ("catchup",)}  # the rest is "other"


def time_split(phase_ms: dict, decode_ms: float, drafted: bool = True) -> dict[str, float]:
    """A run's decode time in ms as draft, verify, catch-up and other (prefill, routing, commit, tracing: the rest
    of the decode time), from its per-phase sums (`RoundEvent.timings_ms` summed; `rounds.t_*_ms` in SQL). A run
    that drafted nothing (`drafted` False: AR) has no draft or catch-up part: the engine's bookkeeping in those
    phases (no drafter to ask) is its other time."""
    parts = TIME_PARTS if drafted else {"verify": TIME_PARTS["verify"]}
    out = {part: sum(phase_ms.get(p, 0.0) for p in phases) for part, phases in parts.items()}
    out["other"] = max(0.0, decode_ms - sum(out.values()))
    return out


def tau(committed: int, rounds: int) -> float:
    """Tokens committed per verification round (SQL: `TAU_SQL`)."""
    return committed / rounds if rounds else math.nan


def acceptance_rate(accepted: int, drafted: int) -> float:
    """Accepted draft tokens over drafted tokens (SQL: the `acceptance_rate` of `RATIOS`); nan with no drafts."""
    return accepted / drafted if drafted else math.nan


def implied_tau(accept, rows=None) -> float:
    """The tau a chain of S drafted steps implies, bonus token included: 1 + the mean over rows of
    sum_{s=1..S} prod_{j<=s} a_j, i.e. 1 + the mean number of leading steps accepted.

    `accept` [..., S] (torch or numpy array; a list of S numbers is one row): a_j = 1 / 0 where step j's draft
    matched the target's token (greedy: the chain's leading matches), or step j's acceptance probability (sampled:
    1 + a_1 + a_1 a_2 + ..., the steps taken as independent). `rows` (bool, `accept`'s shape without S): the rows
    counted (default all). nan when there are no steps (nothing measured)."""
    if isinstance(accept, (list, tuple)):
        accept = np.asarray(accept, dtype=float)
    if accept.shape[-1] == 0:
        return math.nan
    lead = accept.cumprod(-1).sum(-1)
    if rows is not None:
        lead = lead[rows]
    return 1.0 + float(lead.mean())


def tokens_per_s(tokens: int, decode_s: float) -> float:
    """New tokens per second of decode time (SQL: `TOKENS_PER_S_SQL`)."""
    return tokens / decode_s if decode_s > 0 else math.nan


def drafter_ms_per_round(drafter_ms: float, rounds: int) -> float:
    """The drafter's own time (its catch-up and draft phases) per verification round (SQL: `DRAFTER_MS_SQL`)."""
    return drafter_ms / rounds if rounds else math.nan


def speedup(tokens_per_s: float, ar_tokens_per_s: float) -> float:
    """tokens/s over AR's tokens/s of the same bench (SQL: `SPEEDUP_SQL`); nan without an AR figure."""
    return tokens_per_s / ar_tokens_per_s if ar_tokens_per_s > 0 else math.nan


def model_error(modeled_tokens_per_s, measured_tokens_per_s):
    """How far the round-cost model is off, on tokens/s: modeled / measured - 1 (> 0: the model promises more
    tokens/s than were measured; < 0: fewer). Numbers (nan without a measured figure), or numpy arrays / pandas
    Series elementwise."""
    if isinstance(measured_tokens_per_s, (int, float)) and not measured_tokens_per_s > 0:
        return math.nan
    return modeled_tokens_per_s / measured_tokens_per_s - 1


TAU_SQL = "sum(committed) / nullif(sum(verifications), 0)"
TOKENS_PER_S_SQL = "sum(new_tokens) / nullif(sum(elapsed_s), 0)"
DRAFTER_MS_SQL = "sum(catchup_ms + draft_ms) / nullif(sum(verifications), 0)"
SPEEDUP_SQL = "tokens_per_s / nullif(ar_tokens_per_s, 0)"  # over a row with its tokens/s and AR's
# AR's runs: 'ar', or 'ar@bf16' and the like (AR pinned to a dtype: the same-dtype reference of a bench whose
# speculative methods run in another dtype than AR; `speclab.methods.split_dtype`)
AR_SQL = "regexp_full_match(method, 'ar(@[a-z0-9]+)?')"

# a run's output against the AR output of its bench, prompt and dtype: 'equal', 'near-tie', 'bug' (NULL: no AR to
# compare, or a sampled run: its tokens differ from AR's by design)
EQUALITY_SQL = """CASE WHEN ar.output_hash IS NULL OR r.output_hash IS NULL THEN NULL
            WHEN coalesce(TRY_CAST(json_extract_string(r.params_json, '$.temperature') AS DOUBLE), 0) > 0 THEN NULL
            WHEN r.output_hash = ar.output_hash THEN 'equal'
            WHEN r.top2_gap <= r.tie_tolerance THEN 'near-tie' ELSE 'bug' END"""

# per run: the sums every pooled metric is made of, then the ratios
RUN_SUMS_SQL = f"""
SELECT r.run_id, r.method, r.category, r.prompt_id, r.status, r.bench_id, r.dtype, r.output_hash, r.new_tokens,
       r.target_calls, r.arrival_s, r.first_token_s, r.done_s, r.node, r.worker,
       r.elapsed_s, r.model_ms, {EQUALITY_SQL} AS equality,
       count(x.round) + coalesce(any_value(z.steps), 0) AS verifications,
       coalesce(sum(x.committed), any_value(z.committed)) AS committed,
       coalesce(sum(x.n_accepted), any_value(z.accepted)) AS accepted,
       coalesce(sum(x.n_drafted), any_value(z.drafted)) AS drafted, sum(x.t_draft_ms) AS draft_ms,
       sum(x.t_catchup_ms) AS catchup_ms, sum(x.t_verify_ms) AS verify_ms,
       sum(x.t_route_ms + x.t_catchup_ms + x.t_draft_ms + x.t_verify_ms + x.t_commit_ms
           + coalesce(x.t_record_ms, 0)) AS phases_ms,
       any_value(e.entropy_sum) AS entropy_sum, any_value(e.n_tokens) AS n_tokens
FROM runs r LEFT JOIN rounds x USING (run_id) LEFT JOIN engine_totals z USING (run_id)
     LEFT JOIN (SELECT bench_id, prompt_id, dtype, any_value(output_hash) AS output_hash FROM runs
                WHERE {AR_SQL} AND bench_id IS NOT NULL GROUP BY ALL) ar
               ON ar.bench_id = r.bench_id AND ar.prompt_id = r.prompt_id AND ar.dtype IS NOT DISTINCT FROM r.dtype
     LEFT JOIN (SELECT run_id, sum(entropy) AS entropy_sum, count(*) AS n_tokens FROM tokens GROUP BY run_id) e
               USING (run_id)
GROUP BY ALL
"""

RATIOS = f"""
       {TOKENS_PER_S_SQL}   AS tokens_per_s,
       {TAU_SQL} AS tau,
       sum(accepted) / nullif(sum(drafted), 0)        AS acceptance_rate,
       sum(draft_ms) / nullif(sum(phases_ms), 0)      AS draft_time_share,
       {DRAFTER_MS_SQL} AS drafter_ms_per_round,
       sum(verify_ms) / nullif(sum(verifications), 0) AS verify_ms_per_round,
       sum(target_calls) / nullif(sum(new_tokens), 0) AS target_calls_per_token,
       sum(entropy_sum) / nullif(sum(n_tokens), 0)    AS mean_entropy,
       sum(model_ms) / nullif(1000 * sum(elapsed_s), 0) AS model_call_share,
       count(*) FILTER (WHERE equality = 'equal') / nullif(count(equality), 0)    AS equal_to_ar,
       count(*) FILTER (WHERE equality = 'near-tie') / nullif(count(equality), 0) AS near_tie,
       count(*) FILTER (WHERE equality = 'bug') / nullif(count(equality), 0)      AS bug"""

# a served request's inter-token latency: per round after its first, the time since its previous round per token the
# round committed (`SERVING_HELP`), from the rounds' commit times (NULL for single-stream runs)
ITL_SQL = """
SELECT run_id, median(itl) AS itl_p50_ms FROM (
    SELECT run_id, 1000 * (t_s - lag(t_s) OVER (PARTITION BY run_id ORDER BY round)) / committed AS itl
    FROM rounds WHERE t_s IS NOT NULL) WHERE itl IS NOT NULL GROUP BY run_id
"""

RUN_METRICS_SQL = f"""
SELECT run_id, any_value(method) AS method, any_value(category) AS category, any_value(prompt_id) AS prompt_id,
       any_value(status) AS status, any_value(bench_id) AS bench_id, sum(new_tokens) AS new_tokens,
       sum(verifications) AS rounds, sum(target_calls) AS target_calls, sum(elapsed_s) AS elapsed_s, {RATIOS},
       1000 * (any_value(first_token_s) - any_value(arrival_s)) AS ttft_ms,
       1000 * (any_value(done_s) - any_value(first_token_s)) / nullif(sum(new_tokens) - 1, 0) AS tpot_ms,
       any_value(itl_p50_ms) AS itl_p50_ms
FROM ({RUN_SUMS_SQL}) LEFT JOIN ({ITL_SQL}) USING (run_id) GROUP BY run_id
"""


# per bench, every ordered pair of speculative methods over the prompts both ran: the mean per-prompt gain of one
# over the other (tau and tokens/s ratios, minus 1) and its sample standard deviation, for a paired confidence
# interval (`paired_gains`). AR, the untraced fast path and the Hugging Face peers have no rounds to pair.
PAIRED_SQL = f"""
WITH m AS (SELECT bench_id, prompt_id, method, avg(tau) AS tau, avg(tokens_per_s) AS tokens_per_s
           FROM ({RUN_METRICS_SQL}) WHERE bench_id IS NOT NULL AND NOT {AR_SQL} AND tau IS NOT NULL
           GROUP BY ALL),
g AS (SELECT a.bench_id, a.method, b.method AS against, a.tau / b.tau - 1 AS tau_gain,
             a.tokens_per_s / nullif(b.tokens_per_s, 0) - 1 AS speed_gain
      FROM m a JOIN m b ON a.bench_id = b.bench_id AND a.prompt_id = b.prompt_id AND a.method <> b.method)
SELECT bench_id, method, against, count(*) AS prompts, avg(tau_gain) AS tau_gain, stddev_samp(tau_gain) AS tau_gain_sd,
       avg(speed_gain) AS speed_gain, stddev_samp(speed_gain) AS speed_gain_sd
FROM g GROUP BY ALL
"""

# Student's t, two-sided 95%: the 0.975 quantile for 1..30 degrees of freedom; above that the Cornish-Fisher
# expansion around the normal quantile (within 1e-4 of the exact value there)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with `df` degrees of freedom (nan below 1)."""
    if df < 1:
        return float("nan")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def ci95(sd: float, n: int) -> float:
    """Half-width of the 95% confidence interval of a mean of n paired differences with sample deviation sd."""
    return t975(n - 1) * sd / n**0.5 if n > 1 else float("nan")


def paired_gain(x, base) -> tuple[float, float]:
    """The mean per-prompt gain of figures `x` over `base` (one each per prompt, in the same order: ratio - 1) and
    its 95% half-width (`ci95`): `paired_gains`' definition over two arrays instead of a bench's runs."""
    import numpy as np
    g = np.asarray(x, float) / np.asarray(base, float) - 1
    return float(g.mean()), ci95(float(g.std(ddof=1)) if len(g) > 1 else 0.0, len(g))


def paired_gains(store, bench_id: str):
    """Each pair of a bench's speculative methods, one row per unordered pair (method before `against` in name
    order): prompts both ran, mean per-prompt tau and tokens/s gain of `method` over `against`, and the 95%
    confidence half-widths (`ci95`, paired by prompt: the prompts' own difficulty cancels)."""
    df = store.query(f"SELECT * FROM ({PAIRED_SQL}) WHERE bench_id = ? AND method < against ORDER BY method, against",
                     [bench_id])
    for k in ("tau_gain", "speed_gain"):
        df[f"{k}_ci95"] = [ci95(sd, n) for sd, n in zip(df[f"{k}_sd"], df.prompts)]
    return df.drop(columns=["bench_id", "tau_gain_sd", "speed_gain_sd"])


# per run and depth: the rounds whose draft reached the depth and those whose accepted path did; speclab's rounds
# from their draft nodes, an imported run's from its steps by (drafted, accepted) count (`engine_steps`; a step
# whose drafted count the engine does not give counts as reaching every depth up to the run's k: the engine's own
# survival convention, said in the run's conversions)
REACH_SQL = """
SELECT run_id, depth, count(DISTINCT round) AS reaching, count(DISTINCT CASE WHEN accepted THEN round END) AS accepted
FROM draft_nodes GROUP BY ALL
UNION ALL
SELECT run_id, depth, sum(steps) FILTER (WHERE drafted IS NULL OR drafted >= depth) AS reaching,
       coalesce(sum(steps) FILTER (WHERE accepted >= depth), 0) AS accepted
FROM (SELECT s.run_id, s.drafted, s.accepted, s.steps, unnest(range(1, z.max_draft + 1)) AS depth
      FROM engine_steps s JOIN engine_totals z USING (run_id))
GROUP BY ALL HAVING sum(steps) FILTER (WHERE drafted IS NULL OR drafted >= depth) > 0
"""


def position_acceptance_sql(by: str = "n.run_id", where: str = "") -> str:
    """Per-position acceptance per `by` group (a column of the per-run reach counts `n` or of runs `r`) and depth:
    the rounds (run, round) whose draft reached the depth, those whose accepted path did, and their ratio."""
    return f"""
SELECT {by}, n.depth, sum(n.reaching) AS rounds_reaching, sum(n.accepted) AS rounds_accepted,
       sum(n.accepted) / sum(n.reaching) AS acceptance
FROM ({REACH_SQL}) n JOIN runs r USING (run_id) {where}
GROUP BY ALL
"""


# per run: its rounds by how many draft tokens they drafted and accepted (the accept-length histogram: accepted
# counts bonus excluded, as the engines' histograms are); speclab's from `rounds`, an import's from `engine_steps`
ACCEPT_HISTOGRAM_SQL = """
SELECT run_id, n_drafted AS drafted, n_accepted AS accepted, count(*) AS steps FROM rounds GROUP BY ALL
UNION ALL
SELECT run_id, drafted, accepted, steps FROM engine_steps
"""


POSITION_ACCEPTANCE_SQL = position_acceptance_sql()

VIEWS = {"run_metrics": RUN_METRICS_SQL, "position_acceptance": POSITION_ACCEPTANCE_SQL,
         "accept_histogram": ACCEPT_HISTOGRAM_SQL}


def _in(run_ids) -> tuple[str, list]:
    if run_ids is None:
        return "", []
    run_ids = [int(r) for r in run_ids]
    return f"WHERE run_id IN ({', '.join('?' * len(run_ids))})", run_ids


def run_metrics(store, run_ids=None):
    where, params = _in(run_ids)
    return store.query(f"SELECT * FROM ({RUN_METRICS_SQL}) {where} ORDER BY run_id", params)


def position_acceptance(store, run_ids=None):
    where, params = _in(run_ids)
    return store.query(f"SELECT * FROM ({POSITION_ACCEPTANCE_SQL}) {where} ORDER BY run_id, depth", params)


def run_summary(store, run_ids=None, by: str = "method"):
    """Metrics pooled over runs per `by` columns ("method", "method,category", ...): sums first, then ratios."""
    cols = [c.strip() for c in by.split(",")]
    if not cols or any(c not in ("method", "category", "prompt_id", "bench_id") for c in cols):
        raise ValueError(f"cannot group by {by!r} (method, category, prompt_id, bench_id)")
    by = ", ".join(cols)
    where, params = _in(run_ids)
    return store.query(f"""
        SELECT {by}, count(*) AS runs, sum(new_tokens) AS tokens, {RATIOS}
        FROM ({RUN_SUMS_SQL}) {where} GROUP BY {by} ORDER BY {by}""", params)


def latency_quantiles(ms) -> dict[str, float]:
    """Mean, median (P50) and P95 of times in ms, one per call or round: the FlashHead thesis's latency columns."""
    import numpy as np
    return {"mean": float(np.mean(ms)), "p50": float(np.median(ms)), "p95": float(np.percentile(ms, 95))}


# ---- serving (batched decoding under load: `speclab serve-bench`), in the names vLLM and AIPerf use ----

SERVING_HELP = {
    "throughput_tok_s": "output tokens of every finished request / the wall time from the first arrival to the last "
                        "completion (vLLM's output token throughput)",
    "per_user_tok_s": "each request's output tokens per second after its first token, 1000 / TPOT, averaged over "
                      "requests (AIPerf's output token throughput per user)",
    "ttft_ms": "time to first token: arrival to the first committed token (queueing and prefill included)",
    "tpot_ms": "time per output token after the first: (completion - first token) / (output tokens - 1)",
    "itl_ms": "inter-token latency: the time between a request's consecutive rounds, per token committed in the "
              "later one (a round commits several tokens at once)",
}


def serving_metrics(dones, makespan_s: float) -> dict[str, float]:
    """Throughput, per-user tokens/s, TTFT, TPOT and ITL (P50 and P95) of finished requests (`speclab.core.batch.Done`:
    times in seconds on one clock), as `SERVING_HELP` defines them."""
    fin = [d for d in dones if d.stopped in ("eos", "max_new_tokens")]
    toks = sum(d.new_ids.numel() for d in fin)
    ttft = [1e3 * (d.first_s - d.arrival_s) for d in fin]
    tpot = [1e3 * (d.done_s - d.first_s) / (d.new_ids.numel() - 1) for d in fin if d.new_ids.numel() > 1]
    itl = [1e3 * (b - a) / n for d in fin for a, b, n in zip(d.round_s, d.round_s[1:], d.round_tokens[1:])]

    def q(xs, p):
        return float(np.percentile(xs, p)) if xs else math.nan
    return {"requests": len(fin), "output_tokens": toks, "throughput_tok_s": tokens_per_s(toks, makespan_s),
            "per_user_tok_s": float(np.mean([1e3 / t for t in tpot])) if tpot else math.nan,
            "ttft_p50_ms": q(ttft, 50), "ttft_p95_ms": q(ttft, 95), "tpot_p50_ms": q(tpot, 50),
            "tpot_p95_ms": q(tpot, 95), "itl_p50_ms": q(itl, 50), "itl_p95_ms": q(itl, 95)}


# ---- calibration of a predicted probability against outcomes (DSpark's confidence head) ----

def ece(prob, outcome, bins: int = 10) -> float:
    """Expected calibration error: over `bins` equal-width bins of the predicted probability, the outcome rate's gap
    to the mean prediction, weighted by the bin's share of the predictions."""
    p, y = np.asarray(prob, float), np.asarray(outcome, float)
    if p.size == 0:
        return math.nan
    idx = np.minimum((p * bins).astype(int), bins - 1)
    n = np.bincount(idx, minlength=bins)
    gap = np.abs(np.bincount(idx, y, bins) - np.bincount(idx, p, bins))
    return float(gap.sum() / p.size) if n.sum() else math.nan


def auroc(prob, outcome) -> float:
    """Area under the ROC curve: the chance that a random positive outcome got a higher prediction than a random
    negative one (ties count half); nan with only one kind of outcome."""
    from scipy.stats import rankdata
    p, y = np.asarray(prob, float), np.asarray(outcome, bool)
    pos, neg = int(y.sum()), int((~y).sum())
    if not pos or not neg:
        return math.nan
    r = rankdata(p)
    return float((r[y].sum() - pos * (pos + 1) / 2) / (pos * neg))


def brier(prob, outcome, axis: int | None = None):
    """Mean squared gap between the predicted probability and the 0/1 outcome (a float; with `axis`, an array of the
    means along it: many predictions of the same outcomes scored at once)."""
    p, y = np.asarray(prob, float), np.asarray(outcome, float)
    if not p.size:
        return math.nan
    return float(np.mean((p - y) ** 2)) if axis is None else np.mean((p - y) ** 2, axis=axis)
