"""Gemma 3 270M (`--model gemma3-270m`, its Q4_K_M GGUF file kept quantized) against llama.cpp
on the same file, and what sliding-window KV saves (issue 31).

Sections (--sections; both by default):
  stream   one stream, 2 threads: chat-length prompts (a base model: plain completions) x 128
           tokens (ignore_eos), our engine vs llama.cpp (--llamacpp-python) on the very same
           GGUF file, rounds interleaved, whole calls timed (prompt included). Load average
           printed each round.
  memory   8k-token sequences (prompt 8000 + 192 outputs; --seq-tokens) in a fixed KV budget (--kv-mib), in
           one process (Scheduler + ModelRunner, 2 threads): the hybrid KV manager (sliding
           windows keep only the blocks they see) vs a full-attention allocation
           (disable_hybrid_kv_cache_manager); the blocks one sequence holds per layer group,
           the most sequences running at once in each, and the greedy tokens of both (equal).
  capacity the memory section's block accounting alone (the engine core's scheduler and KV
           manager over the tests' scripted worker, no model): how many sequences run at once
           (--sequences, default 10).
Run: python benchmarks/bench_gemma3.py [--rounds 3] [--sections stream memory capacity]
     [--llamacpp-python /work/peer/llamacpp/bin/python]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch
from _common import Peer, spread

from launch import LLM, SamplingParams
from launch.model_cache.cache import download_model

# Chat-length prompts (~40-120 tokens), asked as plain text: the 270M model is a base model.
PROMPTS = [
    "Question: What is the capital of France, and what is it famous for? Describe its history "
    "in a few sentences, mentioning at least two monuments.\nAnswer:",
    "Write a short story about a robot who learns to paint. The robot lives in a small town by "
    "the sea, and every morning it watches the fishermen leave the harbor.\nStory:",
    "Explain recursion to a child who likes building blocks. Use an example with towers, and "
    "keep each sentence short.\nExplanation:",
    "def merge_sort(values):\n    \"\"\"Sort a list of numbers with merge sort and return a "
    "new list. Explain each step in comments.\"\"\"\n",
    "Here are three tips for learning a new language quickly, with a sentence of advice for "
    "each one:\n1.",
    "The following is a product review of a pair of running shoes, written by a customer who "
    "runs ten kilometers every morning:\n",
]
STREAM_TOKENS = 128
OUT_TOKENS = 192  # long enough that sequences decode side by side (not only one after another)


def ours_stream(llm: LLM) -> tuple[int, float]:
    params = SamplingParams(temperature=0.0, max_tokens=STREAM_TOKENS, ignore_eos=True)
    tokens, seconds = 0, 0.0
    for prompt in PROMPTS:
        start = time.perf_counter()
        (out,) = llm.generate(prompt, params, use_tqdm=False)
        seconds += time.perf_counter() - start
        tokens += len(out.outputs[0].token_ids)
    return tokens, seconds


def llamacpp_stream(peer: Peer) -> tuple[int, float]:
    tokens, seconds = 0, 0.0
    for prompt in PROMPTS:
        reply = peer.call("complete", prompt=prompt, max_tokens=STREAM_TOKENS)
        tokens += reply["tokens"]
        seconds += reply["seconds"]
    return tokens, seconds


def stream_section(args, model_dir: str) -> None:
    gguf_file = os.path.join(model_dir, _gguf_name(model_dir))
    with LLM(model_dir, max_model_len=1024, kv_cache_memory_bytes=1 << 28,
             num_threads=args.threads) as llm:
        print(f"ours: {llm.inputs.ready.quantization}")
        engines = {"deltaserve": lambda: ours_stream(llm)}
        peer = None
        if args.llamacpp_python:
            peer = Peer(args.llamacpp_python, "_llamacpp_peer.py")
            info = peer.call("init", model_path=gguf_file, n_ctx=1024, n_threads=args.threads)
            print(f"llama.cpp {info['version']}: {info['system_info']}")
            engines["llama.cpp"] = lambda: llamacpp_stream(peer)
        for run in engines.values():
            run()  # warm-up
        rates: dict[str, list[float]] = {name: [] for name in engines}
        for i in range(args.rounds):
            for name, run in engines.items():
                tokens, seconds = run()
                rates[name].append(tokens / seconds)
            print(f"  round {i + 1} (load {os.getloadavg()[0]:.1f}): " + ", ".join(
                f"{name} {r[-1]:,.1f}" for name, r in rates.items()), flush=True)
        if peer is not None:
            peer.close()
    print(f"one stream, {len(PROMPTS)} prompts x {STREAM_TOKENS} tokens, {args.threads} "
          f"threads, {args.rounds} rounds (output tok/s, whole calls):")
    for name, values in rates.items():
        print(f"  {name:10s} {spread(values)}")
    if "llama.cpp" in rates:
        ours, peer_rates = rates["deltaserve"], rates["llama.cpp"]
        pairs = ", ".join(f"{a / b:.2f}" for a, b in zip(ours, peer_rates))
        print(f"  deltaserve / llama.cpp: "
              f"{statistics.median(ours) / statistics.median(peer_rates):.2f}x (pairs {pairs})")


def memory_run(model_dir: str, kv_bytes: int, budget: int, hybrid: bool,
               prompts: list[list[int]], seq_tokens: int) -> dict:
    """Scheduler + ModelRunner in this process: the most requests running at once, the blocks
    held per group at that point, and every request's greedy tokens."""
    from engine_core import CacheConfig, Request, Scheduler, SchedulerConfig
    from protocol import EngineConfig
    from worker.model_runner import ModelRunner
    runner = ModelRunner(EngineConfig(
        model=model_dir, max_model_len=seq_tokens, kv_cache_memory_bytes=kv_bytes,
        max_num_seqs=len(prompts), disable_hybrid_kv_cache_manager=not hybrid))
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=len(prompts), max_num_batched_tokens=budget,
                        max_model_len=seq_tokens),
        CacheConfig(16, runner.num_blocks, True, tuple(runner.sliding_windows) or (0,)))
    params = SamplingParams(temperature=0.0, max_tokens=OUT_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        scheduler.add_request(Request(str(i), prompt, params))
    kv = scheduler.kv_cache_manager
    most, held, tokens = 0, [], {}
    start = time.perf_counter()
    while scheduler.has_unfinished_requests():
        so = scheduler.schedule()
        for out in scheduler.update_from_output(so, runner.execute_model(so)):
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if len(scheduler.running) > most:
            most, held = len(scheduler.running), kv.num_blocks_by_group()
    return {"most": most, "held": held, "blocks": runner.num_blocks - 1,
            "block_bytes": runner.kv_cache_spec.bytes_per_block(16),
            "per_sequence": kv.blocks_for_sequence(seq_tokens),
            "windows": list(kv.sliding_windows), "preemptions": scheduler.num_preemptions,
            "seconds": time.perf_counter() - start,
            "tokens": [tokens[str(i)] for i in range(len(prompts))]}


def scheduled_capacity(windows: tuple[int, ...], num_blocks: int, budget: int, n: int,
                       seq: int) -> tuple[int, list[int]]:
    """The most of n sequences (seq - OUT_TOKENS prompt tokens, OUT_TOKENS out) running at
    once, and the blocks held per group then: the engine core's scheduler and KV manager over
    the scripted worker of the tests (block accounting only, no model: it decides nothing
    the model's values could change)."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from scripted_worker import ScriptedWorker

    from engine_core import CacheConfig, Request, Scheduler, SchedulerConfig
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=budget,
                                          max_model_len=seq),
                          CacheConfig(16, num_blocks, True, windows))
    worker = ScriptedWorker(num_blocks, 16, check_kv=False, sliding_windows=windows)
    params = SamplingParams(temperature=0.0, max_tokens=OUT_TOKENS, ignore_eos=True)
    for i in range(n):
        scheduler.add_request(Request(str(i), [1000 + i] * (seq - OUT_TOKENS), params))
    most, held = 0, []
    while scheduler.has_unfinished_requests():
        so = scheduler.schedule()
        scheduler.update_from_output(so, worker.execute_model(so))
        if len(scheduler.running) > most:
            most, held = len(scheduler.running), scheduler.kv_cache_manager.num_blocks_by_group()
    return most, held


def memory_section(args, model_dir: str) -> None:
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    seq = args.seq_tokens
    prompts = [[rng.randrange(1000, 200000) for _ in range(seq - OUT_TOKENS)]
               for _ in range(args.sequences)]
    kv_bytes = args.kv_mib << 20
    runs = {name: memory_run(model_dir, kv_bytes, args.budget, hybrid, prompts, seq)
            for name, hybrid in (("hybrid", True), ("full attention", False))}
    print(f"{args.sequences} sequences of {seq} tokens ({seq - OUT_TOKENS} "
          f"prompt + {OUT_TOKENS} out), KV budget {args.kv_mib} MiB, token budget "
          f"{args.budget}, block 16 tokens:")
    for name, r in runs.items():
        one = sum(r["per_sequence"])
        print(f"  {name:15s} {r['blocks']} blocks of {r['block_bytes'] // 1024} KiB (groups, "
              f"window per group: {r['windows']}); one {seq}-token sequence holds "
              f"{r['per_sequence']} = {one} blocks ({one * r['block_bytes'] / 2**20:.1f} MiB) "
              f"at most; most running at once: {r['most']} (then {r['held']} blocks held per "
              f"group), {r['preemptions']} preemptions, {r['seconds']:.0f} s")
    hybrid, full = runs["hybrid"], runs["full attention"]
    print(f"  concurrent sequences: {hybrid['most']} vs {full['most']} "
          f"({hybrid['most'] / max(full['most'], 1):.1f}x); greedy tokens equal: "
          f"{hybrid['tokens'] == full['tokens']}")


def capacity_section(args) -> None:
    """The memory section's block accounting for more sequences, without the model."""
    seq, kv_bytes = args.seq_tokens, args.kv_mib << 20
    block = 2 * 16 * 256 * 4  # one layer's K and V of 16 tokens: 1 KV head of dim 256, fp32
    layouts = {"hybrid": ((0,) + (512,) * 5, kv_bytes // (3 * block)),
               "full attention": ((0,), kv_bytes // (18 * block))}
    print(f"capacity (scheduler + KV manager, scripted worker): {args.sequences} sequences of "
          f"{seq} tokens ({seq - OUT_TOKENS} prompt + {OUT_TOKENS} out), {args.kv_mib} MiB, "
          f"token budget {args.budget}:")
    most = {}
    for name, (windows, blocks) in layouts.items():
        most[name], held = scheduled_capacity(windows, blocks, args.budget, args.sequences, seq)
        print(f"  {name:15s} {blocks - 1} blocks: most running at once {most[name]} (then "
              f"{held} blocks held per group)")
    print(f"  {most['hybrid'] / max(most['full attention'], 1):.1f}x as many sequences")


def _gguf_name(model_dir: str) -> str:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)["quantization_config"]["gguf_file"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sections", nargs="+", default=["stream", "memory"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llamacpp-python", default=None)
    parser.add_argument("--kv-mib", type=int, default=640,
                        help="KV budget of the memory section (full attention: 2 sequences)")
    parser.add_argument("--budget", type=int, default=1024, help="tokens per step (memory)")
    parser.add_argument("--sequences", type=int, default=10)
    parser.add_argument("--seq-tokens", type=int, default=8192)
    args = parser.parse_args()
    model_dir = download_model("gemma3-270m")
    if "stream" in args.sections:
        stream_section(args, model_dir)
    if "memory" in args.sections:
        memory_section(args, model_dir)
    if "capacity" in args.sections:
        capacity_section(args)


if __name__ == "__main__":
    main()
