"""Decode attention bandwidth of the CuPy kernels against the device's own copy bandwidth.

Default case (issue 5): 64 sequences x 4096 context, 8 KV heads (32 query heads), head_dim
128, bf16, block size 16, physical blocks shuffled. Achieved bandwidth counts the bytes the
step must read (K and V of every context token, plus q and out); the reference is a 1 GiB
device-to-device copy measured in the same run, counted as bytes read + written. Target:
at least 80 % on H100/H200. Without a CUDA GPU the script says so and exits 0.
Run: python benchmarks/bench_attention_gpu.py [--seqs 64] [--context 4096] [--heads 32] ...
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

import torch
from _common import ROOT  # noqa: F401  (puts the repository on sys.path)

from worker.attention.cuda.cupy_backend import cuda_unavailable_reason
from worker.attention.metadata import AttentionMetadata

TARGET = 0.80


@dataclass
class Result:
    device: str
    kernel_us: float
    kernel_gbps: float
    copy_gbps: float
    ratio: float
    torch_us: float | None



def time_us(fn, iters: int) -> float:
    """Mean time of `fn` over `iters` calls after a warm-up, by CUDA events."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def copy_gbps(iters: int) -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / time_us(lambda: dst.copy_(src), iters) / 1e3


def decode_step(args: argparse.Namespace) -> tuple:
    """q/k/v of one decode token per sequence, the caches, and the step's metadata."""
    dtype, dev = getattr(torch, args.dtype), torch.device("cuda")
    per_seq = -(-args.context // args.block_size)
    shape = (args.seqs * per_seq + 1, args.block_size, args.kv_heads, args.head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=dev)
    v_cache = torch.randn(shape, dtype=dtype, device=dev)
    table = (torch.randperm(shape[0] - 1, device=dev) + 1).int().view(args.seqs, per_seq)
    pos = args.context - 1
    slots = table[:, pos // args.block_size].long() * args.block_size + pos % args.block_size
    metadata = AttentionMetadata(
        slot_mapping=slots, query_start_loc=torch.arange(args.seqs + 1, device=dev).int(),
        seq_lens=torch.full((args.seqs,), args.context, device=dev, dtype=torch.int32),
        block_table=table, max_query_len=1, max_seq_len=args.context,
        query_lens_cpu=[1] * args.seqs, seq_lens_cpu=[args.context] * args.seqs)
    q = torch.randn(args.seqs, args.heads, args.head_dim, dtype=dtype, device=dev)
    kv = torch.randn(2, args.seqs, args.kv_heads, args.head_dim, dtype=dtype, device=dev)
    return q, kv[0], kv[1], k_cache, v_cache, metadata


def measure(args: argparse.Namespace) -> Result:
    from worker.attention.cuda.cupy_backend import CupyAttentionBackend
    from worker.attention.torch_backend import TorchAttentionBackend
    q, k, v, k_cache, v_cache, metadata = decode_step(args)
    scale = args.head_dim ** -0.5
    backend = CupyAttentionBackend(torch.device("cuda"))
    backend.plan(metadata)
    kernel_us = time_us(lambda: backend.forward(q, k, v, k_cache, v_cache, metadata, scale),
                        args.iters)
    itemsize = q.element_size()
    moved = (args.seqs * args.context * 2 * args.kv_heads * args.head_dim
             + 2 * q.numel()) * itemsize
    torch_us = None
    if args.torch_baseline:
        ref = TorchAttentionBackend()
        ref.plan(metadata)
        torch_us = time_us(lambda: ref.forward(q, k, v, k_cache, v_cache, metadata, scale),
                           max(3, args.iters // 10))
    kernel_gbps, copy = moved / kernel_us / 1e3, copy_gbps(args.iters)
    return Result(torch.cuda.get_device_name(), kernel_us, kernel_gbps, copy,
                  kernel_gbps / copy, torch_us)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--torch-baseline", action="store_true", help="also time the torch backend")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if reason := cuda_unavailable_reason():
        print(f"bench_attention_gpu: skipped, {reason}")
        return 0
    result = measure(args)
    if args.json:
        print(json.dumps(asdict(result)))
        return 0
    print(f"{result.device}: decode {args.seqs} seqs x {args.context} ctx, {args.heads}/"
          f"{args.kv_heads} heads, d{args.head_dim}, {args.dtype}, bs {args.block_size}")
    print(f"  kernel {result.kernel_us:9.1f} us  {result.kernel_gbps:7.0f} GB/s")
    print(f"  copy                  {result.copy_gbps:7.0f} GB/s (1 GiB device-to-device)")
    print(f"  ratio {result.ratio:.1%} (target {TARGET:.0%} on H100/H200)")
    if result.torch_us is not None:
        print(f"  torch backend {result.torch_us:9.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
