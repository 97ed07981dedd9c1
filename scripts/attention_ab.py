"""What the AMX dot products save `native.cpp`'s attention (`speclab::attention`, the call `layers.attend` makes for a
decode's few bf16 rows), paired in one process: the zoo target's shape (8 heads of 64 over 4 kv heads) at each rows x
keys, with the tiles and with the AVX512-BF16 path (`set_attn_tiles`), alternating in blocks of 200 calls; the best
median of four blocks each (us), and how many outputs differ between the two. The CPU is named.

    python scripts/attention_ab.py [ROWS] [KEYS] [THREADS]
    python scripts/attention_ab.py 1,2,5,9,20 300 2
"""
import sys
import time

import numpy as np
import torch

from speclab.core import native
from speclab.core.precision import cpu_label

rows = [int(r) for r in (sys.argv[1] if len(sys.argv) > 1 else "1,2,5,9,20").split(",")]
keys = [int(s) for s in (sys.argv[2] if len(sys.argv) > 2 else "300").split(",")]
torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 2)
mod = native.build()
if mod is None or native.attention_module() is None:
    sys.exit("no native attention in this process (no AVX512-BF16): nothing to compare")
if native.product() != "tiles":
    sys.exit("no AMX tiles in this process: the attention runs the AVX512-BF16 path only")
print(f"{cpu_label()}, {torch.get_num_threads()} threads; 8 heads of 64 over 4 kv heads; us a call")
print("| rows | keys | tiles_us | avx512_us | tiles / avx512 | outputs differing |")
print("|---:|---:|---:|---:|---:|---:|")
g = torch.Generator().manual_seed(0)
for S in keys:
    for n in rows:
        q = torch.randn(n, 8, 64, generator=g).bfloat16().transpose(0, 1)  # a rope output's layout
        k, v = torch.randn(2, 4, S, 64, generator=g).bfloat16()
        mask = None if n == 1 else torch.ones(n, S, dtype=torch.bool).tril(S - n)
        us: dict[bool, list[float]] = {True: [], False: []}
        outs = {}
        with torch.inference_mode():
            for rep in range(4):
                for tiles in ((True, False) if rep % 2 == 0 else (False, True)):
                    mod.set_attn_tiles(tiles)
                    outs[tiles] = torch.ops.speclab.attention(q, k, v, mask, 0.125)
                    ts = []
                    for _ in range(200):
                        t = time.perf_counter()
                        torch.ops.speclab.attention(q, k, v, mask, 0.125)
                        ts.append(time.perf_counter() - t)
                    us[tiles].append(float(np.median(ts)) * 1e6)
        mod.set_attn_tiles(True)
        diff = int((outs[True].view(torch.int16) != outs[False].view(torch.int16)).sum())
        t, a = min(us[True]), min(us[False])
        print(f"| {n} | {S} | {t:.1f} | {a:.1f} | {t / a:.2f} | {diff} of {outs[True].numel()} |", flush=True)
