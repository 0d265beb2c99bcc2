"""N replicas on N machines, simulated from one replica's measured step times.

Each replica does continuous batching: a step takes `t0 + k * b` seconds for `b` running
requests (fitted to measured decode steps), admits waiting requests up to `max_seqs` at the
start of each step and gives every running request one token; a request's first token comes
at the end of its first step (prefill is folded into the step time). Requests arrive as a
Poisson stream at `load` x the replicas' combined capacity and go to a replica by least load
(4 x waiting + running, vLLM's rule, which a front-end or router applies) or at random; a
router adds `router_s` to each request's TTFT. The figures: output tokens/s, TTFT p50/p99.

Usage: python benchmarks/simulate_replicas.py --t0 0.004 --k 0.0002 [--router-s 0.001]
"""
from __future__ import annotations

import argparse
import heapq
import random
import statistics
from dataclasses import dataclass, field


@dataclass(slots=True)
class Replica:
    waiting: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens)
    running: list[list[float]] = field(default_factory=list)  # [arrival, left, first?]
    busy_until: float = 0.0

    def load(self) -> int:
        return 4 * len(self.waiting) + len(self.running)


def simulate(n: int, t0: float, k: float, max_seqs: int, out_len: int, load: float,
             policy: str, router_s: float, num_requests: int = 4000,
             seed: int = 0) -> tuple[float, float, float]:
    """(output tokens/s, TTFT p50 s, TTFT p99 s) of `num_requests` requests."""
    rng = random.Random(seed)
    capacity = max_seqs / (t0 + k * max_seqs) / out_len  # requests/s of one full replica
    rate = load * capacity * n
    replicas = [Replica() for _ in range(n)]
    events: list[tuple[float, int, int]] = []  # (time, kind 0 arrival / 1 step end, replica)
    now, ttfts, tokens, arrivals = 0.0, [], 0, 0
    heapq.heappush(events, (rng.expovariate(rate), 0, -1))
    while events and len(ttfts) < num_requests:
        now, kind, index = heapq.heappop(events)
        if kind == 0:
            arrivals += 1
            if arrivals < num_requests:
                heapq.heappush(events, (now + rng.expovariate(rate), 0, -1))
            index = min(range(n), key=lambda i: replicas[i].load()) if policy == "least" \
                else rng.randrange(n)
            replicas[index].waiting.append((now, out_len))
        else:
            tokens += _finish_step(replicas[index], now, ttfts, router_s)
        replica = replicas[index]
        if replica.busy_until <= now and (replica.waiting or replica.running):
            _start_step(replica, now, t0, k, max_seqs)
            heapq.heappush(events, (replica.busy_until, 1, index))
    return tokens / now, statistics.median(ttfts), _p99(ttfts)


def _start_step(replica: Replica, now: float, t0: float, k: float, max_seqs: int) -> None:
    while replica.waiting and len(replica.running) < max_seqs:
        arrival, left = replica.waiting.pop(0)
        replica.running.append([arrival, left, 1.0])
    replica.busy_until = now + t0 + k * len(replica.running)


def _finish_step(replica: Replica, now: float, ttfts: list[float], router_s: float) -> int:
    for request in replica.running:
        if request[2]:
            ttfts.append(now - request[0] + router_s)
            request[2] = 0.0
        request[1] -= 1
    produced = len(replica.running)
    replica.running = [r for r in replica.running if r[1] > 0]
    return produced


def _p99(values: list[float]) -> float:
    return sorted(values)[int(0.99 * (len(values) - 1))]


def report(t0: float, k: float, max_seqs: int, out_len: int, router_s: float,
           load: float = 0.8, sizes: tuple[int, ...] = (1, 2, 4, 8, 16)) -> None:
    print(f"simulated: step = {t0 * 1e3:.2f} ms + {k * 1e6:.0f} us x batch, max_num_seqs "
          f"{max_seqs}, {out_len} output tokens per request, load {load:.0%} of capacity, "
          f"router +{router_s * 1e3:.2f} ms TTFT")
    print(f"{'replicas':>8} {'policy':>6} {'out tok/s':>10} {'per replica':>11} "
          f"{'TTFT p50 ms':>11} {'TTFT p99 ms':>11}")
    for n in sizes:
        for policy in ("least", "random"):
            rate, p50, p99 = simulate(n, t0, k, max_seqs, out_len, load, policy,
                                      router_s if n > 1 else 0.0, num_requests=2000 * n)
            print(f"{n:>8} {policy:>6} {rate:>10,.0f} {rate / n:>11,.0f} {p50 * 1e3:>11.1f} "
                  f"{p99 * 1e3:>11.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--t0", type=float, required=True, help="step time at batch 0 (s)")
    parser.add_argument("--k", type=float, required=True, help="step time per request (s)")
    parser.add_argument("--max-seqs", type=int, default=64)
    parser.add_argument("--out-len", type=int, default=64)
    parser.add_argument("--router-s", type=float, default=0.0)
    parser.add_argument("--load", type=float, default=0.8)
    args = parser.parse_args()
    report(args.t0, args.k, args.max_seqs, args.out_len, args.router_s, args.load)


if __name__ == "__main__":
    main()
