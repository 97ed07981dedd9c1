"""What `native.cpp`'s `decode_layers` (a decode step's layers without ATen's small ops) saves a decode, paired in one
process: each zoo prompt decoded with it and with the loop it stands for (`set_fast_layers`), alternating which goes
first, twice; per method the mean per-prompt ratio of tokens/s with it over without (`metrics.paired_gain`, 95%
interval) and whether every output was the same. The CPU is named. First each model's call alone (the target and every
drafter model, at 1 and 8 rows after a 200-token cache), alternating in blocks of 40 calls (median over 16 pairs).

    python scripts/decode_layers_ab.py [METHODS] [PROMPTS_PER_CATEGORY] [TEMPERATURE]
    python scripts/decode_layers_ab.py ar,eagle3,sps,dflash,pld 2
"""
import sys
import time
from collections import defaultdict

import numpy as np
import torch

from speclab.bench.costs import drafter_calls
from speclab.bench.roofline import _call_ids
from speclab.bench.run import format_prompt
from speclab.bench.suites import load_suite
from speclab.core import native
from speclab.core.precision import cpu_label
from speclab.core.target import row_call
from speclab.generate import generate
from speclab.metrics import paired_gain
from speclab.models import ModelPaths, load_models

methods = sys.argv[1].split(",") if len(sys.argv) > 1 else ["ar"]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 2
T = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
kw = {"temperature": T, "seed": 0} if T else {}
mod = native.build()
if mod is None or native.attention_module() is None:
    sys.exit("no native layers with their attention in this process: nothing to compare")

target, models = load_models(ModelPaths(), roles=("dflash", "eagle3", "draft", "specblock", "confu"),
                             log=lambda s: None)
rows = [format_prompt(target, r) for r in load_suite("zoo", n)]
print(f"{cpu_label()}, {target.dtype}, {torch.get_num_threads()} threads", flush=True)

ids = _call_ids(target, 200, 8)
with torch.inference_mode():  # every model's call (`speclab costs roofline`'s callers) after a 200-token cache
    callers = {"target": row_call(target, ids, 200), **drafter_calls(target, models, ids, 200)}
    for name, call in callers.items():
        for r in (1, 8):
            if call(r) is False:  # no call of r rows (a DFlash block of 1)
                continue
            ratios, ms = [], defaultdict(list)
            for rep in range(16):
                pair = {}
                for fast in ((True, False) if rep % 2 else (False, True)):
                    mod.set_fast_layers(fast)
                    for k in range(45):
                        if k == 5:
                            t0 = time.perf_counter()
                        call(r)
                    pair[fast] = (time.perf_counter() - t0) / 40 * 1e3
                    ms[fast].append(pair[fast])
                ratios.append(pair[True] / pair[False])
            mod.set_fast_layers(True)
            print(f"{name:>10} call of {r} row(s): {np.median(ms[True]):.3f} ms with, {np.median(ms[False]):.3f} "
                  f"without; with / without {np.median(ratios):.3f} (median of 16 pairs)", flush=True)

print(f"T = {T}, {len(rows)} zoo prompts x 128 tokens, each decoded with and without twice", flush=True)
for m in methods:
    for fast in (True, False):  # warm: every path once
        mod.set_fast_layers(fast)
        generate(target, rows[0], m, models=models, max_new_tokens=32, **kw)
    speed, same = defaultdict(list), True
    for i, p in enumerate(rows):
        outs = {}
        for rep in range(2):
            for fast in ((True, False) if (i + rep) % 2 == 0 else (False, True)):
                mod.set_fast_layers(fast)
                g = generate(target, p, m, models=models, max_new_tokens=128, **kw)
                speed[fast, i].append(g.tokens_per_s)
                outs.setdefault(fast, g.token_ids)
        same &= outs[True] == outs[False]
    mod.set_fast_layers(True)
    with_ = [np.mean(speed[True, i]) for i in range(len(rows))]
    without = [np.mean(speed[False, i]) for i in range(len(rows))]
    gain, ci = paired_gain(with_, without)
    print(f"{m:>10}: tokens/s with over without {1 + gain:.3f} (+-{ci:.3f}); {np.mean(with_):.0f} against "
          f"{np.mean(without):.0f}; outputs {'the same' if same else 'DIFFERENT'}", flush=True)
