"""bf16 matmuls on this CPU: F.linear against `speclab.core.layers.linear` (a weight prepacked once for oneDNN) on the
zoo's shapes, at the row counts a decode uses; every pair checked bit for bit. Prints a markdown table.

    python scripts/linear_bench.py [THREADS=2]
"""
import sys
import time

import torch
import torch.nn.functional as F

from speclab.core.layers import linear
from speclab.core.precision import cpu_info

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
SHAPES = {"target q/k/v (fused)": (512, 1024), "target o_proj": (512, 512), "target gate/up (fused)": (512, 3072),
          "target down": (1536, 512), "target LM head": (512, 8192), "EAGLE-3 q_proj (2 x d in)": (1024, 512),
          "EAGLE-3 LM head (4,096)": (512, 4096)}


def best_us(f, n=300, reps=5):
    for _ in range(30):
        f()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            f()
        out.append((time.perf_counter() - t) / n * 1e6)
    return min(out)


print(f"CPU: {cpu_info()[0]} (bf16 flags: {', '.join(cpu_info()[1]) or 'none'}), {torch.get_num_threads()} threads, "
      f"torch {torch.__version__}\n")
print("| weight | in x out | rows | F.linear (us) | prepacked (us) | speedup | bitwise equal |")
print("|---|---|---|---|---|---|---|")
with torch.inference_mode():
    for name, (i, o) in SHAPES.items():
        w = torch.randn(o, i).bfloat16()
        for rows in (1, 5, 16):
            x = torch.randn(rows, i).bfloat16()
            a, b = best_us(lambda: F.linear(x, w)), best_us(lambda: linear(x, w))  # noqa: B023 (called at once)
            print(f"| {name} | {i} x {o} | {rows} | {a:.0f} | {b:.0f} | {a / b:.2f}x | "
                  f"{torch.equal(F.linear(x, w), linear(x, w))} |", flush=True)
