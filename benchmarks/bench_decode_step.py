"""Where one SmolLM2 decode step's time goes, one stream: the model's parts timed in-process
(a ModelRunner and a Scheduler, no processes), then the same decode through the engine
(`LLM.generate`, separate engine-core and worker processes); the difference is the engine
core, the process hops and the front-end. GGUF kept quantized (exact, and `gguf_a8`: 8-bit
activations) and float32 (`--quantization none`), rounds interleaved; milliseconds per token,
medians of the rounds. Timers wrap each part (about 0.3 us each, ~0.1 ms per token in all).
Exact GGUF runs twice: with the native layer loop (one call for all layers, timed as one
part) and with the Python loop (DELTASERVE_NATIVE_LAYERS=0 in the engine), whose parts are
timed one by one.
Run: python benchmarks/bench_decode_step.py [--rounds 3] [--threads 2] [--runs gguf gguf_a8 ...]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from _common import ROOT, Timers  # noqa: F401  (ROOT puts the repository on sys.path)

from engine_core import CacheConfig, Request, Scheduler, SchedulerConfig
from launch import LLM, SamplingParams
from launch.model_cache.cache import download_model
from protocol import EngineConfig
from worker import model_runner
from worker.model_runner import ModelRunner
from worker.models import llama
from worker.models.native_layer_loop import NativeLayerLoop

# Module functions the timers replace, from the originals each time (never timers of timers).
ORIGINAL = {"prepare_step": model_runner.prepare_step, "silu_and_mul": llama.silu_and_mul}

PARTS = ["native layer loop", "qkv_proj", "rope", "attention", "o_proj", "gate_up_proj",
         "silu_and_mul", "down_proj", "norms", "embedding"]
# column -> (--quantization, the native layer loop)
RUNS = {"gguf": ("gguf", True), "gguf_a8": ("gguf_a8", True), "gguf, loop": ("gguf", False),
        "none": ("none", False)}
STEPS = 100
KV_BYTES = 1 << 28




def instrument(runner: ModelRunner, timers: Timers) -> None:
    """Wrap the model's parts (instance attributes shadow the methods)."""
    model = runner.model
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for module, name in ((attn.qkv_proj, "qkv_proj"), (attn.o_proj, "o_proj"),
                             (mlp.gate_up_proj, "gate_up_proj"), (mlp.down_proj, "down_proj")):
            module.forward = timers.wrap(name, module.forward)
        attn.backend = _Wrapped(attn.backend, timers.wrap("attention", attn.backend.forward))
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.add_and_norm = timers.wrap("norms", norm.add_and_norm)
    llama.silu_and_mul = timers.wrap("silu_and_mul", ORIGINAL["silu_and_mul"])
    rotary, embed = model.model.rotary_emb, model.model.embed_tokens
    rotary.forward = timers.wrap("rope", rotary.forward)
    embed.forward = timers.wrap("embedding", embed.forward)
    model.forward = timers.wrap("forward", model.forward)
    model.compute_logits = timers.wrap("lm_head", model.compute_logits)
    runner.sampler.sample = timers.wrap("sampler", runner.sampler.sample)
    model_runner.prepare_step = timers.wrap("prepare_step", ORIGINAL["prepare_step"])


class _Wrapped:
    def __init__(self, backend, forward) -> None:
        self.backend, self.forward = backend, forward


class _TimedLoop:
    def __init__(self, loop: NativeLayerLoop, timers: Timers) -> None:
        self.takes, self.call = loop.takes, timers.wrap("native layer loop", loop.__call__)

    def __call__(self, *args):
        return self.call(*args)


def in_process(model_dir: str, quantization: str, native: bool) -> dict[str, float]:
    """ms per token of each part over STEPS decode steps after a 29-token prompt."""
    runner = ModelRunner(EngineConfig(model=model_dir, quantization=quantization,
                                      max_model_len=1024, max_num_seqs=1,
                                      num_gpu_blocks_override=64))
    timers = Timers()
    model = runner.model.model
    loop = NativeLayerLoop.build(model) if native else None
    if native and loop is None:
        raise SystemExit("the native layer loop does not take this model here")
    model.native_loop = _TimedLoop(loop, timers) if loop else False
    instrument(runner, timers)
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=2048,
                                      max_model_len=1024), CacheConfig(16, runner.num_blocks, True))
    params = SamplingParams(temperature=0.0, max_tokens=STEPS + 21, ignore_eos=True)
    sched.add_request(Request("0", list(range(1, 30)), params, arrival_time=0.0))
    step = timers.wrap("step", lambda: _step(sched, runner, timers))
    for _ in range(20):
        step()
    timers.seconds.clear()
    for _ in range(STEPS):
        step()
    return {name: s / STEPS * 1e3 for name, s in timers.seconds.items()}


def _step(sched: Scheduler, runner: ModelRunner, timers: Timers) -> None:
    so = timers.wrap("schedule", sched.schedule)()
    out = timers.wrap("execute_model", runner.execute_model)(so)
    timers.wrap("update", sched.update_from_output)(so, out)


def engine_ms_per_token(model_dir: str, quantization: str, native: bool,
                       threads: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=STEPS + 1, ignore_eos=True)
    os.environ["DELTASERVE_NATIVE_LAYERS"] = "1" if native else "0"  # the worker's
    with LLM(model_dir, quantization=quantization, max_model_len=1024,
             kv_cache_memory_bytes=KV_BYTES, num_threads=threads) as llm:
        llm.generate([{"prompt_token_ids": list(range(1, 30))}], params, use_tqdm=False)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": list(range(1, 30))}], params, use_tqdm=False)
        return (time.perf_counter() - start) / STEPS * 1e3


def table(results: dict[str, list[dict[str, float]]]) -> None:
    names = list(results)
    med = {q: {k: statistics.median(r.get(k, 0.0) for r in rs) for k in rs[0]}
           for q, rs in results.items()}
    print(f"{'ms per token':28s}" + "".join(f"{q:>12s}" for q in names))
    rows = ["engine (LLM.generate)", "step", "schedule", "update", "execute_model",
            "prepare_step", "forward", *PARTS, "layer loop glue", "lm_head", "sampler",
            "runner glue", "engine core + hops"]
    for q in names:
        m = med[q]
        m["layer loop glue"] = m["forward"] - sum(m.get(p, 0.0) for p in PARTS)
        m["runner glue"] = m["execute_model"] - sum(
            m.get(p, 0.0) for p in ("prepare_step", "forward", "lm_head", "sampler"))
        m["engine core + hops"] = m["engine (LLM.generate)"] - m["execute_model"]
    for row in rows:
        print(f"{row:28s}" + "".join(f"{med[q].get(row, 0.0):12.3f}" for q in names))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    smollm2 = download_model("smollm2")
    results: dict[str, list[dict[str, float]]] = {name: [] for name in args.runs}
    for _ in range(args.rounds):
        for name, runs in results.items():
            quantization, native = RUNS[name]
            parts = in_process(smollm2, quantization, native)
            parts["engine (LLM.generate)"] = engine_ms_per_token(smollm2, quantization, native,
                                                                 args.threads)
            runs.append(parts)
    print(f"SmolLM2 one stream, {STEPS} decode steps, {args.threads} threads, "
          f"{args.rounds} rounds (medians); none = float32")
    table(results)


if __name__ == "__main__":
    main()
