"""GGUF matmul kernels (worker/native/gguf_ops.py) against torch float32 on the dequantized
weights packed for oneDNN (worker/layers/onednn_linear.py), measured in the same run,
interleaved round by round.

Cases: SmolLM2-135M's projections (Q4_1; the tied embedding / LM head Q8_0) at 1, 8, 32 and
256 rows. Weights are valid random blocks, or the real tensors with --gguf. "hot" calls reuse
one weight (it stays in cache, as the small ones would between layers of a batch); at one
row a "cold" column also cycles through copies of the weights larger than the last-level
cache, as a decode step streams the whole model from memory, and reports GB/s of weight
bytes read against a same-run memory copy (read + write). A last table gives the measured
error of both against float64 on the same dequantized weights, in units of u·Σ|x·w|
(u = 2^-24; float32 summation of K products is bounded by K of those units).
Run: python benchmarks/bench_gguf_matmul.py [--rows 1 8 32 256] [--rounds 5] [--threads N]
     [--budget 0.1] [--cold-mib 256] [--gguf PATH] [--cpu-time]
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from _common import ROOT  # noqa: F401  (puts the repository on sys.path)

from worker.layers import onednn_linear
from worker.native import gguf_ops

# name: (GGML type, N, K, a tensor of the SmolLM2 file with that shape)
SHAPES = {"q/o": ("Q4_1", 576, 576, "blk.0.attn_q.weight"),
          "k/v": ("Q4_1", 192, 576, "blk.0.attn_k.weight"),
          "gate/up": ("Q4_1", 1536, 576, "blk.0.ffn_gate.weight"),
          "down": ("Q4_1", 576, 1536, "blk.0.ffn_down.weight"),
          "lm_head": ("Q8_0", 49152, 576, "token_embd.weight")}
ERROR_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
U = 2.0 ** -24


def per_call_us(fn: Callable[[], object], budget: float, clock=time.perf_counter) -> float:
    fn()
    calls, start = 0, clock()
    while (elapsed := clock() - start) < budget or calls < 3:
        fn()
        calls += 1
    return elapsed / calls * 1e6


def copy_gbps() -> float:
    src = torch.randn(1 << 26)  # 256 MiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = min(per_call_us(lambda: dst.copy_(src), 0.3) for _ in range(3)) / 1e6
    return 2 * src.numel() * 4 / seconds / 1e9


def weights(shape: str, path: str | None) -> torch.Tensor:
    qtype, n, k, tensor = SHAPES[shape]
    if path is None:
        return gguf_ops.random_blocks(qtype, n, k, torch.Generator().manual_seed(n + k))
    import gguf

    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == tensor)
    assert t.tensor_type.name == qtype and tuple(int(d) for d in t.shape) == (k, n)
    return torch.from_numpy(t.data.copy()).view(n, -1)


def cycling(make: Callable[[], torch.Tensor], nbytes: int, cold_bytes: int) -> Callable:
    """next() over enough copies of a weight to exceed `cold_bytes` in all."""
    copies = [make() for _ in range(max(1, -(-cold_bytes // nbytes)))]
    state = {"i": 0}

    def take() -> torch.Tensor:
        state["i"] = (state["i"] + 1) % len(copies)
        return copies[state["i"]]
    return take


def columns(qtype: str, n: int, k: int, w: torch.Tensor, dense: torch.Tensor, rows: int,
            cold_bytes: int) -> dict[str, Callable]:
    """The timed calls of one case: hot, and at one row also cold (see the docstring)."""
    x = torch.randn(rows, k)
    calls = {"gguf": lambda: gguf_ops.matmul(x, w, qtype, n, k),
             "torch": lambda: onednn_linear.linear(x, dense)}
    if rows == 1:
        cold_w = cycling(w.clone, w.numel(), cold_bytes)
        cold_d = cycling(lambda: onednn_linear.pack(gguf_ops.dequantize(w, qtype, n, k)),
                         n * k * 4, cold_bytes)
        calls["gguf cold"] = lambda: gguf_ops.matmul(x, cold_w(), qtype, n, k)
        calls["torch cold"] = lambda: onednn_linear.linear(x, cold_d())
    return calls


def cases(args) -> list[tuple[str, int, dict[str, Callable]]]:
    """(shape, rows, {column: call}) for every case, weights built once per shape."""
    out = []
    for shape in args.shapes:
        qtype, n, k, _ = SHAPES[shape]
        w = weights(shape, args.gguf)
        dense = onednn_linear.pack(gguf_ops.dequantize(w, qtype, n, k))
        for rows in args.rows:
            out.append((shape, rows, columns(qtype, n, k, w, dense, rows, args.cold_mib << 20)))
    return out


def run(args, clock) -> None:
    all_cases = cases(args)
    samples = [{name: [] for name in calls} for _, _, calls in all_cases]
    for _ in range(args.rounds):  # every case once per round, columns alternating
        for (_, _, calls), s in zip(all_cases, samples):
            for name, fn in calls.items():
                s[name].append(per_call_us(fn, args.budget, clock))
    print(f"{'shape':8} {'type':5} {'N x K':>11} {'M':>4} | {'gguf kernel us':>22} | "
          f"{'torch f32 oneDNN us':>22} | speedup | M = 1 cold: gguf GB/s, torch GB/s (us)")
    for (shape, rows, _), s in zip(all_cases, samples):
        qtype, n, k, _ = SHAPES[shape]
        line = (f"{shape:8} {qtype:5} {f'{n}x{k}':>11} {rows:4} | {spread(s['gguf']):>22} | "
                f"{spread(s['torch']):>22} | "
                f"{statistics.median(s['torch']) / statistics.median(s['gguf']):6.2f}x")
        if rows == 1:
            qbytes = n * gguf_ops.gguf_type(qtype).row_bytes(k)
            gb = [qbytes / us / 1e3 for us in s["gguf cold"]]
            tb = [n * k * 4 / us / 1e3 for us in s["torch cold"]]
            line += (f" | {statistics.median(gb):5.1f} ({min(gb):.1f}..{max(gb):.1f}), "
                     f"{statistics.median(tb):5.1f} ({min(tb):.1f}..{max(tb):.1f}) "
                     f"({statistics.median(s['gguf cold']):.0f} vs "
                     f"{statistics.median(s['torch cold']):.0f} us)")
        print(line, flush=True)


def spread(us: list[float]) -> str:
    return f"{statistics.median(us):8.1f} ({min(us):.0f}..{max(us):.0f})"


def errors(n: int = 256, k: int = 1536) -> None:
    """Max and RMS error vs float64 (same dequantized weights), in units of u·Σ|x·w|."""
    print(f"\nerror vs float64, N={n} K={k}: max / rms of |y - ref| / (u·Σ|x·w|); "
          f"bound K = {k}")
    print(f"{'type':5} {'M':>3} | {'gguf kernel':>15} | {'torch f32':>15} | {'oneDNN f32':>15}")
    g = torch.Generator().manual_seed(0)
    for qtype in ERROR_TYPES:
        w = gguf_ops.random_blocks(qtype, n, k, g)
        dense = gguf_ops.dequantize_reference(w, qtype, n, k)
        packed = onednn_linear.pack(dense)
        for m in (1, 64):
            x = torch.randn(m, k, generator=g)
            unit = U * (x.double().abs() @ dense.double().abs().T)
            ref = x.double() @ dense.double().T
            cols = [gguf_ops.matmul(x, w, qtype, n, k), F.linear(x, dense),
                    onednn_linear.linear(x, packed)]
            text = []
            for y in cols:
                e = (y.double() - ref).abs() / unit
                text.append(f"{e.max().item():6.2f} / {e.square().mean().sqrt().item():5.2f}")
            print(f"{qtype:5} {m:3} | " + " | ".join(f"{t:>15}" for t in text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 256])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--budget", type=float, default=0.1, help="seconds per measurement")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's)")
    parser.add_argument("--cold-mib", type=int, default=256,
                        help="weight copies cycled through for the cold columns")
    parser.add_argument("--gguf", help="SmolLM2-135M-Instruct.Q4_1.gguf: its real tensors")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time by process CPU time instead of wall time")
    parser.add_argument("--no-errors", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if gguf_ops.native() is None or not onednn_linear.enabled(torch.device("cpu")):
        raise SystemExit("the GGUF kernels or oneDNN packing are unavailable here")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, SIMD width "
          f"{gguf_ops.native().simd_width}; memory copy {copy_gbps():.1f} GB/s (read + write)")
    print(f"{'CPU' if args.cpu_time else 'wall'} time per call, medians of {args.rounds} "
          f"interleaved rounds (min..max); weights: {args.gguf or 'random blocks'}")
    run(args, time.process_time if args.cpu_time else time.perf_counter)
    if not args.no_errors:
        errors()


if __name__ == "__main__":
    main()
