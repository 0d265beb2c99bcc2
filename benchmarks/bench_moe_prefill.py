"""Where the prefill of bench_moe.py's batch section goes, in-process (a ModelRunner and a
Scheduler, no engine processes): 32 prompts of 64 random tokens, each round a fresh set with
one output token, scheduled in steps of at most --chunk tokens (2048: one step, as the engine
runs it by default). Each part timed by bench_moe_step.py's wrappers (the Python layer loop:
the native loop does not take 2,048 rows); seconds per prefill, median and range over
--rounds rounds after one warm-up.

With --library A.so B.so (fused_moe.cpp builds, e.g. another branch's from the kernel cache)
the rounds alternate between them, every layer's experts bound to each in turn: an
interleaved A/B of the kernel inside the whole prefill.

Run: python benchmarks/bench_moe_prefill.py [--model-dir DIR] [--dtype bfloat16]
     [--chunk 2048 512] [--rounds 5] [--library A.so B.so]
"""
from __future__ import annotations

import argparse
import collections
import os
import random
import time

import torch
from _common import in_process, spread
from bench_moe_step import SECONDS, instrument, wrap

from engine_core import Request, Scheduler
from launch import SamplingParams
from worker.model_runner import ModelRunner
from worker.native import fused_moe
from worker.native.library import entry_point

PROMPTS, PROMPT_LEN = 32, 64


def prefill(runner: ModelRunner, sched: Scheduler, rng: random.Random, tag: str) -> float:
    """Seconds to prefill a fresh set of prompts (all steps until every request finished)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for i in range(PROMPTS):
        prompt = [rng.randrange(2, 32000) for _ in range(PROMPT_LEN)]
        sched.add_request(Request(f"{tag}-{i}", prompt, params, arrival_time=0.0))
    start = time.perf_counter()
    while sched.has_unfinished_requests():
        so = wrap("schedule", sched.schedule)()
        out = wrap("execute_model", runner.execute_model)(so)
        wrap("update", sched.update_from_output)(so, out)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", default="/work/peer/models/qwen3moe-1b-bench")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--chunk", type=int, nargs="+", default=[2048],
                        help="max_num_batched_tokens (one line of figures each)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--library", nargs="+", default=[],
                        help="fused_moe builds to alternate between (default: this tree's)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # one scheduler (the runner checks step numbers), its token budget set before each prefill
    runner, sched = in_process(args.model_dir, args.dtype, args.threads, PROMPTS,
                               max(args.chunk), enable_chunked_prefill=True)
    instrument(runner, layers=True)
    experts = [layer.mlp.experts.fused_experts for layer in runner.model.model.layers
               if getattr(layer.mlp.experts, "fused_experts", None) is not None]
    libraries = {path: entry_point(path, "fused_moe_forward", fused_moe._FORWARD_ARGS)
                 for path in args.library} or {"this tree": None}
    rng = random.Random(0)
    runs = [(lib, c) for lib in libraries for c in args.chunk]
    times = {run: [] for run in runs}
    parts = {run: collections.defaultdict(list) for run in runs}
    print(f"load {os.getloadavg()[0]:.1f}", flush=True)
    for r in range(args.rounds + 1):
        for lib, c in runs:  # libraries and chunk sizes interleaved
            for fused in experts if libraries[lib] is not None else ():
                fused._forward = libraries[lib]
            object.__setattr__(sched.scheduler_config, "max_num_batched_tokens", c)
            SECONDS.clear()
            seconds = prefill(runner, sched, rng, f"{r}-{lib}-{c}")
            if r == 0:
                continue
            times[lib, c].append(seconds)
            for name, s in SECONDS.items():
                parts[lib, c][name].append(s)
    print(f"prefill of {PROMPTS} x {PROMPT_LEN} tokens, {args.dtype}, {args.threads} threads, "
          f"{args.rounds} rounds, load {os.getloadavg()[0]:.1f}")
    for run in runs:
        print(f"{run[0]}, chunk {run[1]}: {spread(times[run])} s")
        for name, values in sorted(parts[run].items(), key=lambda kv: -sorted(kv[1])[len(kv[1]) // 2]):
            print(f"  {name:28s} {spread([v * 1e3 for v in values])} ms")


if __name__ == "__main__":
    main()
