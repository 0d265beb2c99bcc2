"""Online serving vs the offline engine, on the demo model (TP=1, float32), same prompts:

1. `deltaserve bench serve` at --max-concurrency 64 through `deltaserve serve`: output tokens/s
   against `LLM.generate` of the same prompts and engine options (goal: >= 90 %);
2. TTFT median at 1 request/s against one engine step for the same prompt (`LLM.generate`
   with max_tokens=1: one prefill step plus the offline front-end's own overhead).

Rounds alternate server and offline runs (this host is shared and noisy); medians shown.
Usage: python benchmarks/bench_serve.py [--rounds 2] [--num-prompts 256]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from server_utils import Server  # noqa: E402

from launch import LLM, SamplingParams  # noqa: E402
from launch.cli.bench_serve import _run, add_bench_serve_args, random_prompts, vocab_size  # noqa: E402,E501
from launch.model_cache.cache import SHIPPED_MODEL  # noqa: E402

ENGINE = {"dtype": "float32", "tensor_parallel_size": 1, "max_num_seqs": 64}


def bench_args(url: str, **overrides) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_serve_args(parser)
    args = parser.parse_args(["--base-url", url, "--disable-tqdm"])
    vars(args).update(overrides)
    return args


def offline(prompts: list[list[int]], output_len: int) -> tuple[float, float]:
    """(output tokens/s of one generate call over all prompts, median time of a one-token
    request: a prefill step)."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    with LLM(SHIPPED_MODEL, **ENGINE) as llm:
        llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # warm up
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tput = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
        steps = []
        for p in prompts[:20]:
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=1),
                         use_tqdm=False)
            steps.append(time.perf_counter() - start)
    return tput, statistics.median(steps)


def online(args: argparse.Namespace) -> tuple[float, float]:
    """(output tokens/s at concurrency 64, TTFT median in s at 1 request/s)."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    server = Server(SHIPPED_MODEL, *flags, "--max-model-len", "1024", omp_threads=None)
    try:
        load = dict(num_prompts=args.num_prompts, random_input_len=args.input_len,
                    random_output_len=args.output_len, seed=args.seed)
        asyncio.run(_run(bench_args(server.url, **{**load, "num_prompts": 8})))  # warm up
        busy = asyncio.run(_run(bench_args(server.url, **load, max_concurrency=64)))
        calm = asyncio.run(_run(bench_args(server.url, **{**load, "num_prompts": 20},
                                           request_rate=1.0)))
    finally:
        server.stop()
    assert busy["failed"] == 0 and calm["failed"] == 0, (busy["errors"], calm["errors"])
    return busy["output_throughput"], calm["median_ttft_ms"] / 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    prompts = random_prompts(bench_args("", num_prompts=args.num_prompts,  # bench serve's
                                        random_input_len=args.input_len, seed=args.seed),
                             vocab_size(SHIPPED_MODEL))
    rows = []
    for r in range(args.rounds):
        serve_tput, ttft = online(args)
        llm_tput, step = offline(prompts, args.output_len)
        rows.append((serve_tput, llm_tput, ttft, step))
        print(f"round {r}: server {serve_tput:.0f} tok/s, LLM.generate {llm_tput:.0f} tok/s "
              f"({serve_tput / llm_tput:.0%}); TTFT median {ttft * 1e3:.1f} ms, "
              f"one-token generate {step * 1e3:.1f} ms", flush=True)
    ratio = statistics.median(s / o for s, o, _, _ in rows)  # each round's own baseline
    extra = statistics.median(t - step for _, _, t, step in rows)
    print(f"median of rounds: server/LLM.generate throughput {ratio:.0%}; TTFT median at "
          f"1 req/s minus one-token generate +{extra * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
