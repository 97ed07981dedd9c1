"""bf16 matmuls on this CPU: F.linear against the two packed products of `speclab.core.layers.linear` on the zoo's
shapes, at the row counts a decode uses: oneDNN's (a weight prepacked once into its layout) and, where this process
has one, `native.cpp`'s own product (`speclab::tile_linear` on AMX, `speclab::dp_linear` on AVX512-BF16 without
it); each checked bit for bit against F.linear. Prints a markdown table.

    python scripts/linear_bench.py [THREADS=2]
"""
import sys
import time

import torch
import torch.nn.functional as F

from speclab.core import layers, native
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
mod, kind = native.product_module(), native.product()
print(f"| weight | in x out | rows | F.linear (us) | oneDNN prepacked (us) | native: {kind or 'none'} (us) | "
      "bitwise F.linear |")
print("|---|---|---|---|---|---|---|")
with torch.inference_mode():
    for name, (i, o) in SHAPES.items():
        w = torch.randn(o, i).bfloat16()
        onednn = torch.ops.mkldnn._reorder_linear_weight(w, layers.PACK_ROWS)
        products = {"prepacked": lambda x, p=onednn: layers._PACKED_LINEAR(x, p, None, "none", [], "")}
        if mod is not None:
            packed = mod.native_pack(w)
            op = getattr(torch.ops.speclab, layers._NATIVE_OPS[packed.dim()])
            products["native"] = lambda x, p=packed, n=o, k=i, op=op: op(x, p, None, n, k)
        for rows in (1, 5, 16):
            x = torch.randn(rows, i).bfloat16()
            us = {k: f"{best_us(lambda f=f: f(x)):.0f}" for k, f in products.items()}  # noqa: B023 (called at once)
            same = all(torch.equal(f(x), F.linear(x, w)) for f in products.values())
            print(f"| {name} | {i} x {o} | {rows} | {best_us(lambda: F.linear(x, w)):.0f} | {us['prepacked']} | "  # noqa: B023
                  f"{us.get('native', '-')} | {same} |", flush=True)
