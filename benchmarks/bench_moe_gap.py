"""The engine's decode step against the same step in-process (issue 31): bench_moe.py's batch
shape (32 random prompts of 64 tokens, 128 out, greedy) on its model, rounds interleaved.

  engine       `LLM.generate` (front-end, engine core, worker processes): the time between
               consecutive steps' outputs as the front-end receives them (every step after
               the first decode step; the prefill is not counted), median of a round;
  in-process   a ModelRunner and a Scheduler in this process, the same prompts and engine
               options: schedule + execute_model + update per decode step, median of a round.
The difference is what the processes add to a step: the serial hand-offs between the steps
(the worker idles while the engine core applies step N and schedules N + 1, and while the
frames cross), and what the engine core and front-end take from the worker's cores during
one. Both sides run the same prompts: bench_moe_step.py's shorter, shifted prompts make a
cheaper step (shorter contexts), so its figure is not this one's reference.

Each --engine-args (LLM options as JSON, after any NAME=VALUE environment of its processes;
repeat it to compare, e.g. '{}', '{"async_scheduling": true}' and 'GOMP_SPINCOUNT=20000 {}')
is one engine, all started before the rounds and run in turn.

Run: python benchmarks/bench_moe_gap.py [--rounds 3] [--engine-args '[NAME=VALUE ...] JSON' ...]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from contextlib import ExitStack

import torch
from _common import spread, worker_env
from bench_moe import BATCH, SHAPE, make_model
from bench_offline import make_prompts

from engine_core import CacheConfig, Request, Scheduler, SchedulerConfig
from launch import LLM, SamplingParams
from protocol import EngineConfig
from worker.model_runner import ModelRunner

ENGINE = {"max_model_len": 1024, "max_num_seqs": BATCH[0], "kv_cache_memory_bytes": 1 << 30,
          "enable_prefix_caching": False}


def engine_steps(llm: LLM, prompts: list[list[int]], out_len: int) -> list[float]:
    """Seconds between consecutive decode steps' outputs (all streams each) at the front-end."""
    stamps: list[float] = []
    receive = llm.engine.get_outputs

    def stamped(*args, **kwargs):
        outputs = receive(*args, **kwargs)
        if len(outputs) == len(prompts):
            stamps.append(time.perf_counter())
        return outputs
    llm.engine.get_outputs = stamped
    try:
        params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.engine.get_outputs = receive
    return [b - a for a, b in zip(stamps[1:], stamps[2:])]  # from the 2nd decode step


class InProcess:
    """A ModelRunner and a Scheduler with the engine's options, stepped in this process."""

    def __init__(self, args) -> None:
        self.runner = ModelRunner(EngineConfig(model=args.model_dir, dtype=args.dtype,
                                               num_threads=args.threads, **ENGINE))
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=BATCH[0], max_num_batched_tokens=4096,
                            max_model_len=ENGINE["max_model_len"]),
            CacheConfig(16, self.runner.num_blocks, False))
        self.added = 0

    def steps(self, prompts: list[list[int]], out_len: int) -> list[float]:
        """Seconds of each decode step (the prefill step is not counted)."""
        params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
        for prompt in prompts:
            self.added += 1  # one scheduler across rounds: the runner's handles continue
            self.scheduler.add_request(Request(f"r{self.added}", prompt, params, 0.0))
        seconds = []
        while self.scheduler.has_unfinished_requests():
            start = time.perf_counter()
            so = self.scheduler.schedule()
            self.scheduler.update_from_output(so, self.runner.execute_model(so))
            seconds.append(time.perf_counter() - start)
        return seconds[2:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", default="/work/peer/models/qwen3moe-1b-bench")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-len", type=int, default=BATCH[2])
    parser.add_argument("--engine-args", action="append", default=None,
                        help="one engine: [NAME=VALUE ...] LLM options as JSON (repeatable; "
                             "default: '{}')")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = make_model(args.model_dir)
    prompts = make_prompts(BATCH[0], BATCH[1], SHAPE["vocab_size"], args.seed)
    options = args.engine_args or ["{}"]
    runs: dict[str, list[float]] = {f"engine {o}": [] for o in options}
    runs["in-process"] = []
    with ExitStack() as stack:
        steps = {f"engine {o}": _engine(stack.enter_context(_start(model, args, o)), prompts,
                                        args.out_len) for o in options}
        local = InProcess(args)
        steps["in-process"] = lambda: local.steps(prompts, args.out_len)
        for run in steps.values():
            run()  # warm-up
        for i in range(args.rounds):
            order = list(steps) if i % 2 == 0 else list(steps)[::-1]
            for name in order:
                runs[name].append(statistics.median(steps[name]()) * 1e3)
            print(f"  round {i + 1} (load {os.getloadavg()[0]:.1f}): " + ", ".join(
                f"{name} {values[-1]:.2f}" for name, values in runs.items()), flush=True)
    print(f"{BATCH[0]} streams x ({BATCH[1]} in, {args.out_len} out), {args.dtype}, "
          f"{args.threads} threads, {args.rounds} rounds, ms per decode step (median of each "
          "round's steps):")
    inproc = runs.pop("in-process")
    print(f"  {'in-process':28s} {spread(inproc)}")
    for name, values in runs.items():
        gaps = [e - p for e, p in zip(values, inproc)]
        print(f"  {name:28s} {spread(values)}; - in-process {spread(gaps)} (pairs "
              + ", ".join(f"{g / p:+.1%}" for g, p in zip(gaps, inproc)) + ")")


def _start(model: str, args, spec: str) -> LLM:
    """An engine of `spec` ('[NAME=VALUE ...] JSON'): its processes start with that
    environment (e.g. libgomp's, read when they load torch)."""
    head, brace, rest = spec.partition("{")
    env = dict(word.split("=", 1) for word in head.split())
    options = json.loads(brace + rest or "{}")
    with worker_env(env):
        return LLM(model, dtype=args.dtype, num_threads=args.threads, **{**ENGINE, **options})


def _engine(llm: LLM, prompts: list[list[int]], out_len: int):
    return lambda: engine_steps(llm, prompts, out_len)


if __name__ == "__main__":
    main()
