"""A CUDA check without the trace (DuckDB does not fit the GPU machine's 64 MiB with the zoo: scripts/device_pack.sh).

Greedy first (fp32, then bf16), then serving, then sampled, so a run cut by its budget keeps the equality checks.

1. Single stream: the zoo target with every method whose models travel (sps, pld, EAGLE-3 chain and tree, DFlash
   with and without its Markov head, WhiFlash's two routers, routing v2) against AR on the zoo prompts, greedy in
   fp32 and bf16 (every output compared with AR's, token for token; a difference is classified as a near-tie or a
   bug by `first_divergence`) and sampled at T = 0.7 and 1 in bf16; tau, tokens/s and the speedup (geometric mean
   over prompts of AR's time / the method's, each decode timed between CUDA syncs).
2. Batched serving (`speclab.core.batch`, bf16, greedy, closed loop): each policy at concurrency 1, 4 and 16, every
   request's output against its single-stream AR decode, throughput against no speculation.

On a machine without a GPU it runs on the CPU. Usage:

    python scripts/cuda_check.py [PROMPTS_PER_DOMAIN=4] [TOKENS=128] [OUT_JSON=cuda_check.json] [DTYPES=fp32,bf16]
                                 [BUDGET_S=420]

Every row is printed as one JSON line as it is made, and the file is rewritten after each, so a run stopped at its
budget keeps what it measured; a part that fails prints its traceback and the check goes on.
"""
import json
import math
import sys
import time
import traceback

import torch

from speclab.bench.suites import load_suite
from speclab.equality import first_divergence, kind_of
from speclab.generate import encode_prompt, generate
from speclab.methods import parse_spec
from speclab.models import ModelPaths, load_models

LIMIT = int(sys.argv[1]) if len(sys.argv) > 1 else 4
TOK = int(sys.argv[2]) if len(sys.argv) > 2 else 128
OUT = sys.argv[3] if len(sys.argv) > 3 else "cuda_check.json"
DTYPES = sys.argv[4].split(",") if len(sys.argv) > 4 else ["fp32", "bf16"]
BUDGET_S = float(sys.argv[5]) if len(sys.argv) > 5 else 420.0
DEV = "cuda" if torch.cuda.is_available() else "cpu"
METHODS = ["ar", "sps", "pld", "eagle3", "eagle3:tree_topk=4+total_tokens=12", "dflash", "dflash:markov=0",
           "whiflash-entropy", "whiflash-neural", "route"]
ROLES = ("draft", "eagle3", "dflash", "router")
SERVE_METHOD = "dflash:block_size=9"
SERVE_POLICIES = ("none", "fixed:k=2", "fixed:k=4", "dspark:k=8")
T0 = time.perf_counter()
prompts = load_suite("zoo", limit=LIMIT)
rows: list[dict] = []


def emit(row: dict) -> None:
    row["elapsed_s"] = round(time.perf_counter() - T0, 1)
    rows.append(row)
    print(json.dumps(row, default=str), flush=True)
    with open(OUT, "w") as f:
        json.dump(rows, f, indent=1, default=str)


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def run(target, models, spec, ids, temp, seed):
    name, params = parse_spec(spec)
    sync()
    t0 = time.perf_counter()
    r = generate(target, ids, name, models=models, max_new_tokens=TOK, temperature=temp, seed=seed, **params)
    sync()
    return r, time.perf_counter() - t0


