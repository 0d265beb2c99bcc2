"""CPU linear layers: torch's F.linear on a dense weight against oneDNN with the weight packed
once (worker/layers/onednn_linear.py), same run, interleaved round by round.

Shapes are the projections of the demo model (hidden 256) and SmolLM2-135M (hidden 576,
vocab 49152) at decode (1, 32, 256 rows) and prefill (2048 rows) sizes.
Run: python benchmarks/bench_onednn_linear.py [--rows 1 32 256 2048] [--rounds 5]
     [--dtypes float32 bfloat16]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from _common import ROOT  # noqa: F401  (puts the repository on sys.path)

from worker.layers import onednn_linear

SHAPES = {"demo qkv": (256, 512), "demo gate_up": (256, 1408), "demo down": (704, 256),
          "demo lm_head": (256, 3072), "smollm2 gate_up": (576, 3072),
          "smollm2 down": (1536, 576), "smollm2 lm_head": (576, 49152)}


def seconds_per_call(fn, budget: float) -> float:
    fn()
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < budget:
        fn()
        calls += 1
    return elapsed / max(calls, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32, 256, 2048])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--budget", type=float, default=0.1, help="seconds per measurement")
    args = parser.parse_args()
    if not onednn_linear.enabled(torch.device("cpu")):
        raise SystemExit("oneDNN packing is unavailable here (or DELTASERVE_ONEDNN=0)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; medians of "
          f"{args.rounds} interleaved rounds, us per call")
    print(f"{'shape':18s} {'dtype':9s} {'rows':>5s} | {'F.linear':>10s} {'packed':>10s} | speedup")
    for dtype in (getattr(torch, d) for d in args.dtypes):
        for name, (k, n) in SHAPES.items():
            weight = torch.randn(n, k).to(dtype)
            packed = onednn_linear.pack(weight)
            for rows in args.rows:
                x = torch.randn(rows, k).to(dtype)
                dense, fast = [], []
                for _ in range(args.rounds):
                    dense.append(seconds_per_call(lambda: F.linear(x, weight), args.budget))
                    fast.append(seconds_per_call(lambda: onednn_linear.linear(x, packed),
                                                 args.budget))
                a, b = statistics.median(dense) * 1e6, statistics.median(fast) * 1e6
                print(f"{name:18s} {str(dtype)[6:]:9s} {rows:5d} | {a:10.0f} {b:10.0f} | "
                      f"{a / b:5.2f}x")


if __name__ == "__main__":
    main()
