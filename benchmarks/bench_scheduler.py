"""Time per decode step (schedule + update_from_output) with N running requests.

Target (issue 2): aim for at most 100 us per step at 256 running requests; 1024 is reported
too. The model's reply is prepared outside the timed region. Beside it, the same run measures
a floor: the per-request work no scheduler can skip (append the token to the request, build its
EngineCoreOutput), so the ratio survives this machine's noise.
Run: python benchmarks/bench_scheduler.py [--requests 256 1024] [--rounds 5] [--steps 100]
"""
from __future__ import annotations

import argparse
import statistics
import time

from _common import decode_scheduler, one_token_each

from protocol import EngineCoreOutput


def step_times(scheduler, num_steps: int) -> list[float]:
    samples = []
    for _ in range(num_steps):
        t0 = time.perf_counter()
        so = scheduler.schedule()
        t1 = time.perf_counter()
        reply = one_token_each(so)  # the worker's part: not timed
        t2 = time.perf_counter()
        scheduler.update_from_output(so, reply)
        samples.append((t1 - t0 + time.perf_counter() - t2) * 1e6)
    return samples


def floor_times(requests, num_steps: int) -> list[float]:
    samples = []
    for _ in range(num_steps):
        t0 = time.perf_counter()
        outputs = []
        for request in requests:
            request.output_token_ids.append(7)
            request.all_token_ids.append(7)
            outputs.append(EngineCoreOutput(request.request_id, [7]))
        samples.append((time.perf_counter() - t0) * 1e6)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    for n in args.requests:
        scheduler, spare = decode_scheduler(n), decode_scheduler(n)
        ours, floor = [], []
        for _ in range(args.rounds):  # interleaved, so both see the same machine weather
            ours.append(statistics.median(step_times(scheduler, args.steps)))
            floor.append(statistics.median(floor_times(spare.running, args.steps)))
        ours_us, floor_us = statistics.median(ours), statistics.median(floor)
        print(f"{n:5d} running: {ours_us:8.1f} us/step ({ours_us / n:.2f} us/request), "
              f"floor {floor_us:7.1f} us ({ours_us / floor_us:.1f}x the floor); "
              f"rounds {min(ours):.0f}..{max(ours):.0f} us")


if __name__ == "__main__":
    main()
