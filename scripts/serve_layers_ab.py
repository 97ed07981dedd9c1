"""What the raw-row layers (`native.cpp`'s `decode_layers` / `decode_layer_rows`, `set_fast_layers`) save a serving
step, paired in one process: closed loops of zoo prompts (2 x the concurrency of them, 64 tokens each) at each
concurrency under each policy (the zoo DFlash drafting), with and without, alternating which goes first; per
(policy, concurrency) the mean ratio of throughput with over without (`metrics.paired_gain`, 95% interval). The CPU
is named.

    python scripts/serve_layers_ab.py CONCURRENCIES [POLICIES] [REPEATS]
    python scripts/serve_layers_ab.py 1,4,8,16 "none;fixed:k=4" 3
"""
import sys

import numpy as np

from speclab.bench.run import format_prompt
from speclab.bench.suites import load_suite
from speclab.core import native
from speclab.core.batch import Batch
from speclab.core.precision import cpu_label
from speclab.core.sampling import Sampling
from speclab.metrics import paired_gain
from speclab.models import ModelPaths, load_models
from speclab.serve.load import closed_loop, drafters_for, warm_up
from speclab.serve.policies import build_policy

conc = [int(c) for c in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 4, 8]
policies = sys.argv[2].split(";") if len(sys.argv) > 2 else ["none", "fixed:k=4"]
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 3
mod = native.build()
if mod is None or native.attention_module() is None:
    sys.exit("no native layers with their attention in this process: nothing to compare")
target, models = load_models(ModelPaths(), roles=("dflash",), log=lambda s: None)
prompts = [format_prompt(target, r) for r in load_suite("zoo", 8)]
print(f"{cpu_label()}, {target.dtype}", flush=True)
sampling = Sampling()
for pol in policies:
    make = drafters_for(pol, "dflash", target, models, {})
    warm_up(target, make, prompts, sampling, max(conc))
    for c in conc:
        tp: dict[bool, list[float]] = {True: [], False: []}
        for r in range(reps):
            for fast in ((True, False) if r % 2 == 0 else (False, True)):
                mod.set_fast_layers(fast)
                batch = Batch(target, make, build_policy(pol), sampling, max_batch=c)
                tp[fast].append(closed_loop(batch, prompts[: 2 * c], c, 64).metrics["throughput_tok_s"])
        mod.set_fast_layers(True)
        gain, ci = paired_gain(tp[True], tp[False])
        print(f"{pol:>12} at {c:2d}: {np.mean(tp[True]):6.0f} tokens/s with, {np.mean(tp[False]):6.0f} without: "
              f"with / without {1 + gain:.3f} (+-{ci:.3f})", flush=True)
