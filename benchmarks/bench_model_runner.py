"""Offline throughput: Scheduler + ModelRunner in one process vs Hugging Face `generate`.

A random-weight Llama (4 layers, hidden 256, 4 heads / 2 KV heads, vocab 16384, float32) and
64 requests with prompts of 16..256 tokens and 64 new tokens each (greedy, no EOS). HF runs
them as one left-padded batch. Both use the same torch thread count.
Run: python benchmarks/bench_model_runner.py [--requests 64] [--new-tokens 64] [--repeat 3]
"""
from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import torch
from _common import ROOT  # noqa: F401  (puts the repository on sys.path)

from engine_core import CacheConfig, Request, Scheduler, SchedulerConfig
from protocol import EngineConfig, SamplingParams
from worker.model_runner import ModelRunner


def make_model(directory: str) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=16384, hidden_size=256, intermediate_size=688,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, eos_token_id=None, bos_token_id=None)
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def ours(model_dir: str, prompts: list[list[int]], new_tokens: int) -> float:
    runner = ModelRunner(EngineConfig(model=model_dir, dtype="float32", max_model_len=1024,
                                      max_num_seqs=len(prompts),
                                      kv_cache_memory_bytes=256 << 20))
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=len(prompts), max_num_batched_tokens=2048,
                                          max_model_len=1024),
                          CacheConfig(16, runner.num_blocks, True))
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start, produced = time.perf_counter(), 0
    for i, prompt in enumerate(prompts):
        scheduler.add_request(Request(str(i), prompt, params, arrival_time=float(i)))
    while scheduler.has_unfinished_requests():
        so = scheduler.schedule()
        for out in scheduler.update_from_output(so, runner.execute_model(so)):
            produced += len(out.new_token_ids)
    assert produced == len(prompts) * new_tokens
    return produced / (time.perf_counter() - start)


def huggingface(model_dir: str, prompts: list[list[int]], new_tokens: int) -> float:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    longest = max(map(len, prompts))
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                             eos_token_id=None)
    produced = (out.shape[1] - longest) * len(prompts)
    return produced / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(16384) for _ in range(rng.randint(16, 256))]
               for _ in range(args.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(tmp)
        results = {"deltaserve": [], "hf generate": []}
        for _ in range(args.repeat):  # interleaved, so both see the same machine load
            results["deltaserve"].append(ours(model_dir, prompts, args.new_tokens))
            results["hf generate"].append(huggingface(model_dir, prompts, args.new_tokens))
    print(f"{args.requests} requests, prompts 16..256 tokens, {args.new_tokens} new tokens each, "
          f"{torch.get_num_threads()} torch threads, median of {args.repeat}:")
    for name, values in results.items():
        print(f"  {name:12s}: {statistics.median(values):8.1f} output tokens/s  "
              f"(runs: {', '.join(f'{v:.0f}' for v in values)})")
    ratio = statistics.median(results["deltaserve"]) / statistics.median(results["hf generate"])
    print(f"  ratio        : {ratio:.2f}x")


if __name__ == "__main__":
    main()
