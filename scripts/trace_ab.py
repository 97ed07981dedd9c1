"""What tracing costs a decode, paired in one process: each zoo prompt decoded traced (into a fresh trace file) and
untraced, alternating which goes first, twice; per method the mean per-prompt ratio of traced over untraced decode
time (`runs.elapsed_s`: prefill, the rounds' phases and, traced, the trace's final flush) with its 95% interval
(`metrics.paired_gain`), the record phase per round, and what a run spends outside its rounds beyond the prefill
(traced: the final flush). The CPU is named.

    python scripts/trace_ab.py [METHODS] [PROMPTS_PER_CATEGORY] [TEMPERATURE]
    python scripts/trace_ab.py ar,eagle3 2
"""
import sys
import tempfile
from collections import defaultdict

import numpy as np

from speclab.bench.run import format_prompt
from speclab.bench.suites import load_suite
from speclab.core.precision import cpu_label
from speclab.generate import generate
from speclab.metrics import paired_gain
from speclab.models import ModelPaths, load_models
from speclab.trace import TraceStore

methods = sys.argv[1].split(",") if len(sys.argv) > 1 else ["ar"]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 2
T = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
kw = {"temperature": T, "seed": 0} if T else {}

target, models = load_models(ModelPaths(), roles=("dflash", "eagle3", "draft"), log=lambda s: None)
rows = [format_prompt(target, r) for r in load_suite("zoo", n)]
store = TraceStore(tempfile.mkdtemp() + "/trace_ab.duckdb")
print(f"{cpu_label()}, {target.dtype}, T = {T}, {len(rows)} zoo prompts x 128 tokens, each traced and untraced twice",
      flush=True)
for m in methods:
    for trace in (store, None):  # warm: every path once
        generate(target, rows[0], m, models=models, max_new_tokens=32, trace=trace, **kw)
    secs, record, outside = defaultdict(list), defaultdict(list), defaultdict(list)
    for i, p in enumerate(rows):
        for rep in range(2):
            for traced in ((True, False) if (i + rep) % 2 == 0 else (False, True)):
                g = generate(target, p, m, models=models, max_new_tokens=128, trace=store if traced else None, **kw)
                secs[traced, i].append(g.elapsed_s)
                record[traced].append(g.decode.timings_ms["record"] / g.decode.rounds)
                outside[traced].append(g.elapsed_s * 1e3 - sum(g.decode.timings_ms.values()) - g.decode.prefill_ms)
    traced = [sum(secs[True, i]) for i in range(len(rows))]
    untraced = [sum(secs[False, i]) for i in range(len(rows))]
    gain, ci = paired_gain(traced, untraced)
    print(f"{m:>10}: traced over untraced decode time {1 + gain:.3f} (+-{ci:.3f}); record "
          f"{np.mean(record[True]):.3f} ms a round; outside the rounds beyond the prefill "
          f"{np.mean(outside[True]):.1f} ms a run traced, {np.mean(outside[False]):.1f} untraced", flush=True)
