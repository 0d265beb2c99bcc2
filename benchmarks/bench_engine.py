"""Engine overhead per decode step, and offline throughput against Hugging Face.

(1) overhead: 256 running requests on a model so small that compute is negligible (1 layer,
hidden 32, vocab 128). The front-end times the interval between consecutive steps (schedule +
encode + send + decode + prepare inputs + forward + sample + reply + update), at TP=1 and
TP=2; the same forward pass is timed in-process, and overhead = step - forward. Target: under
1 ms at TP=1. The scheduler's and the codec's shares are measured in-process too.
(2) throughput: `LLM.generate` against batched Hugging Face `generate` on the issue-3
benchmark model (4 layers, hidden 256), in one run.
Run: python benchmarks/bench_engine.py [--part overhead|throughput|both]
"""
from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import torch
from _common import ROOT, decode_scheduler, median_us, one_token_each  # noqa: F401
from bench_model_runner import huggingface, make_model

from engine_core import CacheConfig, Request, Scheduler, SchedulerConfig
from launch import LLM, SamplingParams
from protocol import AddRequest, Channel, Codec, EngineConfig
from worker.model_runner import ModelRunner

N = 256


def micro_model(directory: str) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1, max_position_embeddings=1024,
                                 eos_token_id=None, bos_token_id=None)).save_pretrained(directory)
    return directory


def step_intervals(model: str, tp: int, async_scheduling: bool,
                   new_tokens: int = 48) -> list[float]:
    """Seconds between consecutive decode steps, as the front-end receives them."""
    with LLM(model, tensor_parallel_size=tp, dtype="float32", max_num_seqs=N,
             num_gpu_blocks_override=N * 8 + 1, max_model_len=256,
             async_scheduling=async_scheduling) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        llm.engine.add_requests([AddRequest(f"r{i}", [1 + i % 100] * 8, params, time.time())
                                 for i in range(N)])
        seen, stamps, finished = 0, [], 0
        while finished < N:
            outputs = llm.engine.get_outputs(timeout_ms=1)
            finished += sum(o.finished for o in outputs)
            if llm.engine.last_step != seen and len(outputs) == N:
                seen = llm.engine.last_step
                stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps[5:], stamps[6:])]  # steady decode only


def forward_time(model: str) -> tuple[float, float]:
    """(forward, whole execute_model) medians in seconds for a 256-request decode step."""
    runner = ModelRunner(EngineConfig(model=model, dtype="float32", max_num_seqs=N,
                                      num_gpu_blocks_override=N * 8 + 1, max_model_len=256))
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=N, max_num_batched_tokens=4096,
                                          max_model_len=256), CacheConfig(16, runner.num_blocks))
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for i in range(N):
        scheduler.add_request(Request(f"r{i}", [1 + i % 100] * 8, params, float(i)))
    forward, total, inner = [], [], runner.model.forward

    def timed(*args, **kwargs):
        start = time.perf_counter()
        result = inner(*args, **kwargs)
        forward.append(time.perf_counter() - start)
        return result
    runner.model.forward = timed
    for _ in range(30):
        so = scheduler.schedule()
        start = time.perf_counter()
        mro = runner.execute_model(so)
        total.append(time.perf_counter() - start)
        scheduler.update_from_output(so, mro)
    return statistics.median(forward[5:]), statistics.median(total[5:])


def _ms(values: list[float]) -> str:
    return ", ".join(f"{v * 1e3:.2f}" for v in values)


def overhead(rounds: int = 3) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = micro_model(tmp)
        fwd, execute = forward_time(model)
        print(f"decode step, {N} running requests, micro model (1 layer, hidden 32, vocab 128)")
        print(f"  in-process: forward {fwd * 1e3:.2f} ms; execute_model (prepare inputs + "
              f"forward + sample) {execute * 1e3:.2f} ms")
        scheduler, codec = decode_scheduler(N), Codec(Channel.CORE_TO_WORKER)
        so = scheduler.schedule()
        reply, back = one_token_each(so), Codec(Channel.WORKER_TO_CORE)
        wire = median_us(lambda: (codec.decode(codec.encode(so)), back.decode(back.encode(reply))),
                         repeat=300)
        print(f"  in-process: step + reply encode/decode {wire:.0f} us")
        for tp in (1, 2):
            # The host drifts: alternate the modes, and compare each pair run back to back.
            runs = {False: [], True: []}
            for _ in range(rounds):
                for mode in runs:
                    runs[mode].append(statistics.median(step_intervals(model, tp, mode)))
            for mode, steps in runs.items():
                step = statistics.median(steps)
                name = "async scheduling" if mode else "sync scheduling "
                print(f"  TP={tp}, {name}: {step * 1e3:.2f} ms per step end to end (rounds "
                      f"{_ms(steps)}); overhead (step - forward) {(step - fwd) * 1e3:.2f} ms")
            ratio = statistics.median(a / s for s, a in zip(runs[False], runs[True]))
            print(f"  TP={tp}: async/sync step time, median of back-to-back pairs: {ratio:.2f}")


def generate_throughput(model: str, prompts: list[list[int]], new_tokens: int,
                        async_scheduling: bool) -> float:
    """Median output tokens/s of LLM.generate over three runs on one engine."""
    rates = []
    with LLM(model, dtype="float32", max_num_seqs=len(prompts), kv_cache_memory_bytes=256 << 20,
             max_model_len=1024, async_scheduling=async_scheduling) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        for _ in range(3):
            start = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=False)
            produced = sum(len(o.outputs[0].token_ids) for o in outs)
            rates.append(produced / (time.perf_counter() - start))
    return statistics.median(rates)


def throughput(requests: int = 64, new_tokens: int = 64) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(16384) for _ in range(rng.randint(16, 256))]
               for _ in range(requests)]
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(tmp)
        ours = {mode: generate_throughput(model, prompts, new_tokens, mode)
                for mode in (False, True)}
        theirs = statistics.median(huggingface(model, prompts, new_tokens) for _ in range(3))
    print(f"offline throughput, {requests} requests (prompts 16..256, {new_tokens} new tokens):")
    for mode, rate in ours.items():
        name = "async scheduling" if mode else "sync scheduling "
        print(f"  LLM.generate, {name}: {rate:.1f} output tokens/s; HF generate "
              f"{theirs:.1f}: ratio {rate / theirs:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["overhead", "throughput", "both"], default="both")
    part = parser.parse_args().part
    if part in ("overhead", "both"):
        overhead()
    if part in ("throughput", "both"):
        throughput()


if __name__ == "__main__":
    main()
