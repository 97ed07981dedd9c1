"""Block against token-by-token verification of sampled chains (`speclab.core.verify.CHAIN_RULE`), in one process.

1. On the same rounds: every sampled chain a decode verifies (block verification decides the path), both rules'
   expected drafts kept computed exactly from that round's p, q and drafts (token: the sum of the cumulative
   products of min(1, p/q); block: the sum of i P(tau = i) from `verify.block_tests`). No sampling noise.
2. End to end: each zoo prompt decoded by each method under both rules (alternating which goes first), the same
   seed; tau and tokens/s (untraced), paired by prompt (`metrics.paired_gain`: mean per-prompt gain, 95% half-width).

The CPU is named.

    python scripts/chain_verify_ab.py [TEMPERATURE] [METHODS] [PROMPTS_PER_CATEGORY]
    python scripts/chain_verify_ab.py 1 sps,eagle3,dflash,confu,pld 8
"""
import sys

import numpy as np
import torch

from speclab.bench.run import format_prompt
from speclab.bench.suites import load_suite
from speclab.core import verify
from speclab.core.precision import cpu_label
from speclab.generate import generate
from speclab.metrics import paired_gain
from speclab.models import ModelPaths, load_models

T = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
methods = sys.argv[2].split(",") if len(sys.argv) > 2 else ["sps", "eagle3", "dflash"]
n = int(sys.argv[3]) if len(sys.argv) > 3 else 8

target, models = load_models(ModelPaths(), roles=("draft", "eagle3", "dflash", "confu", "specblock"),
                             log=lambda s: None)
prompts = [format_prompt(target, r) for r in load_suite("zoo", n)]
print(f"{cpu_label()}, {torch.get_num_threads()} threads, {target.dtype}; T = {T}, {len(prompts)} zoo prompts x 128 "
      "tokens, prompt i at seed 1000 + i")

verify_chain = verify._verify_sampled_chain
kept: list[tuple[int, float, float]] = []  # per verified chain: drafts, E[kept] token, E[kept] block


def both_rules(tree, target_probs, generator):
    n_draft = len(tree)
    if n_draft:
        x = tree.tokens.to(target_probs.device)
        q = tree.draft_dists[:n_draft].to(x.device) if tree.draft_dists is not None else None
        rows = torch.arange(n_draft)
        px = target_probs[rows, x].double()
        a = px if q is None else (px / q[rows, x].double().clamp(min=1e-30)).clamp(max=1)
        h, _ = verify.block_tests(target_probs, q, x)
        p_tau, rest = {}, 1.0
        for i in range(n_draft, 0, -1):
            p_tau[i], rest = rest * h[i - 1], rest * (1 - h[i - 1])
        kept.append((n_draft, float(a.cumprod(0).sum()), sum(i * v for i, v in p_tau.items())))
    return verify_chain(tree, target_probs, generator)


def decode(m, i, x):
    return generate(target, x, m, models=models, max_new_tokens=128, temperature=T, seed=1000 + i)


print("\n1. Expected drafts kept a round, both rules on the same rounds (the block rule's decodes)\n")
print("| method | chains verified | drafts a chain | E[kept] token | E[kept] block | block / token |")
print("|---|---|---|---|---|---|")
verify._verify_sampled_chain = both_rules
verify.CHAIN_RULE = "block"
for m in methods:
    kept.clear()
    for i, x in enumerate(prompts):
        decode(m, i, x)
    k = np.array(kept)
    print(f"| {m} | {len(k)} | {k[:, 0].mean():.2f} | {k[:, 1].mean():.3f} | {k[:, 2].mean():.3f} | "
          f"{k[:, 2].sum() / k[:, 1].sum():.3f} |", flush=True)
verify._verify_sampled_chain = verify_chain

print("\n2. Decoded both ways, paired by prompt (block over token: mean per-prompt gain, 95% half-width)\n")
print("| method | tau token | tau block | tau gain | tokens/s token | tokens/s block | tokens/s gain |")
print("|---|---|---|---|---|---|---|")
for m in methods:
    for rule in verify.CHAIN_RULES:  # warm
        verify.CHAIN_RULE = rule
        decode(m, 0, prompts[0])
    got: dict[str, list[tuple[float, float]]] = {rule: [] for rule in verify.CHAIN_RULES}
    for i, x in enumerate(prompts):
        for rule in verify.CHAIN_RULES[:: 1 if i % 2 == 0 else -1]:
            verify.CHAIN_RULE = rule
            r = decode(m, i, x)
            got[rule].append((len(r.token_ids) / r.decode.rounds, r.tokens_per_s))
    b, t = np.array(got["block"]), np.array(got["token"])
    (tg, tci), (sg, sci) = paired_gain(b[:, 0], t[:, 0]), paired_gain(b[:, 1], t[:, 1])
    print(f"| {m} | {t[:, 0].mean():.2f} | {b[:, 0].mean():.2f} | {tg:+.1%} +- {tci:.1%} | {t[:, 1].mean():.0f} | "
          f"{b[:, 1].mean():.0f} | {sg:+.1%} +- {sci:.1%} |", flush=True)
verify.CHAIN_RULE = "block"
