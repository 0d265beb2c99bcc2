"""`deltaserve bench serve`: drive any OpenAI-compatible server (ours or `vllm serve`) with
random token-id prompts in streaming completions, and report with `vllm bench serve`'s
definitions:

* TTFT: request sent to the first streamed chunk with text;
* TPOT: (latency - TTFT) / (output tokens - 1), per request with more than one token;
* ITL: every gap between consecutive chunks of a request;
* throughput: completed requests and output tokens (the server's `usage`) over the duration.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field

import msgspec

from launch.cli.bench_report import report

_decode = msgspec.json.Decoder().decode


@dataclass
class RequestResult:
    ok: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def add_bench_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", help="model name in the requests (default: the server's first); "
                   "a local directory also supplies the tokenizer's vocabulary")
    p.add_argument("--tokenizer", help="model directory whose vocabulary the random prompts "
                   "draw from (default: --model, or the server's model root, if local)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, help="most requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=os.environ.get("DELTASERVE_API_KEY"))
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--result-json", help="write the figures to this file")
    p.add_argument("--disable-tqdm", action="store_true")


def bench_serve(args: argparse.Namespace) -> int:
    for name in ("num_prompts", "random_input_len", "random_output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.request_rate <= 0 or (args.max_concurrency is not None and args.max_concurrency < 1):
        raise ValueError("--request-rate and --max-concurrency must be positive")
    result = asyncio.run(_run(args))
    print(report(result))
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["completed"] else 1


async def _run(args: argparse.Namespace) -> dict:
    import httpx
    from tqdm import tqdm
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = args.max_concurrency or args.num_prompts
    # One client (one connection) per request in flight: a shared pool rescans all its
    # connections on every chunk read, which costs more CPU than the server's side of it.
    clients: asyncio.Queue = asyncio.Queue()
    tls = args.base_url.startswith("https:")  # else no CA bundle to load, per client
    for _ in range(limit):
        clients.put_nowait(httpx.AsyncClient(base_url=args.base_url.rstrip("/"),
                                             headers=headers, timeout=args.request_timeout,
                                             verify=tls))
    try:
        client = clients.get_nowait()
        model, root = await _server_model(client, args.model)
        clients.put_nowait(client)
        prompts = random_prompts(args, vocab_size(args.tokenizer or args.model or root))
        bar = tqdm(total=len(prompts), disable=args.disable_tqdm, unit="req")
        rng = random.Random(args.seed)

        async def one(prompt: list[int]) -> RequestResult:
            client = await clients.get()  # at most `limit` requests in flight
            try:
                result = await _request(client, model, prompt, args.random_output_len)
            finally:
                clients.put_nowait(client)
            bar.update(1)
            return result
        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.ensure_future(one(prompt)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    finally:
        while not clients.empty():
            await clients.get_nowait().aclose()
    return summarize(results, duration, args, model)


async def _server_model(client, model: str | None) -> tuple[str, str | None]:
    response = await client.get("/v1/models")
    response.raise_for_status()
    data = response.json()["data"]
    entry = next((m for m in data if m["id"] == model), data[0] if data else {})
    return model or entry.get("id", ""), entry.get("root")


def vocab_size(model_dir: str | None) -> int:
    from launch.processing.tokenizer import load_tokenizer
    if model_dir and os.path.isdir(model_dir):
        tokenizer = load_tokenizer(model_dir)
        if tokenizer is not None:
            return len(tokenizer)
    print("bench serve: no local tokenizer (--tokenizer DIR); prompts use token ids < 256",
          file=sys.stderr)
    return 256


def random_prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    return [[rng.randrange(1, vocab) for _ in range(args.random_input_len)]
            for _ in range(args.num_prompts)]


async def _request(client, model: str, prompt: list[int], max_tokens: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult(prompt_len=len(prompt))
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = _decode(line[6:])
                if "error" in data:
                    result.error = str(data["error"].get("message"))
                    return result
                if data.get("usage"):
                    result.output_tokens = data["usage"]["completion_tokens"]
                if data.get("choices") and data["choices"][0].get("text"):
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last, chunks = now, chunks + 1
        result.latency = time.perf_counter() - start
        result.output_tokens = result.output_tokens or chunks
        result.ok = chunks > 0
        result.error = "" if result.ok else "no text streamed"
    except Exception as e:  # a transport error fails this request, not the run
        result.error = f"{type(e).__name__}: {e}"
    return result


def summarize(results: list[RequestResult], duration: float, args: argparse.Namespace,
              model: str) -> dict:
    from launch.cli.bench_report import distribution
    ok = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in ok)
    summary = {
        "model": model, "base_url": args.base_url, "num_prompts": len(results),
        "request_rate": str(args.request_rate), "max_concurrency": args.max_concurrency,
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": sum(r.prompt_len for r in ok), "total_output_tokens": output,
        "request_throughput": len(ok) / duration, "output_throughput": output / duration,
        "total_token_throughput": (output + sum(r.prompt_len for r in ok)) / duration,
        "errors": sorted({r.error for r in results if not r.ok})[:10]}
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    for name, values in (("ttft", [r.ttft for r in ok]), ("tpot", tpots),
                         ("itl", [g for r in ok for g in r.itl]),
                         ("e2el", [r.latency for r in ok])):
        summary.update(distribution(name, values))
    return summary
