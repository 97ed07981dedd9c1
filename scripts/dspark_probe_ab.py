"""DSpark's scheduler against an earlier version of it, paired with no speculation in one process: the zoo's 32
prompts of 128 tokens in a closed loop at each concurrency, the three policies taking turns each repeat (the DFlash
method of `speclab serve-bench`), throughput over no speculation per repeat. The earlier version is another checkout's
`speclab/serve/policies.py` (say a worktree of the commit before a change: `git worktree add /tmp/old HEAD~1`).

    python scripts/dspark_probe_ab.py /tmp/old/speclab/serve/policies.py 1,4,8,16,32 3
"""
import importlib.util
import sys

import numpy as np

from speclab.bench.run import format_prompt
from speclab.bench.suites import load_suite
from speclab.core.batch import Batch
from speclab.core.precision import cpu_label
from speclab.core.sampling import Sampling
from speclab.methods import method_params
from speclab.models import ModelPaths, load_models
from speclab.serve.load import closed_loop, drafters_for
from speclab.serve.policies import StepCost, build_policy

spec = importlib.util.spec_from_file_location("old_policies", sys.argv[1])
old = importlib.util.module_from_spec(spec)
sys.modules["old_policies"] = old
spec.loader.exec_module(old)
loads = [int(c) for c in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 4, 8, 16, 32]
repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 3

target, models = load_models(ModelPaths(), roles=("dflash",))
prompts = [format_prompt(target, r) for r in load_suite("zoo", limit=8)]
METHOD = "dflash:block_size=9"
params = method_params(METHOD, {}, target)
cost = StepCost.profile(target, make_drafters=drafters_for("fixed", METHOD, target, models, params))
print(cpu_label(), f"{len(prompts)} zoo prompts x 128 tokens, closed loop, {target.dtype}", flush=True)
keys = ["none", "dspark before", "dspark now"]
for conc in loads:
    tput: dict[str, list[float]] = {k: [] for k in keys}
    for rep in range(repeats):
        for k in keys[rep % 3:] + keys[:rep % 3]:  # the policies take turns: drift hits them alike
            name = "none" if k == "none" else "dspark:k=8"
            fields = {f: getattr(cost, f) for f in old.StepCost.__dataclass_fields__}  # what the old one has
            policy = (old.build_policy(name, old.StepCost(**fields)) if k == "dspark before"
                      else build_policy(name, StepCost(**vars(cost))))
            batch = Batch(target, drafters_for(name, METHOD, target, models, params), policy, Sampling(), max_batch=32)
            tput[k].append(closed_loop(batch, prompts, conc, 128).metrics["throughput_tok_s"])
    base = np.array(tput["none"])
    print(f"c={conc}: none {base.mean():.0f} tok/s; " + "; ".join(
        f"{k} {np.mean(tput[k]):.0f} ({np.mean(np.array(tput[k]) / base):.3f}x none, per repeat "
        + ", ".join(f"{x:.3f}" for x in np.array(tput[k]) / base) + ")" for k in keys[1:]), flush=True)
