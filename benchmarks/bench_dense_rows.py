"""The dense bf16 products of a decode step alone, by row count: gguf_matmul's dense driver on
the bf16 rows (bf16_panels from 9 rows) against oneDNN's packed float32 copy (the float32
route's product, worker/layers/bf16_linear.py) and its packed bf16 weight, in interleaved
rounds; milliseconds per product (median and range over rounds) and GMAC/s of the median.
Shapes: bench_moe.py's Qwen3-MoE model (LM head 32000 x 1024, q/k/v 2560 x 1024, o 1024 x
2048); what bf16_linear.PANEL_FLOAT32_ROWS was set from.

    /work/locks/bench .venv/bin/python benchmarks/bench_dense_rows.py [--rows 32 64 128]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import ROOT  # noqa: F401  (ROOT puts the repository on sys.path)

from worker.layers import onednn_linear
from worker.native import gguf_ops

SHAPES = {"lm_head": (32000, 1024), "qkv": (2560, 1024), "o": (1024, 2048)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--bf16", action="store_true", help="also oneDNN's packed bf16 weight")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ops = gguf_ops.native()
    if ops is None:
        raise SystemExit("the GGUF library could not be built: no dense driver to time")
    kinds = ["dense", "float32"] + (["bf16"] if args.bf16 else [])
    print(f"{args.threads} threads, {args.rounds} interleaved rounds; ms per product: median "
          f"(range), GMAC/s of the median")
    for name, (n, k) in SHAPES.items():
        g = torch.Generator().manual_seed(0)
        w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
        packed = {"float32": onednn_linear.pack(w.float()), "bf16": onednn_linear.pack(w)}
        for m in args.rows:
            x = torch.randn(m, k, generator=g)
            run = {"dense": lambda: ops.dense_matmul(x, w),
                   "float32": lambda: onednn_linear.linear(x, packed["float32"]),
                   "bf16": lambda: onednn_linear.linear(x.bfloat16(), packed["bf16"])}
            reps = max(2, int(3e8 // (m * n * k)))
            times: dict[str, list[float]] = {kind: [] for kind in kinds}
            for _ in range(args.rounds):
                for kind in kinds:
                    run[kind]()
                    start = time.perf_counter()
                    for _ in range(reps):
                        run[kind]()
                    times[kind].append((time.perf_counter() - start) / reps)
            cells = []
            for kind in kinds:
                med = statistics.median(times[kind])
                cells.append(f"{kind} {med * 1e3:.3f} ({min(times[kind]) * 1e3:.3f}-"
                             f"{max(times[kind]) * 1e3:.3f}) {m * n * k / med / 1e9:.0f}")
            print(f"{name:8s} {m:4d} rows: " + "   ".join(cells))


if __name__ == "__main__":
    main()
