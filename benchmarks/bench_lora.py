"""What LoRA adapters cost: decode steps of a batch whose sequences run 4 adapters (and one
adapter's single stream) against the base model's, same engine settings, same run.

The engines stay up (the base model without --enable-lora; the same with it) and take
turns, round by round: the base engine on the base model, the LoRA engine on the base model
(what enabling LoRA costs requests without an adapter), and the LoRA engine with the batch's
sequences spread over the adapters (sequence j runs adapter j % N: every step mixes them,
the adapters' rows interleaved). With quantized weights, a third engine runs the adapters
with DELTASERVE_NATIVE_LORA=0: their steps in the Python layer loop instead of the native
one; with -q none and --torch-ops, one with DELTASERVE_LORA_KERNEL=0: the Python loop's deltas
as torch ops instead of one native call per layer. A decode step's time is (t(out tokens) - t(1 token)) /
(out - 1), so prefill is not counted.

    python benchmarks/bench_lora.py --quantization none auto --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import spread  # noqa: E402

from launch import LLM, LoRARequest, SamplingParams  # noqa: E402
from launch.model_cache.cache import resolve_model  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(hf: dict, path: str, seed: int, rank: int) -> str:
    """A random PEFT adapter of every projection (what `target_modules="all-linear"` makes)."""
    from safetensors.torch import save_file
    h, inter, heads = hf["hidden_size"], hf["intermediate_size"], hf["num_attention_heads"]
    kv, d = hf.get("num_key_value_heads") or heads, hf.get("head_dim") or h // heads
    shapes = {"q_proj": (h, heads * d), "k_proj": (h, kv * d), "v_proj": (h, kv * d),
              "o_proj": (heads * d, h), "gate_proj": (h, inter), "up_proj": (h, inter),
              "down_proj": (inter, h)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(hf["num_hidden_layers"]):
        for t in TARGETS:
            sub = "self_attn" if t in TARGETS[:4] else "mlp"
            name = f"base_model.model.model.layers.{layer}.{sub}.{t}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, shapes[t][0], generator=g) * .02
            tensors[f"{name}.lora_B.weight"] = torch.randn(shapes[t][1], rank, generator=g) * .02
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": TARGETS, "bias": "none"}, f)
    return path


def timed(llm: LLM, prompts: list[list[int]], out: int, loras: list | None) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                 lora_request=loras)
    return time.perf_counter() - start


def step_ms(llm: LLM, prompts: list[list[int]], out: int, loras: list | None) -> float:
    """One decode step of this batch, prefill excluded."""
    return (timed(llm, prompts, out, loras) - timed(llm, prompts, 1, loras)) / (out - 1) * 1e3


def run(args: argparse.Namespace, quantization: str, adapters: list[LoRARequest]) -> None:
    common = dict(quantization=quantization, max_model_len=args.input + args.stream_out + 8,
                  max_num_seqs=max(args.batch, 1), enable_prefix_caching=False)
    base = LLM(args.model, **common)
    lora = LLM(args.model, enable_lora=True, max_loras=len(adapters),
               max_lora_rank=args.rank, **common)
    # Quantized weights run steps in the native layer loop; the same engine with
    # DELTASERVE_NATIVE_LORA=0 shows what adapter rows cost in the Python loop instead.
    # Dense float32 weights run the Python loop, whose deltas take one native call per layer;
    # the same engine with DELTASERVE_LORA_KERNEL=0 shows them as torch ops instead.
    python_loop = None
    switch = "DELTASERVE_NATIVE_LORA" if quantization != "none" else "DELTASERVE_LORA_KERNEL"
    if quantization != "none" or args.torch_ops:
        os.environ[switch] = "0"
        try:
            python_loop = LLM(args.model, enable_lora=True, max_loras=len(adapters),
                              max_lora_rank=args.rank, **common)
        finally:
            del os.environ[switch]
    batch = [[(7 * i + j) % 1000 + 10 for j in range(args.input)] for i in range(args.batch)]
    mixed = [adapters[i % len(adapters)] for i in range(args.batch)]
    shapes = {"batch": (batch, args.out), "stream": (batch[:1], args.stream_out)}
    cases = {"base engine": (base, None), "lora engine, base": (lora, None),
             "lora engine, adapters": (lora, "adapters")}
    if python_loop is not None:
        name = "adapters, Python loop" if quantization != "none" else "adapters, torch ops"
        cases[name] = (python_loop, "adapters")
    results: dict[tuple[str, str], list[float]] = {}
    try:
        for llm, which in cases.values():  # warm up: kernels, adapters loaded
            for prompts, _ in shapes.values():
                timed(llm, prompts, 4, mixed[:len(prompts)] if which else None)
        for r in range(args.rounds):
            for shape, (prompts, out) in shapes.items():
                for name, (llm, which) in cases.items():
                    loras = mixed[:len(prompts)] if which else None
                    results.setdefault((shape, name), []).append(
                        step_ms(llm, prompts, out, loras))
            print(f"  round {r + 1}: load average {os.getloadavg()[0]:.2f}", flush=True)
    finally:
        for llm in (base, lora, python_loop):
            if llm is not None:
                llm.shutdown()
    _print_results(args, quantization, len(adapters), shapes, list(cases), results)


def _print_results(args: argparse.Namespace, quantization: str, num_adapters: int,
                   shapes: dict, cases: list[str],
                   results: dict[tuple[str, str], list[float]]) -> None:
    print(f"\n{args.model} -q {quantization}: ms per decode step, median (min..max) of "
          f"{args.rounds} rounds; {num_adapters} adapters of rank {args.rank} on every "
          "projection")
    for shape, (prompts, out) in shapes.items():
        print(f"  {shape} ({len(prompts)} x ({args.input} in, {out} out)):")
        for name in cases:
            ms = results[(shape, name)]
            against = [_against(ms, results[(shape, b)]) for b in ("base engine",
                                                                  "lora engine, base")]
            print(f"    {name:24s} {spread(ms)} ms  x{against[0]} of the base engine, "
                  f"x{against[1]} of the LoRA engine's base requests; "
                  f"{1e3 * len(prompts) / statistics.median(ms):.1f} tok/s")


def _against(ms: list[float], base_ms: list[float]) -> str:
    """Ratio of medians, and the range of the rounds' pairs."""
    ratios = [m / b for m, b in zip(ms, base_ms)]
    return (f"{statistics.median(ms) / statistics.median(base_ms):.2f} "
            f"(pairs {min(ratios):.2f}..{max(ratios):.2f})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--quantization", nargs="+", default=["none", "auto"])
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--input", type=int, default=64)
    parser.add_argument("--out", type=int, default=64)
    parser.add_argument("--stream-out", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--torch-ops", action="store_true",
                        help="with -q none, also an engine adding deltas with torch ops "
                             "(DELTASERVE_LORA_KERNEL=0)")
    args = parser.parse_args()
    model = resolve_model(args.model)
    with open(os.path.join(model, "config.json")) as f:
        hf = json.load(f)
    root = tempfile.mkdtemp(prefix="bench-lora-")
    adapters = [LoRARequest(f"a{i}", i + 1, write_adapter(hf, os.path.join(root, f"a{i}"),
                                                          i, args.rank))
                for i in range(args.adapters)]
    print(f"torch threads {torch.get_num_threads()}, cores {os.cpu_count()}, load average "
          f"{os.getloadavg()[0]:.2f}")
    for quantization in args.quantization:
        run(args, quantization, adapters)
    return 0


if __name__ == "__main__":
    sys.exit(main())
