"""Acceptance of a sampled EAGLE-3 draft against the drafter's own temperature, per depth (README "Sampling"):
on held-out windows of the target's sampled continuations (data/regen/sample, validation splits), the expected
acceptance alpha_d = sum min(p, q) of a token drawn from q at depth d (the training-time-test unroll, steps 1..3),
where p is the target's distribution at temperature T and q the drafter's at draft_temp * T. Then the per-depth
temperatures a left-to-right grid search picks (as DSpark's sequential temperature scaling fits its per-position
scalars, here maximising alpha_d instead of minimising calibration error). Usage:

    python scripts/draft_temperature.py [DRAFTER_DIR]      (default: the zoo's EAGLE-3)
"""
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from speclab.drafters.eagle3 import load_eagle3
from speclab.metrics import implied_tau
from speclab.train.corpus import DOMAINS
from speclab.train.eagle3 import target_features, ttt_forward
from speclab.train.lm import val_windows
from speclab.train.regenerate import load_token_data
from speclab.zoo import REPO_ROOT, default_target, model

TEMPS = (0.7, 1.0)
GRID = (0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25)
torch.set_num_threads(2)
tok = AutoTokenizer.from_pretrained(default_target())
target = AutoModelForCausalLM.from_pretrained(default_target(), dtype=torch.bfloat16).eval()
data = load_token_data(str(REPO_ROOT / "data" / "regen" / "sample"), tok)
path = sys.argv[1] if len(sys.argv) > 1 else model("eagle3")
m = load_eagle3(path).float().eval()
embed = target.get_input_embeddings()
alpha = {(T, t): [0.0, 0.0, 0.0] for T in TEMPS for t in GRID}
with torch.no_grad():
    for d in DOMAINS:
        ids = val_windows(data, d, 16, 256)
        feats, (logp, _) = target_features(target, ids, m.config.layer_ids)
        logits = ttt_forward(m, embed, ids, feats, 3)
        R = logp.shape[1] - 1
        for s, lg in enumerate(logits):
            n = R - s
            tl, dl = logp[:, 1 + s : 1 + s + n].float(), lg[:, :n].float()
            for T in TEMPS:
                p = torch.softmax(tl / T, -1)[..., m.t2d]  # the target's mass on the draft vocabulary
                for t in GRID:
                    q = torch.softmax(dl / (t * T), -1)
                    alpha[(T, t)][s] += float(torch.minimum(p, q).sum(-1).mean()) / len(DOMAINS)
print(f"drafter {path}; 16 windows x 256 tokens per domain of data/regen/sample (validation)\n")
print("| T | draft_temp | alpha d1 | alpha d2 | alpha d3 | chain tau (3 deep) |")
print("|---|---|---|---|---|---|")
for T in TEMPS:
    for t in GRID:
        a = alpha[(T, t)]
        print(f"| {T} | {t} | {a[0]:.3f} | {a[1]:.3f} | {a[2]:.3f} | {implied_tau(a):.3f} |")
print("\nper-depth temperatures (left to right, the best alpha at each depth):")
for T in TEMPS:
    best = [max(GRID, key=lambda t: alpha[(T, t)][s]) for s in range(3)]
    a = [alpha[(T, t)][s] for s, t in enumerate(best)]
    print(f"T={T}: draft_temp per depth {best}; alpha {[round(x, 3) for x in a]}; chain tau {implied_tau(a):.3f} "
          f"(one draft_temp 1.0: {implied_tau(alpha[(T, 1.0)]):.3f})")
