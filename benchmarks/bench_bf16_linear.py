"""oneDNN's packed bf16 linears against packed float32 ones (and float32 with the bf16 <-> float32
conversions a bf16 layer would add) on the demo model's projection shapes, by row count: where
float32 FMAs outrun bf16 products (worker/layers/bf16_linear.py). Best of 5, GMAC/s.
    /work/locks/bench .venv/bin/python benchmarks/bench_bf16_linear.py [threads]
"""
import sys
import time

import torch

from worker.layers import onednn_linear

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
shapes = [(512, 256), (1408, 256), (256, 704)]


def t(f, reps):
    f(); f()
    best = 1e9
    for _ in range(5):
        s = time.perf_counter()
        for _ in range(reps):
            f()
        best = min(best, (time.perf_counter() - s) / reps)
    return best


for m in (1, 8, 16, 32, 64, 256, 8192):
    for n, k in shapes:
        w = torch.randn(n, k).to(torch.bfloat16)
        wp, wf = onednn_linear.pack(w), onednn_linear.pack(w.float())
        xb = torch.randn(m, k).to(torch.bfloat16)
        xf = xb.float()
        reps = max(5, 200000 // m // 10)
        a = t(lambda: onednn_linear.linear(xb, wp), reps)
        b = t(lambda: onednn_linear.linear(xf, wf), reps)
        d = t(lambda: onednn_linear.linear(xb.float(), wf).to(torch.bfloat16), reps)
        g = m * n * k / 1e9
        print(f"M={m:5d} N={n:5d} K={k:4d}  bf16 {a*1e6:8.1f}us {g/a:6.1f}  f32 {g/b:6.1f}  "
              f"f32+conv {d*1e6:8.1f}us {g/d:6.1f} GMAC/s", flush=True)
