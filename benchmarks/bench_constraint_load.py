"""Costly constraints against `deltaserve serve` (the shipped demo model), on a quiet host and
with a CPU-bound neighbour process (busy), today's tree against a baseline revision in the
same run (issue 30). For each case: what the hostile requests got, how long they took, the
largest gap between another stream's chunks and the largest /health latency meanwhile, and
whether the server still serves afterwards (a server that stopped is restarted).

Cases:
  flood    256 concurrent requests, each `a{1000000+j}` (distinct regexes), max_tokens 4
  n128     one request, n=128 x `a{100000}`, max_tokens 8
  schemas  20 concurrent JSON schemas of 5,000 optional properties each (distinct); 1 s in,
           a plain request, a small uncached schema and a cached json_object request, each
           timed (`plain_s`, `small_s`, `cached_s`)
Goals: flood: serving, /health < 1 s, gap <= 1 s; n128: gap <= 0.5 s; schemas: plain <= 1 s,
small <= 2 s, cached <= 1 s.

Run: python benchmarks/bench_constraint_load.py [--baseline REV] [--cases flood n128 schemas]
     [--loads quiet busy] [--case-timeout 150]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import threading
import time
import uuid

import bench_front_door
import httpx
from _common import ROOT
from bench_front_door import Server, baseline_tree, watch

PROMPT = "The quick brown fox"


async def _answers(url: str, bodies: list[dict], timeout: float) -> dict[str, int]:
    """POST every body at once; a count per outcome: HTTP status and finish reasons."""
    limits = httpx.Limits(max_connections=len(bodies) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        async def one(body: dict) -> str:
            try:
                r = await client.post("/v1/completions", json=body)
            except httpx.HTTPError as e:
                return type(e).__name__
            if r.status_code != 200:
                return str(r.status_code)
            reasons = sorted({c["finish_reason"] for c in r.json()["choices"]})
            return "200 " + "/".join(reasons)
        outcomes = await asyncio.gather(*(one(b) for b in bodies))
    counts: dict[str, int] = {}
    for outcome in outcomes:
        counts[outcome] = counts.get(outcome, 0) + 1
    return counts


def _timed(url: str, body: dict, timeout: float) -> tuple[float, str]:
    start = time.monotonic()
    try:
        r = httpx.post(url + "/v1/completions", json=body, timeout=timeout)
        outcome = str(r.status_code)
    except httpx.HTTPError as e:
        outcome = type(e).__name__
    return time.monotonic() - start, outcome


def _schema(prefix: str, n: int, tag: str) -> dict:
    """n optional properties (~54 KB for 5,000: under the 64 KiB a constraint may have),
    distinct per prefix and run."""
    return {"type": "object", "properties": {f"t{tag}": {},
                                             **{f"{prefix}{i}": {} for i in range(n)}}}


def flood(url: str, timeout: float) -> dict:
    tag = uuid.uuid4().int % 1000  # distinct regexes in every run: nothing cached
    bodies = [{"prompt": PROMPT, "max_tokens": 4,
               "structured_outputs": {"regex": f"a{{{1_000_000 + 1000 * tag + j}}}"}}
              for j in range(256)]
    return {"answers": asyncio.run(_answers(url, bodies, timeout))}


def n128(url: str, timeout: float) -> dict:
    body = {"prompt": PROMPT, "n": 128, "max_tokens": 8,
            "structured_outputs": {"regex": "a{100000}"}}
    return {"answers": asyncio.run(_answers(url, [body], timeout))}


def schemas(url: str, timeout: float) -> dict:
    tag = uuid.uuid4().hex[:4]
    _timed(url, {"prompt": PROMPT, "max_tokens": 2, "response_format": {
        "type": "json_object"}}, timeout)  # cached from now on
    bodies = [{"prompt": PROMPT, "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "big", "schema": _schema(
            chr(ord("a") + k), 5000, tag)}}} for k in range(20)]
    result: dict = {}
    hostile = threading.Thread(target=lambda: result.update(
        answers=asyncio.run(_answers(url, bodies, timeout))))
    hostile.start()
    time.sleep(1.0)
    probes = {"plain": {"prompt": PROMPT, "max_tokens": 4},
              "small": {"prompt": PROMPT, "max_tokens": 4, "response_format": {
                  "type": "json_schema", "json_schema": {"name": "small", "schema": {
                      "type": "object", "properties": {f"k{tag}": {"type": "integer"}}}}}},
              "cached": {"prompt": PROMPT, "max_tokens": 4,
                         "response_format": {"type": "json_object"}}}
    for name, body in probes.items():
        result[f"{name}_s"], result[f"{name}_answer"] = _timed(url, body, timeout)
    hostile.join()
    return result


CASES = {"flood": flood, "n128": n128, "schemas": schemas}


def run_case(server: Server, name: str, load: str, timeout: float) -> dict:
    neighbour = subprocess.Popen([sys.executable, "-c", "while 1: pass"]) \
        if load == "busy" else None
    try:
        done, gaps, health = threading.Event(), [], []
        watch(server.url, done, gaps, health)
        time.sleep(1.0)
        load_avg = os.getloadavg()[0]
        start = time.monotonic()
        row = CASES[name](server.url, timeout)
        row["seconds"] = time.monotonic() - start
        time.sleep(0.5)
        done.set()
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()
    row.update(case=name, load=load, load_avg=load_avg, gap_max_s=max(gaps or [0]),
               health_max_s=max(health or [0]), serving_after=server.healthy())
    return row


def measure(tree: str, label: str, cases: list[str], loads: list[str],
            timeout: float) -> list[dict]:
    pairs = [(name, load) for name in cases for load in loads]  # quiet, busy: back to back
    return bench_front_door.measure(
        tree, label, pairs, lambda server, pair: run_case(server, *pair, timeout))


def _extra(row: dict) -> str:
    if row["case"] != "schemas":
        return ""
    return " ".join(f"{k} {row[f'{k}_s']:.2f}s ({row[f'{k}_answer']})"
                    for k in ("plain", "small", "cached"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="a git revision to measure first, same cases")
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--loads", nargs="*", default=["quiet", "busy"],
                        choices=["quiet", "busy"])
    parser.add_argument("--case-timeout", type=float, default=150.0,
                        help="seconds a hostile request may take before it counts as lost")
    args = parser.parse_args()
    rows = []
    if args.baseline:
        rows += measure(baseline_tree(args.baseline), args.baseline, args.cases, args.loads,
                        args.case_timeout)
    rows += measure(ROOT, "this tree", args.cases, args.loads, args.case_timeout)
    print(f"\n{'tree':>10} {'case':>8} {'load':>5} {'loadavg':>7} {'s':>6} {'gap max':>8} "
          f"{'health max':>10} {'serving':>7}  answers")
    for r in rows:
        print(f"{r['tree'][:10]:>10} {r['case']:>8} {r['load']:>5} {r['load_avg']:7.1f} "
              f"{r['seconds']:6.1f} {r['gap_max_s']:7.2f}s {r['health_max_s']:9.2f}s "
              f"{str(r['serving_after']):>7}  {r.get('answers')} {_extra(r)}")


if __name__ == "__main__":
    main()
