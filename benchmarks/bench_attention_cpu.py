"""Decode attention on the CPU: the native kernel (`cpu` backend) against the torch backend,
measured in the same run, interleaved round by round.

A case is one layer of a decode step: every request has `context` cached tokens and one new
token (written into its slot, then attended), physical blocks shuffled. Time is per layer
call (the step's plan is built by the first call and reused, as in the engine). Bandwidth
counts the KV bytes the step must read: seq_len x 2 (K and V) x kv_heads x head_dim x dtype
size per request. A same-run memory copy (read + write) gives the machine's scale.
`--baseline REV` adds the kernel as of git revision REV (its worker/kernels sources, built
with today's flags into the kernel cache) as a third column, interleaved with the others.
Run: python benchmarks/bench_attention_cpu.py [--reqs 64 256] [--context 128 512] [--rounds 3]
     [--threads N] [--cpu-time] [--baseline REV]
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import pathlib
import statistics
import subprocess
import tarfile
import tempfile
import time

import torch
from _common import ROOT  # noqa: F401  (puts the repository on sys.path)

from worker.attention.cpu_backend import CpuAttentionBackend
from worker.attention.metadata import AttentionMetadata
from worker.attention.torch_backend import TorchAttentionBackend
from worker.native import build, cpu_attention, library

SHAPES = {"demo": (4, 2, 64), "smollm2": (9, 3, 64)}  # heads, kv_heads, head_dim
BLOCK_SIZE = 16


def decode_case(reqs: int, context: int, shape: tuple[int, int, int], dtype: torch.dtype,
                seed: int = 0) -> tuple:
    heads, kv_heads, dim = shape
    gen = torch.Generator().manual_seed(seed)
    seq = context + 1
    per_req = -(-seq // BLOCK_SIZE)
    num_blocks = reqs * per_req + 1
    cache_shape = (num_blocks, BLOCK_SIZE, kv_heads, dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    table = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(reqs, per_req).int()
    slots = table[:, context // BLOCK_SIZE].long() * BLOCK_SIZE + context % BLOCK_SIZE
    metadata = AttentionMetadata(
        slot_mapping=slots, query_start_loc=torch.arange(reqs + 1, dtype=torch.int32),
        seq_lens=torch.full((reqs,), seq, dtype=torch.int32), block_table=table,
        max_query_len=1, max_seq_len=seq, query_lens_cpu=[1] * reqs, seq_lens_cpu=[seq] * reqs)
    q = torch.randn(reqs, heads, dim, generator=gen).to(dtype)
    k = torch.randn(reqs, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(reqs, kv_heads, dim, generator=gen).to(dtype)
    kv_bytes = reqs * seq * 2 * kv_heads * dim * k_cache.element_size()
    return (q, k, v, k_cache, v_cache, metadata, dim ** -0.5), kv_bytes


def layer_call(backend, args: tuple):
    """A callable running one layer's attention; the plan is built by a first call (on this
    backend's own copy of the metadata)."""
    args = (*args[:5], dataclasses.replace(args[5]), args[6])
    backend.plan(args[5])
    backend.forward(*args)
    return lambda: backend.forward(*args)


def mean_us(fn, iters: int, clock=time.perf_counter) -> float:
    start = clock()
    for _ in range(iters):
        fn()
    return (clock() - start) / iters * 1e6


def copy_gbps() -> float:
    src = torch.randn(1 << 26)  # 256 MiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = min(mean_us(lambda: dst.copy_(src), 3) for _ in range(3)) / 1e6
    return 2 * src.numel() * 4 / seconds / 1e9


def baseline_kernel(rev: str):
    """The kernel entry point as of git revision `rev`: that revision's worker/kernels
    extracted into a temporary directory and built with today's flags (the entry point's
    arguments must be today's)."""
    tar = subprocess.run(["git", "-C", ROOT, "archive", rev, "worker/kernels"], check=True,
                         capture_output=True).stdout
    tmp = tempfile.mkdtemp(prefix="deltaserve-baseline-")
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        archive.extractall(tmp, filter="data")
    kernels = pathlib.Path(tmp) / "worker" / "kernels"
    text = '#include "cpu_paged_attention.cpp"\n'
    path = build.cached_library(text, sorted(kernels.iterdir()),
                                library.compile_flags(include_dir=kernels), library.cache_dir(),
                                f"baseline-{rev}")
    return library.entry_point(path, "cpu_paged_attention", cpu_attention.ARGTYPES)


def measure(case: tuple, rounds: int, budget_s: float, clock=time.perf_counter,
            baseline=None) -> dict[str, list[float]]:
    """Per-round mean microseconds per call of each backend, the backends interleaved (by
    `clock`: wall time, or process CPU time, which a busy shared host distorts less)."""
    calls = {"torch": layer_call(TorchAttentionBackend(), case),
             "cpu": layer_call(CpuAttentionBackend(), case)}
    if baseline is not None:
        calls["baseline"] = layer_call(CpuAttentionBackend(baseline, bf16_dot=False), case)
    iters = {name: max(2, int(budget_s * 1e6 / mean_us(fn, 1))) for name, fn in calls.items()}
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            samples[name].append(mean_us(fn, iters[name], clock))
    return samples


def summary(us: list[float], kv_bytes: int) -> str:
    med = statistics.median(us)
    return (f"{med:9.0f} us ({min(us):.0f}-{max(us):.0f}) "
            f"{kv_bytes / med / 1e3:6.1f} GB/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reqs", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--context", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget", type=float, default=0.15, help="seconds per measurement")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time by process CPU time instead of wall time")
    parser.add_argument("--baseline", metavar="REV",
                        help="also time the kernel as of this git revision")
    args = parser.parse_args()
    baseline = baseline_kernel(args.baseline) if args.baseline else None
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads; "
          f"memory copy {copy_gbps():.1f} GB/s (read + write)")
    print(f"decode, one layer per call; {'CPU' if args.cpu_time else 'wall'} time; medians of "
          f"{args.rounds} interleaved rounds (range)")
    print(f"{'shape':8} {'dtype':8} {'reqs':>4} {'ctx':>4} {'KV MB':>6} | "
          f"{'torch backend':>34} | {'cpu kernel':>34} | speedup"
          + (f" | {'cpu kernel @ ' + args.baseline:>34} | speedup" if baseline else ""))
    for shape in args.shapes:
        for dtype in args.dtypes:
            for reqs in args.reqs:
                for context in args.context:
                    case, kv_bytes = decode_case(reqs, context, SHAPES[shape],
                                                 getattr(torch, dtype))
                    s = measure(case, args.rounds, args.budget, clock, baseline)
                    cpu = statistics.median(s["cpu"])
                    line = (f"{shape:8} {dtype:8} {reqs:4} {context:4} {kv_bytes / 1e6:6.1f} | "
                            f"{summary(s['torch'], kv_bytes)} | {summary(s['cpu'], kv_bytes)} | "
                            f"{statistics.median(s['torch']) / cpu:5.1f}x")
                    if baseline:
                        line += (f" | {summary(s['baseline'], kv_bytes)} | "
                                 f"{statistics.median(s['baseline']) / cpu:5.1f}x")
                    print(line, flush=True)


if __name__ == "__main__":
    main()
