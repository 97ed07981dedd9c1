"""EAGLE-3 drafters on held-out windows of both kinds of regenerated text (README "Training the drafters"): the
greedy tau a chain as deep as the training unroll implies on greedy continuations, and the sampled tau that
sum(min(p, q)) per step implies on sampled ones. Usage:

    python scripts/eagle3_on_regenerated.py DRAFTER_DIR [DRAFTER_DIR ...]

Validation windows: 16 per domain, spread over data/regen/{greedy,sample} validation splits; bf16 target.
"""
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from speclab.drafters.eagle3 import load_eagle3
from speclab.train.eagle3 import Eagle3TrainConfig, evaluate
from speclab.train.regenerate import load_token_data
from speclab.zoo import REPO_ROOT, default_target

torch.set_num_threads(2)
tok = AutoTokenizer.from_pretrained(default_target())
target = AutoModelForCausalLM.from_pretrained(default_target(), dtype=torch.bfloat16).eval()
data = {m: load_token_data(str(REPO_ROOT / "data" / "regen" / m), tok) for m in ("greedy", "sample")}
cfg = Eagle3TrainConfig(target_dir="", corpus_dir="", out_dir="", precision="bf16", eval_windows=16)
print("| drafter | greedy text: implied greedy tau | sampled text: implied sampled tau | sampled text: alpha step 0 |")
print("|---|---|---|---|")
for path in sys.argv[1:]:
    m = load_eagle3(path).float()
    g = evaluate(m, target.get_input_embeddings(), target, data["greedy"], cfg)
    s = evaluate(m, target.get_input_embeddings(), target, data["sample"], cfg)
    mean = lambda res, f: sum(f(v) for v in res.values()) / len(res)  # noqa: E731
    print(f"| {path} | {mean(g, lambda v: v['tau']):.3f} | {mean(s, lambda v: v['tau_sampled']):.3f} | "
          f"{mean(s, lambda v: v['alpha'][0]):.3f} |", flush=True)
