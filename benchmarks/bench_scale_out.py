"""Scale-out figures, one run, demo model (float32, TP=1):

1. What the front-end's replica choice adds per request: `add_requests` of one request on a
   DP=2 client against a DP=1 client (the same call today), p50/p99, rounds alternated; and
   the choice alone.
2. What a router adds to TTFT on loopback: streamed completions (2 tokens) to a server
   directly and through SMG and vllm-router in front of two servers, alternated; p50/p99.
3. N replicas on N machines: one replica's decode step time at batch 1 and 32, fitted to
   t0 + k x batch, fed to benchmarks/simulate_replicas.py with the router's added TTFT (two
   cores cannot show scaling).

Usage: python benchmarks/bench_scale_out.py [--rounds 5] [--requests 200] [--ttft 60]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "benchmarks")]
os.environ.setdefault("OMP_NUM_THREADS", "1")

import httpx  # noqa: E402
import psutil  # noqa: E402
from server_utils import Server  # noqa: E402
from simulate_replicas import report  # noqa: E402

from common.process import free_port  # noqa: E402
from launch import LLM, SamplingParams  # noqa: E402
from launch.model_cache.cache import SHIPPED_MODEL  # noqa: E402

ENGINE = {"dtype": "float32", "max_num_seqs": 64}


def pct(values: list[float], q: float) -> float:
    return sorted(values)[int(q * (len(values) - 1))]


def add_latency_us(llm: LLM, n: int, tag: str) -> list[float]:
    """Per-request time of `add_requests` for n single requests, then drained."""
    params = llm.inputs.resolve([5, 6, 7], SamplingParams(max_tokens=1))
    times = []
    for i in range(n):
        request = llm.inputs.make_request(f"{tag}-{i}", [5, 6, 7, i % 200 + 3], params,
                                          time.time(), 0)
        start = time.perf_counter_ns()
        llm.engine.add_requests([request])
        times.append((time.perf_counter_ns() - start) / 1e3)
    left = n
    while left:
        left -= sum(out.finished for out in llm.engine.get_outputs())
    return times


def replica_choice(rounds: int, n: int) -> None:
    with LLM(SHIPPED_MODEL, **ENGINE) as one, LLM(SHIPPED_MODEL, data_parallel_size=2,
                                                   **ENGINE) as two:
        single, dual = [], []
        for r in range(rounds):
            single += add_latency_us(one, n, f"a{r}")
            dual += add_latency_us(two, n, f"b{r}")
        choose = []
        for _ in range(2000):
            start = time.perf_counter_ns()
            two.engine._choose()
            choose.append((time.perf_counter_ns() - start) / 1e3)
    print(f"1. add_requests per request, {rounds} x {n} alternated (us): DP=1 p50 "
          f"{pct(single, .5):.1f} p99 {pct(single, .99):.1f}; DP=2 p50 {pct(dual, .5):.1f} "
          f"p99 {pct(dual, .99):.1f}; added p50 {pct(dual, .5) - pct(single, .5):+.1f} p99 "
          f"{pct(dual, .99) - pct(single, .99):+.1f}; the choice alone p50 "
          f"{pct(choose, .5):.2f} p99 {pct(choose, .99):.2f}")


def ttft_ms(url: str, i: int) -> float:
    body = {"model": "default_model", "prompt": f"def f{i}(x):", "max_tokens": 2,
            "temperature": 0, "stream": True}
    start = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                return (time.perf_counter() - start) * 1e3
    raise RuntimeError(f"{url}: no token")


def start_router(name: str, workers: list[str]) -> tuple[subprocess.Popen, str] | None:
    binary = shutil.which(name, path=os.path.dirname(sys.executable)) or shutil.which(name)
    if binary is None:
        print(f"   {name}: not installed, skipped")
        return None
    port = free_port()
    command = ([binary, "launch"] if name == "smg" else [binary]) + [
        "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
        "--policy", "cache_aware"]
    if name == "smg":
        command += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if httpx.get(url + "/v1/models", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    print(f"   {name}: did not start, skipped")
    return None


def cpu_s(proc: subprocess.Popen) -> float:
    """CPU seconds a process and its children used so far."""
    process = psutil.Process(proc.pid)
    return sum(sum(p.cpu_times()[:2]) for p in [process, *process.children(recursive=True)])


def router_ttft(n: int) -> tuple[float, float]:
    """(SMG's added TTFT, its CPU time per request), in seconds."""
    servers = [Server(SHIPPED_MODEL, "--dtype", "float32") for _ in range(2)]
    added = cpu = 0.0
    try:
        routers = {name: start_router(name, [s.url for s in servers])
                   for name in ("smg", "vllm-router")}
        routes = {"direct": servers[0].url} | {n: r[1] for n, r in routers.items() if r}
        samples: dict[str, list[float]] = {name: [] for name in routes}
        idle = {name: cpu_s(r[0]) for name, r in routers.items() if r}
        time.sleep(5.0)  # what the routers spend on their own (health checks, load polls)
        idle = {name: (cpu_s(routers[name][0]) - used) / 5.0 for name, used in idle.items()}
        used = {name: cpu_s(r[0]) for name, r in routers.items() if r}
        started = time.monotonic()
        for i in range(n + 5):
            for name, url in routes.items():
                value = ttft_ms(url if name != "direct" else servers[i % 2].url, i)
                if i >= 5:  # warm-up
                    samples[name].append(value)
        direct = samples["direct"]
        line = ", ".join(f"{name} p50 {pct(v, .5):.2f} p99 {pct(v, .99):.2f}" + (
            "" if name == "direct" else " (added: median of paired differences "
            f"{statistics.median(a - b for a, b in zip(v, direct)):+.2f})")
            for name, v in samples.items())
        print(f"2. TTFT on loopback, {n} streamed completions each, alternated (ms): {line}")
        elapsed = time.monotonic() - started
        used = {name: (cpu_s(routers[name][0]) - start - idle[name] * elapsed) / (n + 5)
                for name, start in used.items()}
        print("   router CPU per request, less its idle rate (ms): " + ", ".join(f"{name} {value * 1e3:.2f}"
                                                          for name, value in used.items()))
        if "smg" in samples:
            added = statistics.median(a - b for a, b in zip(samples["smg"], direct)) / 1e3
            cpu = used["smg"]
        for router in routers.values():
            if router:
                router[0].terminate()
                router[0].wait(10)
    finally:
        for server in servers:
            server.stop()
    return max(added, 0.0), cpu


def step_fit() -> tuple[float, float]:
    """Decode step time at batch 1 and 32 (64 tokens each), fitted to t0 + k x batch."""
    points = {}
    with LLM(SHIPPED_MODEL, **ENGINE) as llm:
        params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0)
        for batch in (1, 32, 1, 32):
            prompts = [{"prompt_token_ids": [3 + i, 4, 5, 6]} for i in range(batch)]
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            step = (time.perf_counter() - start) / 64
            points[batch] = min(points.get(batch, step), step)
    k = (points[32] - points[1]) / 31
    t0 = points[1] - k
    print(f"3. one replica's step: batch 1 {points[1] * 1e3:.2f} ms, batch 32 "
          f"{points[32] * 1e3:.2f} ms -> t0 {t0 * 1e3:.2f} ms + {k * 1e6:.0f} us x batch")
    return t0, k


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--ttft", type=int, default=150, help="requests per TTFT route")
    args = parser.parse_args()
    replica_choice(args.rounds, args.requests)
    router_s, router_cpu_s = router_ttft(args.ttft)
    t0, k = step_fit()
    report(max(t0, 1e-4), max(k, 1e-6), ENGINE["max_num_seqs"], 64, router_s)
    if router_cpu_s > 0:
        per_replica = 0.8 * 64 / (t0 + k * 64) / 64  # requests/s of one replica at 80 %
        print(f"   one router core: {1 / router_cpu_s:,.0f} requests/s at "
              f"{router_cpu_s * 1e3:.2f} ms CPU each = {1 / router_cpu_s / per_replica:,.0f} "
              f"replicas of {per_replica:,.0f} requests/s (64-token outputs) before SMG "
              "needs a second core")


if __name__ == "__main__":
    main()
