"""What recording a journal costs: offline throughput with and without `record_path`.

Target (issue 6): at most 3% of offline throughput. Same model and requests as the
throughput benchmark (4 layers, hidden 256; 64 requests, 64 new tokens); the two modes
alternate, and each figure is a median.
Run: python benchmarks/bench_journal.py [--rounds 4]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time

from _common import ROOT, decode_scheduler, median_us  # noqa: F401
from bench_model_runner import make_model

from launch import LLM, SamplingParams
from protocol import Channel, Codec, EngineConfig
from protocol.journal import JournalHeader, JournalWriter


def run(model: str, prompts: list[list[int]], record: str | None) -> float:
    with LLM(model, dtype="float32", max_num_seqs=len(prompts), kv_cache_memory_bytes=256 << 20,
             max_model_len=1024, record_path=record) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def record_cost_us(directory: str) -> tuple[float, int]:
    """Step-loop cost of journaling one 256-request decode step frame (the writing happens
    on the journal's own thread), and the frame's size."""
    frame = bytes(Codec(Channel.CORE_TO_WORKER).encode(decode_scheduler(256).schedule()))
    header = JournalHeader(protocol_version=1, engine_config=EngineConfig(model="m"),
                           weights_hash="", world_size=1, seed=0, versions={},
                           created_unix=0.0)
    writer = JournalWriter(os.path.join(directory, "cost.journal"), header)
    cost = median_us(lambda: writer.record(Channel.CORE_TO_WORKER, frame, 1), repeat=2000)
    writer.close()
    return cost, len(frame)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    rounds = parser.parse_args().rounds
    rng = random.Random(0)
    prompts = [[rng.randrange(16384) for _ in range(rng.randint(16, 256))] for _ in range(64)]
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(os.path.join(tmp, "model"))
        journal = os.path.join(tmp, "run.journal")
        plain, recorded = [], []
        for _ in range(rounds):
            plain.append(run(model, prompts, None))
            recorded.append(run(model, prompts, journal))
        size = os.path.getsize(journal)
        cost, frame = record_cost_us(tmp)
    p, r = statistics.median(plain), statistics.median(recorded)
    print(f"offline throughput, median of {rounds}: {p:.1f} output tokens/s without recording, "
          f"{r:.1f} with ({(1 - r / p) * 100:+.1f}% cost; journal {size / 1024:.0f} KiB)")
    step_ms = 64 / p * 1e3  # one decode step yields a token for each of the 64 requests
    print(f"step-loop cost of recording: {cost:.1f} us per frame ({frame} B step frame); "
          f"3 frames per step = {3 * cost / (step_ms * 1e3) * 100:.3f}% of a {step_ms:.0f} ms "
          "step")


if __name__ == "__main__":
    main()
