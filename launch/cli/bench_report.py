"""Figures of a `bench serve` run: distributions in ms and the printed report, in the layout
of `vllm bench serve`."""
from __future__ import annotations

import statistics

PERCENTILE = 99


def distribution(name: str, values_s: list[float]) -> dict[str, float]:
    """mean/median/std/p99 of `values_s`, in milliseconds, keyed like vLLM's result JSON."""
    ms = sorted(v * 1000.0 for v in values_s) or [0.0]
    rank = (len(ms) - 1) * PERCENTILE / 100  # linear interpolation, as numpy's default
    low = int(rank)
    high = min(low + 1, len(ms) - 1)
    p = ms[low] + (ms[high] - ms[low]) * (rank - low)
    return {f"mean_{name}_ms": statistics.fmean(ms), f"median_{name}_ms": statistics.median(ms),
            f"std_{name}_ms": statistics.pstdev(ms), f"p{PERCENTILE}_{name}_ms": p}


_TITLES = {"ttft": ("Time to First Token", "TTFT"),
           "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
           "itl": ("Inter-token Latency", "ITL"),
           "e2el": ("End-to-end Latency", "E2EL")}


def report(r: dict) -> str:
    rows = [("Successful requests:", r["completed"]), ("Failed requests:", r["failed"]),
            ("Maximum request concurrency:", r["max_concurrency"]),
            ("Request rate configured (RPS):", r["request_rate"]),
            ("Benchmark duration (s):", f"{r['duration']:.2f}"),
            ("Total input tokens:", r["total_input_tokens"]),
            ("Total generated tokens:", r["total_output_tokens"]),
            ("Request throughput (req/s):", f"{r['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{r['output_throughput']:.2f}"),
            ("Total Token throughput (tok/s):", f"{r['total_token_throughput']:.2f}")]
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]
    lines += [f"{k:<40}{v!s:<10}" for k, v in rows]
    for key, (title, short) in _TITLES.items():
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        for stat, label in (("mean", "Mean"), ("median", "Median"), (f"p{PERCENTILE}",
                                                                    f"P{PERCENTILE}")):
            lines.append(f"{f'{label} {short} (ms):':<40}{r[f'{stat}_{key}_ms']:<10.2f}")
    lines.append("=" * 50)
    for error in r["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)
