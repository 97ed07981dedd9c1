"""A CUDA check without the trace (DuckDB does not fit the GPU machine's 64 MiB with the zoo: scripts/device_pack.sh):
the zoo target with sps, pld and EAGLE-3 (chain and tree) against AR on the zoo prompts, greedy in fp32 and bf16
(every output compared with AR's, token for token) and sampled at T = 0.7 and 1 in bf16; tau, tokens/s and the
speedup (geometric mean over prompts of AR's time / the method's, each decode timed between CUDA syncs). On a
machine without a GPU it runs on the CPU. Usage:

    python scripts/cuda_check.py [PROMPTS_PER_DOMAIN=8] [TOKENS=128] [OUT_JSON=cuda_check.json] [DTYPES=fp32,bf16]
"""
import json
import math
import sys
import time

import torch

from speclab.bench.suites import load_suite
from speclab.equality import first_divergence
from speclab.generate import encode_prompt, generate
from speclab.methods import parse_spec
from speclab.models import ModelPaths, load_models

LIMIT = int(sys.argv[1]) if len(sys.argv) > 1 else 8
TOK = int(sys.argv[2]) if len(sys.argv) > 2 else 128
OUT = sys.argv[3] if len(sys.argv) > 3 else "cuda_check.json"
DTYPES = sys.argv[4].split(",") if len(sys.argv) > 4 else ["fp32", "bf16"]
DEV = "cuda" if torch.cuda.is_available() else "cpu"
METHODS = ["ar", "sps", "pld", "eagle3", "eagle3:tree_topk=4+total_tokens=12"]
prompts = load_suite("zoo", limit=LIMIT)
rows = []


def run(target, models, spec, ids, temp, seed):
    name, params = parse_spec(spec)
    if DEV == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    r = generate(target, ids, name, models=models, max_new_tokens=TOK, temperature=temp, seed=seed, **params)
    if DEV == "cuda":
        torch.cuda.synchronize()
    return r, time.perf_counter() - t0


for dtype in DTYPES:
    target, models = load_models(ModelPaths(device=DEV, dtype=dtype), roles=("draft", "eagle3"))
    print("device", target.device, "dtype", target.dtype, torch.cuda.get_device_name() if DEV == "cuda" else "")
    enc = [encode_prompt(target, p["prompt"]) for p in prompts]
    for spec in METHODS:  # warm-up
        run(target, models, spec, enc[0], 0.0, 0)
    for temp in (0.0, 0.7, 1.0):
        if dtype == "fp32" and temp > 0:
            continue
        ar_out, ar_t = [], []
        for spec in METHODS:
            t_all, taus, same, div = [], [], 0, []
            for i, ids in enumerate(enc):
                r, secs = run(target, models, spec, ids, temp, i)
                s = r.summary()
                t_all.append(secs)
                taus.append(s["tau"])
                if spec == "ar":
                    ar_out.append(r.token_ids)
                    ar_t.append(secs)
                elif temp == 0:
                    if r.token_ids == ar_out[i]:
                        same += 1
                    else:
                        d = first_divergence(target, ids, ar_out[i], r.token_ids)
                        div.append({"prompt": i, **vars(d), "near_tie": d.near_tie} if d is not None else {"prompt": i})
            ratio = [a / b for a, b in zip(ar_t, t_all)]
            gm = math.exp(sum(math.log(x) for x in ratio) / len(ratio))
            row = {"dtype": dtype, "T": temp, "method": spec, "n": len(enc), "tau": sum(taus) / len(taus),
                   "tok_s": TOK * len(enc) / sum(t_all), "speedup_gm": gm, "same_as_ar": same if temp == 0 else None,
                   "near_tie": sum(bool(x.get("near_tie")) for x in div),
                   "bug": sum(not x.get("near_tie", True) for x in div),
                   "diverged": div}
            rows.append(row)
            print(json.dumps(row), flush=True)
with open(OUT, "w") as f:
    json.dump(rows, f, indent=1)
