"""Shared cores without collapse (issue 32): SmolLM2 on a quiet host and beside one CPU-bound
neighbour that this script starts itself, ours against llama.cpp, rounds interleaved.

Each round runs every engine quiet, then starts the neighbour (one process spinning in a
Python loop: one core's worth of demand) and runs every engine again, then stops it. Shapes
(--shapes; all by default):
  stream  one SmolLM2 stream: 2 short chats x 128 tokens, one at a time (ignore_eos)
  batch   32 streams together: 32 random-token prompts x (64 in, 64 out)
  tp2     one stream at tensor parallel 2 (a thread per rank)
Engines: `ours` (this checkout as it runs by default), `before` (the same code with its
team size fixed, DELTASERVE_ADAPTIVE_THREADS=0, and TP ranks unpinned,
VLLM_CPU_OMP_THREADS_BIND=nobind: the threads before issue 32, for the quiet-host
comparison; at tp2 it keeps this checkout's all-reduce and all-gather, which sleep), llama.cpp on the very same GGUF file (--llamacpp-python; n_threads
= the cores), and any `--variant NAME:VAR=VALUE,...` (the worker's environment, e.g.
`spin1k:GOMP_SPINCOUNT=1000`). Every engine is started once and warmed up; the load
average is printed each round (other work on the host counts too).
Run: python benchmarks/bench_contention.py [--rounds 3] [--shapes stream batch tp2]
     [--llamacpp-python /work/peer/llamacpp/bin/python] [--variant ...]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

from _common import Peer, spread, worker_env
from bench_offline import make_prompts

from launch import LLM, SamplingParams
from launch.model_cache.cache import download_model

CHATS = ["What is the capital of France?", "Write a haiku about the sea."]
STREAM_TOKENS, BATCH = 128, (32, 64, 64)
# a fixed team and unpinned TP ranks, as before issue 32
BEFORE = {"DELTASERVE_ADAPTIVE_THREADS": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
NEIGHBOUR = "while True: pass"
Run = Callable[[], tuple[int, float]]  # -> (tokens, seconds)


@contextlib.contextmanager
def neighbour() -> Iterator[None]:
    proc = subprocess.Popen([sys.executable, "-c", NEIGHBOUR])
    time.sleep(0.3)  # running, and the scheduler has seen it
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def ours(llm: LLM, shape: str) -> Run:
    if shape == "batch":
        n, prompt_len, out = BATCH
        prompts = [{"prompt_token_ids": p} for p in make_prompts(n, prompt_len, 49152, 0)]
        params = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)

        def run_batch() -> tuple[int, float]:
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - start
        return run_batch
    params = SamplingParams(temperature=0.0, max_tokens=STREAM_TOKENS, ignore_eos=True)

    def run_stream() -> tuple[int, float]:
        tokens, start = 0, time.perf_counter()
        for chat in CHATS:
            (out,) = llm.chat([{"role": "user", "content": chat}], params, use_tqdm=False)
            tokens += len(out.outputs[0].token_ids)
        return tokens, time.perf_counter() - start
    return run_stream


def llamacpp(peer: Peer, shape: str) -> Run:
    if shape == "batch":
        n, prompt_len, out = BATCH
        prompts = make_prompts(n, prompt_len, 49152, 0)

        def run_batch() -> tuple[int, float]:
            reply = peer.call("batch", prompts=prompts, max_tokens=out)
            return reply["tokens"], reply["seconds"]
        return run_batch

    def run_stream() -> tuple[int, float]:
        tokens, seconds = 0, 0.0
        for chat in CHATS:
            reply = peer.call("chat", messages=[{"role": "user", "content": chat}],
                              max_tokens=STREAM_TOKENS)
            tokens, seconds = tokens + reply["tokens"], seconds + reply["seconds"]
        return tokens, seconds
    return run_stream


def measure(engines: dict[str, Run], rounds: int) -> dict[str, dict[str, list[float]]]:
    """tok/s per round, {engine: {"quiet": [...], "busy": [...]}}, engines alternating."""
    rates = {name: {"quiet": [], "busy": []} for name in engines}
    for i in range(rounds):
        for condition in ("quiet", "busy"):
            with neighbour() if condition == "busy" else contextlib.nullcontext():
                for name, run in engines.items():
                    tokens, seconds = run()
                    rates[name][condition].append(tokens / seconds)
        print(f"  round {i + 1} (load {os.getloadavg()[0]:.1f}): " + ", ".join(
            f"{n} {r['quiet'][-1]:,.1f} / {r['busy'][-1]:,.1f}" for n, r in rates.items()),
            flush=True)
    return rates


def report(shape: str, rates: dict[str, dict[str, list[float]]]) -> None:
    print(f"{shape}: output tok/s, quiet / beside one CPU-bound neighbour (median (range)):")
    med = {n: {c: statistics.median(v) for c, v in r.items()} for n, r in rates.items()}
    for name, r in rates.items():
        ratio = med[name]["busy"] / med[name]["quiet"]
        print(f"  {name:10s} quiet {spread(r['quiet'])}  busy {spread(r['busy'])}  "
              f"busy/quiet {ratio:.2f}")
    for other in [n for n in rates if n != "ours"]:
        for condition in ("quiet", "busy"):
            pairs = [a / b for a, b in zip(rates["ours"][condition], rates[other][condition])]
            print(f"  ours / {other} {condition}: {statistics.median(pairs):.2f}x (pairs "
                  f"{', '.join(f'{p:.2f}' for p in pairs)})")


def run_shape(shape: str, args, smollm2: str) -> None:
    tp = 2 if shape == "tp2" else 1
    options = {"max_model_len": 1024, "kv_cache_memory_bytes": 1 << 29,
               "tensor_parallel_size": tp}
    variants = {"ours": {}, "before": BEFORE, **dict(args.variant)}
    with contextlib.ExitStack() as stack:
        engines: dict[str, Run] = {}
        order = sorted(variants, key=lambda name: name != args.create_first)
        for name, env in ((n, variants[n]) for n in order):
            with worker_env(env):
                llm = stack.enter_context(LLM(smollm2, **options))
            engines[name] = ours(llm, "stream" if shape == "tp2" else shape)
        engines = {name: engines[name] for name in variants}  # rounds run ours first
        if args.llamacpp_python:
            peer = stack.enter_context(Peer(args.llamacpp_python, "_llamacpp_peer.py"))
            gguf = next(f for f in os.listdir(smollm2) if f.endswith(".gguf"))
            info = peer.call("init", model_path=os.path.join(smollm2, gguf), n_ctx=1024,
                             n_threads=len(os.sched_getaffinity(0)))
            print(f"llama.cpp {info['version']}: {info['system_info']}")
            engines["llama.cpp"] = llamacpp(peer, "stream" if shape == "tp2" else shape)
        for run in engines.values():
            run()  # warm-up
        print(f"{shape} ({'2 chats x 128 tokens, one at a time' if shape != 'batch' else '32 x (64 in, 64 out)'}"
              f"{', tensor parallel 2' if tp == 2 else ''}), {args.rounds} rounds:", flush=True)
        report(shape, measure(engines, args.rounds))


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    name, _, assignments = text.partition(":")
    return name, dict(a.split("=", 1) for a in assignments.split(",") if a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shapes", nargs="+", default=["stream", "batch", "tp2"],
                        choices=["stream", "batch", "tp2"])
    parser.add_argument("--llamacpp-python", help="a Python with llama-cpp-python")
    parser.add_argument("--create-first", default="ours", help="the engine started first "
                        "(on this VM the first-started worker ran ~5 %% slower whichever it "
                        "was: run both orders to compare ours with before quietly)")
    parser.add_argument("--variant", type=parse_variant, action="append", default=[],
                        help="NAME:VAR=VALUE,... another engine, with that worker environment")
    args = parser.parse_args()
    os.environ.pop("OMP_NUM_THREADS", None)  # the engines choose their threads themselves
    print(f"{len(os.sched_getaffinity(0))} CPUs, load {os.getloadavg()[0]:.1f} before start")
    smollm2 = download_model("smollm2")
    for shape in args.shapes:
        run_shape(shape, args, smollm2)


if __name__ == "__main__":
    main()
