"""Where a decode step of bench_moe.py's model goes, in-process (a ModelRunner and a Scheduler,
no engine processes), one stream and 32 streams: each part timed by a wrapper around it
(about 0.3 us each), milliseconds per step over --steps steps after 10 warm-up steps.

  moe block        the sparse block: router, routing (top-k), experts, glue
  experts          routing (select_experts) and the kernel; kernel apply: the kernel call
  qkv, o           the attention projections; attention: the paged-attention backend
  lm_head          the final logits; sampler, schedule, update: the engine's step pieces
Those per-layer parts are timed in the Python layer loop (--python-loop, and wherever the native
layer loop does not take the step: 32 bf16 streams); where the native loop runs, `forward` is
its one call plus the embedding and final norm.

Run: python benchmarks/bench_moe_step.py [--model-dir DIR] [--dtype bfloat16] [--streams 1 32]
"""
from __future__ import annotations

import argparse
import time

import torch
from _common import ROOT, Timers, in_process  # noqa: F401  (ROOT puts the repository on sys.path)

from engine_core import Request
from launch import SamplingParams
from worker.model_runner import ModelRunner
from worker.models.native_layer_loop import NativeLayerLoop

TIMERS = Timers()
wrap, SECONDS = TIMERS.wrap, TIMERS.seconds


class _Backend:
    def __init__(self, backend, forward) -> None:
        self.backend, self.forward = backend, forward


def instrument(runner: ModelRunner, layers: bool) -> None:
    """Wraps the step's parts; with `layers` also each layer's (which keeps the model in the
    Python layer loop: the native loop takes only the model's own attention backend)."""
    model, wrapped = runner.model, set()
    for layer in model.model.layers if layers else ():
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj.forward = wrap("qkv", attn.qkv_proj.forward)
        attn.o_proj.forward = wrap("o", attn.o_proj.forward)
        attn.backend = _Backend(attn.backend, wrap("attention", attn.backend.forward))
        mlp.forward = wrap("moe block", mlp.forward)
        mlp.gate.forward = wrap("router linear", mlp.gate.forward)
        mlp.experts.forward = wrap("experts (routing + kernel)", mlp.experts.forward)
        method = mlp.experts.quant_method
        if id(method) not in wrapped:
            method.apply = wrap("kernel apply", method.apply)
            wrapped.add(id(method))
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.add_and_norm = wrap("norms", norm.add_and_norm)
    model.model.rotary_emb.forward = wrap("rope", model.model.rotary_emb.forward)
    model.forward = wrap("forward", model.forward)
    model.compute_logits = wrap("lm_head", model.compute_logits)
    runner.sampler.sample = wrap("sampler", runner.sampler.sample)


def measure(args, streams: int) -> None:
    runner, sched = in_process(args.model_dir, args.dtype, args.threads, streams)
    loop = None if args.python_loop else NativeLayerLoop.build(runner.model.model)
    native = loop is not None and streams <= loop.max_rows
    instrument(runner, layers=not native)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 20, ignore_eos=True)
    for i in range(streams):
        sched.add_request(Request(str(i), list(range(1 + i, 17 + i)), params, arrival_time=0.0))

    def step() -> None:
        so = wrap("schedule", sched.schedule)()
        out = wrap("execute_model", runner.execute_model)(so)
        wrap("update", sched.update_from_output)(so, out)

    for _ in range(10):
        step()
    SECONDS.clear()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    total = time.perf_counter() - start
    print(f"{streams} streams, {args.dtype}, {args.threads} threads, "
          f"{'native' if native else 'Python'} layer loop: "
          f"{total / args.steps * 1e3:.2f} ms a step", flush=True)
    for name, seconds in SECONDS.most_common():
        print(f"  {name:28s} {seconds / args.steps * 1e3:8.3f} ms", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", default="/work/peer/models/qwen3moe-1b-bench")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--python-loop", action="store_true",
                        help="time each layer's parts in the Python layer loop (by default "
                             "the native loop runs where it takes the model: the layers' parts "
                             "are then one call, not timed apart)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for streams in args.streams:
        measure(args, streams)


if __name__ == "__main__":
    main()
