"""Builds of the CPU attention kernel against each other: each build's entry point loaded in one
process (ctypes), called round by round in turn, bf16 caches, with the vdpbf16ps units off
and/or on; max |diff| against the first variant and against a float64 reference.

A build is `work` (this tree's kernel), a git revision (its worker/kernels built with today's
flags, as bench_attention_cpu.py --baseline) or a path to a built library. Cases (2 threads):
  moe          decode, 32 rows, 16 q / 2 KV heads of dim 128, context 64..192, 8 layer caches
  one          decode, one row at context 2048, the same heads, 8 layers
  demo-dec, smollm2-dec   decode, 64 rows at context 512, heads 4/2 and 9/3 of dim 64, 4 layers
  demo-pre, smollm2-pre   prefill, 2 prompts of 512 tokens, 4 layers
  moe-pre      prefill, 32 prompts of 64 tokens, the moe heads, 2 layers
Blocks of 16, shuffled. Times are ms per set of layer calls, median [min..max] of the rounds.
Run: python benchmarks/bench_attention_builds.py [--case moe] [--dot 0|1|both] [--rounds 9]
     [--iters 10] BUILD [BUILD ...]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time

import numpy as np
import torch
from _common import ROOT  # noqa: F401  (puts the repository on sys.path)
from bench_attention_cpu import baseline_kernel

from worker.attention.cpu_backend import tile_work_items
from worker.native import cpu_attention

BLOCK = 16
HEADS = {"moe": (16, 2, 128), "one": (16, 2, 128), "demo": (4, 2, 64), "smollm2": (9, 3, 64)}
CASES = ["moe", "one", "demo-dec", "smollm2-dec", "demo-pre", "smollm2-pre", "moe-pre"]


def kernel(build: str):
    if build == "work":
        return cpu_attention.load()
    if os.path.exists(build):
        function = ctypes.CDLL(os.path.abspath(build)).cpu_paged_attention
        function.argtypes, function.restype = cpu_attention.ARGTYPES, ctypes.c_int
        return function
    return baseline_kernel(build)


class Case:
    """Inputs of one case: caches per layer, the step's rows, its work items."""

    def __init__(self, name: str) -> None:
        gen = torch.Generator().manual_seed(0)
        shape, _, kind = name.partition("-")
        self.heads, self.kv_heads, self.dim = HEADS[shape]
        self.layers = 8 if shape in ("moe", "one") else 4
        if name == "moe":
            ctx, ql = torch.randint(64, 193, (32,), generator=gen).tolist(), [1] * 32
        elif name == "one":
            ctx, ql = [2048], [1]
        elif kind == "dec":
            ctx, ql = [512] * 64, [1] * 64
        elif name == "moe-pre":
            ctx, ql, self.layers = [64] * 32, [64] * 32, 2
        else:
            ctx, ql = [512] * 2, [512] * 2
        self.ctx, self.ql, self.tokens = ctx, ql, sum(ql)
        per_req = [-(-c // BLOCK) for c in ctx]
        blocks = sum(per_req) + 1
        perm = torch.randperm(blocks - 1, generator=gen) + 1
        self.table = torch.zeros(len(ctx), max(per_req), dtype=torch.int32)
        o = 0
        for i, b in enumerate(per_req):
            self.table[i, :b] = perm[o:o + b].int()
            o += b
        cache = (blocks, BLOCK, self.kv_heads, self.dim)
        self.kc = [torch.randn(cache, generator=gen).bfloat16() for _ in range(self.layers)]
        self.vc = [torch.randn(cache, generator=gen).bfloat16() for _ in range(self.layers)]
        t, h, kvh, d = self.tokens, self.heads, self.kv_heads, self.dim
        self.q = torch.randn(t, h, d, generator=gen).bfloat16()
        self.k = torch.randn(t, kvh, d, generator=gen).bfloat16()
        self.v = torch.randn(t, kvh, d, generator=gen).bfloat16()
        self.slots = torch.tensor([int(self.table[i, p // BLOCK]) * BLOCK + p % BLOCK
                                   for i, c in enumerate(ctx) for p in range(c - ql[i], c)])
        self.qsl = torch.tensor([0, *np.cumsum(ql)], dtype=torch.int32)
        self.seq_lens = torch.tensor(ctx, dtype=torch.int32)
        self.items = torch.from_numpy(tile_work_items(ql, ctx, h // kvh)).contiguous()
        self.out = torch.empty(t, h, d, dtype=torch.bfloat16)

    def call(self, function, code: int, layer: int) -> None:
        h, kvh, d = self.heads, self.kv_heads, self.dim
        status = function(
            code, self.q.data_ptr(), h * d, self.k.data_ptr(), kvh * d, self.v.data_ptr(),
            kvh * d, self.kc[layer].data_ptr(), self.vc[layer].data_ptr(),
            self.slots.data_ptr(), self.tokens, self.qsl.data_ptr(), self.seq_lens.data_ptr(),
            self.table.data_ptr(), self.table.stride(0), self.items.data_ptr(),
            self.items.shape[0], self.out.data_ptr(), h, kvh, d, BLOCK, d ** -0.5, 2, 0)
        assert status == 0, status

    def reference(self, layer: int) -> torch.Tensor:
        """float64 attention of the last call (its caches, the step's K/V written)."""
        h, kvh, d = self.heads, self.kv_heads, self.dim
        ref = torch.empty(self.tokens, h, d, dtype=torch.float64)
        for i, c in enumerate(self.ctx):
            pos = torch.arange(c)
            rows = self.table[i, pos // BLOCK].long() * BLOCK + pos % BLOCK
            keys = self.kc[layer].view(-1, kvh, d)[rows].double().repeat_interleave(h // kvh, 1)
            vals = self.vc[layer].view(-1, kvh, d)[rows].double().repeat_interleave(h // kvh, 1)
            s = torch.einsum("qhd,khd->hqk", self.q[self.qsl[i]:self.qsl[i + 1]].double(),
                             keys) * d ** -0.5
            limit = torch.arange(self.ql[i])[:, None] + c - self.ql[i]
            s = s.masked_fill(pos[None, :] > limit, float("-inf"))
            ref[self.qsl[i]:self.qsl[i + 1]] = torch.einsum("hqk,khd->qhd", s.softmax(-1), vals)
        return ref


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("builds", nargs="+")
    parser.add_argument("--case", default="moe", choices=CASES)
    parser.add_argument("--dot", default="0", choices=["0", "1", "both"])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(2)
    functions = [kernel(b) for b in args.builds]
    case = Case(args.case)
    dots = {"both": [0, 1], "0": [0], "1": [1]}[args.dot]
    variants = [(i, d) for i in range(len(functions)) for d in dots]
    times: dict[tuple[int, int], list[float]] = {v: [] for v in variants}
    outs = {}
    for r in range(args.rounds + 1):  # round 0 warms up
        for i, dot in variants:
            code = 1 | (cpu_attention.BF16_DOT if dot else 0)
            start = time.perf_counter()
            for _ in range(args.iters):
                for layer in range(case.layers):
                    case.call(functions[i], code, layer)
            if r:
                times[i, dot].append((time.perf_counter() - start) / args.iters * 1e3)
            outs[i, dot] = case.out.double()
    ref = case.reference(case.layers - 1)
    print(f"{args.case}: heads {case.heads}/{case.kv_heads} of {case.dim}, {len(case.ctx)} "
          f"requests, {case.tokens} tokens, mean context {sum(case.ctx) / len(case.ctx):.1f}; "
          f"ms per {case.layers} layer calls, median [min..max] of {args.rounds} rounds")
    for i, dot in variants:
        x = times[i, dot]
        first = (outs[i, dot] - outs[variants[0]]).abs().max().item()
        print(f"  {args.builds[i]:>12} dot={dot}: {statistics.median(x):8.3f} "
              f"[{min(x):.3f}..{max(x):.3f}]  |diff| vs first {first:.2e}, "
              f"vs float64 {(outs[i, dot] - ref).abs().max().item():.2e}", flush=True)


if __name__ == "__main__":
    main()
