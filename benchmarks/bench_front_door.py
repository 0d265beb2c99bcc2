"""Hostile requests against `deltaserve serve` (the shipped demo model), today's tree against
a baseline revision in the same run: for each case, what the hostile client got, how long it
took, the worst and p99 gap between another stream's chunks and the worst and p99 /health
latency while it ran, the front-end's RSS before and after, and whether the server still
serves afterwards (a server that stopped serving is restarted for the next case).

Run: python benchmarks/bench_front_door.py [--baseline REV] [--cases stop5mb prompt16mb ...]
"""
from __future__ import annotations

import argparse
import io
import json
import os
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import psutil
from _common import ROOT

MODEL = os.path.join(ROOT, "launch", "model_cache", "default_model")
STREAM = {"prompt": "def f(", "max_tokens": 300, "ignore_eos": True, "stream": True,
          "temperature": 0}


def _post(url: str, body: dict, path: str = "/v1/completions") -> str:
    try:
        r = httpx.post(url + path, content=json.dumps(body).encode(), timeout=600)
        return f"{r.status_code} ({len(r.content) >> 10} KiB)"
    except httpx.HTTPError as e:
        return f"{type(e).__name__}"


def _header_bomb(url: str, connections: int = 6, size: int = 64 << 20) -> str:
    port = int(url.rsplit(":", 1)[1])
    answers = []

    def one() -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
            try:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Bomb: ")
                chunk = b"a" * (1 << 20)
                for _ in range(size >> 20):
                    s.sendall(chunk)
                s.sendall(b"\r\n\r\n")
                answers.append(s.recv(64).split(b"\r\n")[0].decode() or "closed")
            except OSError as e:
                answers.append(f"closed ({type(e).__name__})")
    threads = [threading.Thread(target=one) for _ in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return ", ".join(sorted(set(answers)))


CASES = {
    "stop5mb": lambda url: _post(url, {"prompt": "hi", "n": 128, "max_tokens": 2,
                                       "stop": ["z" * 5_000_000]}),
    "prompt16mb": lambda url: _post(url, {"prompt": "hello world " * 1_330_000,
                                          "max_tokens": 1}),
    "headers6x64mb": _header_bomb,
    "stops10k": lambda url: _post(url, {"prompt": "hi", "n": 128, "max_tokens": 16,
                                        "stop": [f"stop{i}" for i in range(10_000)]}),
    "logprobs": lambda url: _post(url, {"prompt": ["a", "b", "c", "d"], "n": 128,
                                        "logprobs": 20, "max_tokens": 1000}),
}


class Server:
    def __init__(self, tree: str) -> None:
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "launch", "serve", "--model", MODEL, "--port", str(port),
             "--max-model-len", "1024", "--log-level", "error"],
            cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 180
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server in {tree} did not start")
            time.sleep(0.2)

    def healthy(self) -> bool:
        try:
            ok = httpx.get(self.url + "/health", timeout=5).status_code == 200
            return ok and httpx.post(self.url + "/v1/completions", timeout=30, json={
                "prompt": "x", "max_tokens": 2}).status_code == 200
        except httpx.HTTPError:
            return False

    def rss_mib(self) -> float:
        return psutil.Process(self.proc.pid).memory_info().rss / (1 << 20)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def watch(url: str, done: threading.Event, gaps: list[float], health: list[float]) -> None:
    def stream() -> None:
        while not done.is_set():
            try:
                with httpx.stream("POST", url + "/v1/completions", json=STREAM,
                                  timeout=600) as r:
                    last = None
                    for line in r.iter_lines():
                        now = time.monotonic()
                        if line.startswith("data: {"):
                            if last is not None:
                                gaps.append(now - last)
                            last = now
                        if done.is_set():
                            return
            except httpx.HTTPError:
                time.sleep(0.1)

    def poll() -> None:
        while not done.is_set():
            start = time.monotonic()
            try:
                httpx.get(url + "/health", timeout=600)
            except httpx.HTTPError:
                pass
            health.append(time.monotonic() - start)
            time.sleep(0.05)
    threads = [threading.Thread(target=stream, daemon=True),
               threading.Thread(target=poll, daemon=True)]
    for t in threads:
        t.start()


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98] if len(values) > 1 \
        else max(values or [0])


def run_case(server: Server, name: str) -> dict:
    done, gaps, health = threading.Event(), [], []
    watch(server.url, done, gaps, health)
    time.sleep(1.0)
    rss = server.rss_mib()
    start = time.monotonic()
    answer = CASES[name](server.url)
    elapsed = time.monotonic() - start
    time.sleep(0.5)
    done.set()
    return {"case": name, "answer": answer, "seconds": elapsed,
            "gap_max_ms": 1000 * max(gaps or [0]), "gap_p99_ms": 1000 * p99(gaps),
            "health_max_ms": 1000 * max(health or [0]), "health_p99_ms": 1000 * p99(health),
            "rss_before_mib": rss, "rss_after_mib": server.rss_mib(),
            "serving_after": server.healthy()}


def baseline_tree(rev: str) -> str:
    tar = subprocess.run(["git", "-C", ROOT, "archive", rev], check=True,
                         capture_output=True).stdout
    tmp = tempfile.mkdtemp(prefix="deltaserve-baseline-")
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        archive.extractall(tmp, filter="data")
    return tmp


def measure(tree: str, label: str, cases: list,
            run: Callable[[Server, Any], dict] | None = None) -> list[dict]:
    """`run(server, case)` (default run_case) for each case on one server of `tree`, a new
    one after a case that left it not serving; each row printed as it comes."""
    run = run or run_case
    rows, server = [], Server(tree)
    try:
        for case in cases:
            row = run(server, case)
            row["tree"] = label
            rows.append(row)
            print(json.dumps(row), flush=True)
            if not row["serving_after"]:
                server.stop()
                server = Server(tree)
    finally:
        server.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="a git revision to measure first, same cases")
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    args = parser.parse_args()
    rows = []
    if args.baseline:
        rows += measure(baseline_tree(args.baseline), args.baseline, args.cases)
    rows += measure(ROOT, "this tree", args.cases)
    print(f"\n{'tree':>10} {'case':>14} {'answer':>28} {'s':>6} {'gap max/p99 ms':>15} "
          f"{'health max/p99 ms':>18} {'RSS MiB':>12} serving")
    for r in rows:
        print(f"{r['tree'][:10]:>10} {r['case']:>14} {r['answer'][:28]:>28} {r['seconds']:6.1f} "
              f"{r['gap_max_ms']:7.0f}/{r['gap_p99_ms']:<7.0f} "
              f"{r['health_max_ms']:9.0f}/{r['health_p99_ms']:<8.0f} "
              f"{r['rss_before_mib']:5.0f}->{r['rss_after_mib']:<5.0f} {r['serving_after']}")


if __name__ == "__main__":
    main()
