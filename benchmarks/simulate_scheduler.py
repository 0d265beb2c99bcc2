"""Scheduler simulation: random traffic through the real scheduler, a scripted model, and the
real step protocol (each step encoded and decoded as a worker would receive it).

Run: python benchmarks/simulate_scheduler.py [--requests 200] [--blocks 120]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from _common import ROOT  # noqa: E402,F401  (puts the repository on sys.path)
from scripted_worker import ScriptedWorker  # noqa: E402

from engine_core import CacheConfig, EngineCore, Scheduler, SchedulerConfig  # noqa: E402
from protocol import AddRequest, Channel, Codec, SamplingParams  # noqa: E402


class WireWorker(ScriptedWorker):
    """Receives every step as bytes, like a worker process."""

    codec = Codec(Channel.CORE_TO_WORKER)

    def execute_model(self, so):
        return super().execute_model(self.codec.decode(self.codec.encode(so)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--blocks", type=int, default=120)
    args = parser.parse_args()
    rng, block_size = random.Random(0), 16
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=256,
                                          max_model_len=1024),
                          CacheConfig(block_size, args.blocks, True))
    engine = EngineCore(scheduler, WireWorker(args.blocks, block_size))
    system_prompt = [rng.randint(3, 900) for _ in range(64)]
    pending, steps, tokens, t0 = list(range(args.requests)), 0, 0, time.perf_counter()
    while pending or engine.has_work():
        for _ in range(rng.randint(0, 3)):
            if pending:
                i = pending.pop(0)
                prompt = system_prompt[:rng.choice([0, 32, 64])] + [
                    rng.randint(3, 900) for _ in range(rng.randint(4, 200))]
                engine.add_request(AddRequest(f"req-{i}", prompt, SamplingParams(
                    max_tokens=rng.randint(8, 128), ignore_eos=True), float(i)))
        if engine.has_work():
            so, _ = engine.step()
            steps, tokens = steps + 1, tokens + so.total_num_scheduled_tokens
            scheduler.check_integrity()
            if steps % 50 == 0:
                s = scheduler.get_stats()
                print(f"step {steps:5d}: running {s.num_running:3d} waiting {s.num_waiting:3d} "
                      f"KV {s.kv_blocks_used:4d}/{s.kv_blocks_total} blocks "
                      f"preemptions {s.num_preemptions}")
    kv = scheduler.kv_cache_manager.block_pool
    print(f"{args.requests} requests in {steps} steps ({tokens} tokens scheduled, "
          f"{scheduler.num_preemptions} preemptions) in {time.perf_counter() - t0:.2f}s; "
          f"all {kv.get_num_free_blocks()} blocks free again; every step passed the checks")


if __name__ == "__main__":
    main()