def single_stream(dtype: str, temps: tuple, loaded=None):
    if loaded is None:
        target, models = load_models(ModelPaths(device=DEV, dtype=dtype), roles=ROLES)
        print("device", target.device, "dtype", target.dtype, torch.cuda.get_device_name() if DEV == "cuda" else "",
              flush=True)
        enc = [encode_prompt(target, p["prompt"]) for p in prompts]
        for spec in METHODS:  # warm-up (Triton's compiles, cuBLAS's plans)
            try:
                run(target, models, spec, enc[0], 0.0, 0)
            except Exception:
                traceback.print_exc()
                emit({"dtype": dtype, "method": spec, "error": traceback.format_exc(limit=3)[-600:]})
    else:
        target, models, enc = loaded
    ar_out: dict[float, list] = {}
    for temp in temps:
        if dtype == "fp32" and temp > 0:
            continue
        ar_t: list[float] = []
        for spec in METHODS:
            if time.perf_counter() - T0 > BUDGET_S:
                emit({"dtype": dtype, "T": temp, "method": spec, "skipped": "budget"})
                continue
            try:
                t_all, taus, kinds, div = [], [], [], []
                for i, ids in enumerate(enc):
                    r, secs = run(target, models, spec, ids, temp, i)
                    t_all.append(secs)
                    taus.append(r.summary()["tau"])
                    if spec == "ar":
                        ar_out.setdefault(temp, []).append(r.token_ids)
                        ar_t.append(secs)
                    elif temp == 0:
                        d = first_divergence(target, ids, ar_out[0.0][i], r.token_ids)
                        kinds.append(kind_of(d))
                        if d is not None:
                            div.append({"prompt": i, "kind": d.kind})
                gm = math.exp(sum(math.log(a / b) for a, b in zip(ar_t, t_all)) / len(t_all))
                emit({"dtype": dtype, "T": temp, "method": spec, "n": len(enc), "tau": sum(taus) / len(taus),
                      "tok_s": TOK * len(enc) / sum(t_all), "speedup_gm": gm,
                      **({k.replace("-", "_"): kinds.count(k) for k in ("equal", "near-tie", "bug")}
                         if temp == 0 and spec != "ar" else {}), "diverged": div})
            except Exception:
                traceback.print_exc()
                emit({"dtype": dtype, "T": temp, "method": spec, "error": traceback.format_exc(limit=3)[-600:]})
    return target, models, enc, ar_out.get(0.0)


def serving(target, models, enc, reference):
    from speclab.core.batch import Batch
    from speclab.core.sampling import Sampling
    from speclab.methods import method_params
    from speclab.serve.load import closed_loop, drafters_for
    from speclab.serve.policies import StepCost, build_policy, needs_cost

    params = method_params(SERVE_METHOD, {}, target)
    cost = StepCost.profile(target, make_drafters=drafters_for("fixed", SERVE_METHOD, target, models, params)) \
        if any(needs_cost(p) for p in SERVE_POLICIES) else None
    none_tput: dict[int, float] = {}
    for conc in (1, 4, 16):
        for spec in SERVE_POLICIES:
            if time.perf_counter() - T0 > BUDGET_S:
                emit({"serve": spec, "concurrency": conc, "skipped": "budget"})
                continue
            try:
                policy = build_policy(spec, StepCost(**vars(cost)) if cost is not None else None)
                batch = Batch(target, drafters_for(spec, SERVE_METHOD, target, models, params), policy,
                              Sampling(temperature=0.0, seed=0), max_batch=32)
                served = closed_loop(batch, enc, conc, TOK)
                m = served.metrics
                kinds = [kind_of(first_divergence(target, ids, ref, d.new_ids.tolist()))
                         for d, ref, ids in zip(served.dones, reference, enc)]
                tput = m.get("throughput_tok_s", float("nan"))
                if spec == "none":
                    none_tput[conc] = tput
                emit({"serve": spec, "method": SERVE_METHOD, "concurrency": conc, "throughput_tok_s": tput,
                      "vs_none": tput / none_tput[conc] if conc in none_tput else None,
                      **{k.replace("-", "_"): kinds.count(k) for k in ("equal", "near-tie", "bug")},
                      "steps": len(served.steps),
                      "drafter_calls_per_step": sum(s.drafter_calls for s in served.steps) / max(1, len(served.steps)),
                      "target_calls_per_step": sum(s.target_calls for s in served.steps) / max(1, len(served.steps))})
            except Exception:
                traceback.print_exc()
                emit({"serve": spec, "concurrency": conc, "error": traceback.format_exc(limit=3)[-600:]})


for dtype in DTYPES:  # greedy first, then serving, then sampled: a run cut by its budget keeps the equality checks
    try:
        target, models, enc, reference = single_stream(dtype, (0.0,))
        if dtype == "bf16":
            serving(target, models, enc, reference)
            single_stream(dtype, (0.7, 1.0), (target, models, enc))
    except Exception:
        traceback.print_exc()
        emit({"dtype": dtype, "error": traceback.format_exc(limit=4)[-800:]})
print(f"done in {time.perf_counter() - T0:.0f} s", flush=True)
