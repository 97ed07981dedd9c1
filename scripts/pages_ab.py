"""Weights on 2 MB pages against 4 KB pages (`speclab.core.pages`), paired in one process: two copies of the zoo's
models, one packed with huge pages off and one with them on; each zoo prompt decoded by both, alternating, the faster
of two each; per method the geometric mean of tokens/s on 2 MB pages over 4 KB pages with its 95% interval
(`metrics.ci95` of the log ratios), and the CPU named.

    python scripts/pages_ab.py [TEMPERATURE] [METHODS] [PROMPTS_PER_CATEGORY] [DTYPE]
    python scripts/pages_ab.py 0.7 ar,eagle3,sps 8
    python scripts/pages_ab.py 0 ar,eagle3,dflash,pld 4 fp32
"""
import sys

import numpy as np

from speclab.bench.run import format_prompt
from speclab.bench.suites import load_suite
from speclab.core import pages
from speclab.core.precision import cpu_label
from speclab.generate import generate
from speclab.metrics import ci95
from speclab.models import ModelPaths, load_models

T = float(sys.argv[1]) if len(sys.argv) > 1 else 0.7
methods = sys.argv[2].split(",") if len(sys.argv) > 2 else ["ar", "eagle3"]
n = int(sys.argv[3]) if len(sys.argv) > 3 else 4
dtype = sys.argv[4] if len(sys.argv) > 4 else "auto"
if not pages.ENABLED:
    sys.exit(f"huge pages are off here ({pages.THP}: {pages._thp_mode() or 'absent'}, or SPECLAB_HUGEPAGES=0)")

sets = {}
for on in (False, True):  # the packed copies are made on first use, so each set decodes once while `on` holds
    pages.ENABLED = on
    target, models = load_models(ModelPaths(dtype=dtype), roles=("dflash", "eagle3", "draft"), log=lambda s: None)
    rows = [format_prompt(target, r) for r in load_suite("zoo", n)]
    for m in methods:
        generate(target, rows[0], m, models=models, max_new_tokens=32, temperature=T, seed=0)
    sets[on] = (target, models)
print(f"{cpu_label()}, {sets[True][0].dtype}, T = {T}, {len(rows)} zoo prompts x 128 tokens", flush=True)
for m in methods:
    ratios = []
    for i, p in enumerate(rows):
        best: dict = {}
        for rep in range(2):
            for on in ((True, False) if (i + rep) % 2 == 0 else (False, True)):
                target, models = sets[on]
                g = generate(target, p, m, models=models, max_new_tokens=128, temperature=T, seed=i)
                best[on] = max(best.get(on, 0.0), g.tokens_per_s)
        ratios.append(best[True] / best[False])
    r = np.log(ratios)
    h = ci95(float(r.std(ddof=1)), len(r))
    print(f"{m}: 2 MB / 4 KB pages {np.exp(r.mean()):.3f}x [{np.exp(r.mean() - h):.3f}-{np.exp(r.mean() + h):.3f}], "
          f"{len(r)} prompts", flush=True)
