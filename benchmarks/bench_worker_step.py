"""The worker's own work in a decode step, outside the layer loop and the LM head: applying the
step's deltas, the flat batch, the attention plan, the sampler and the output, in-process (a
ModelRunner and a Scheduler, no engine processes) at --streams streams of bench_moe.py's
model; milliseconds per step over --steps steps after 10 warm-up steps, each part timed by a
wrapper around it (about 0.3 us each).

  host       execute_model minus the native layer loop call and the LM head (compute_logits)
  sizer      the worker's team sizer around each step as worker_proc runs it (a TeamSizer over
             this host's /proc, its sizes not applied): before_step (between receiving a step
             and running it) and after_send (after the answer, where this tree has it)
  argmax     the sampler's greedy argmax alone, [streams, vocab] float32: torch.argmax and the
             native kernel (worker/kernels/argmax.h) in interleaved rounds, microseconds;
             hot (the same logits again) and cold (a ring of 256 MiB of logits)

Run: python benchmarks/bench_worker_step.py [--streams 32] [--steps 60] [--argmax-only]
     [--no-argmax]
Two trees compared: run each tree's copy of this script in turn (it imports its own tree).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from _common import ROOT, Timers, in_process, median_us  # noqa: F401  (ROOT puts the repository on sys.path)

from engine_core import Request
from launch import SamplingParams
from worker import model_runner as model_runner_module
from worker.host.load_meter import LoadMeter, engine_pids
from worker.host.team_size import TeamSizer
from worker.model_runner import ModelRunner
from worker.models import native_layer_loop

TIMERS = Timers()
wrap, SECONDS = TIMERS.wrap, TIMERS.seconds


def _wrap_attr(owner, attr: str, name: str) -> None:
    if hasattr(owner, attr):
        setattr(owner, attr, wrap(name, getattr(owner, attr)))


def instrument(runner: ModelRunner) -> None:
    model = runner.model
    _wrap_attr(runner.input_batch, "apply", "apply deltas")
    _wrap_attr(model_runner_module, "prepare_step", "prepare_step")
    _wrap_attr(runner.lora, "begin_step", "lora.begin_step")
    _wrap_attr(runner.attention, "plan", "attention.plan")
    _wrap_attr(model.model.embed_tokens, "forward", "embedding")
    _wrap_attr(native_layer_loop.NativeLayerLoop, "__call__", "native layer loop")
    _wrap_attr(model.model.norm, "add_and_norm", "final norm")
    _wrap_attr(model, "forward", "model forward (all)")
    _wrap_attr(model, "compute_logits", "lm_head")
    _wrap_attr(runner.input_batch, "sampling_metadata", "sampling_metadata")
    _wrap_attr(runner.sampler, "sample", "sampler.sample")
    _wrap_attr(runner.input_batch, "append_tokens", "append_tokens")
    _wrap_attr(model_runner_module, "_output", "output struct")


def measure(args) -> dict[str, float]:
    streams = args.streams
    runner, sched = in_process(args.model_dir, args.dtype, args.threads, streams)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 20, ignore_eos=True)
    for i in range(streams):
        sched.add_request(Request(str(i), list(range(1 + i, 65 + i)), params, arrival_time=0.0))
    execute = wrap("execute_model", runner.execute_model)
    for _ in range(10):  # prefill, then decode steps
        so = sched.schedule()
        sched.update_from_output(so, runner.execute_model(so))
    instrument(runner)
    sizer = TeamSizer(args.threads, LoadMeter(frozenset(os.sched_getaffinity(0)),
                                              ours=engine_pids()))
    before = wrap("sizer.before_step", sizer.before_step)
    after_send = wrap("sizer.after_send", getattr(sizer, "after_send", lambda: None))
    SECONDS.clear()
    for _ in range(args.steps):
        so = sched.schedule()
        before(so.total_num_scheduled_tokens)  # its size not applied
        start = time.perf_counter()
        out = execute(so)
        sizer.after_step(so.total_num_scheduled_tokens, time.perf_counter() - start)
        after_send()
        sched.update_from_output(so, out)
    ms = {name: s / args.steps * 1e3 for name, s in SECONDS.items()}
    ms["host"] = ms["execute_model"] - ms.get("native layer loop", 0.0) - ms["lm_head"]
    return ms


def bench_argmax(args) -> None:
    from worker.native.cpu_ops import native_ops
    ops = native_ops()
    vocab = 32000
    logits = torch.randn(args.streams, vocab, generator=torch.Generator().manual_seed(0))
    runs = {"torch.argmax": lambda: logits.argmax(dim=-1)}
    if ops is not None and hasattr(ops, "argmax"):
        assert ops.argmax(logits).tolist() == logits.argmax(dim=-1).tolist()
        runs["native argmax"] = lambda: ops.argmax(logits)
    # cold: a ring of 256 MiB of logits, each read once a pass (as after the LM head, whose
    # weights stream through the caches)
    ring = [torch.randn(args.streams, vocab) for _ in range((256 << 20) // logits.nbytes)]
    turn = iter(range(1 << 62))
    for name, fn in list(runs.items()):
        kernel = ops.argmax if name.startswith("native") else (lambda x: x.argmax(dim=-1))
        runs[name + " cold"] = lambda k=kernel: k(ring[next(turn) % len(ring)])
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, fn in runs.items():
            samples[name].append(median_us(fn, repeat=len(ring) if "cold" in name else 200,
                                           rounds=3))
    for name, values in samples.items():
        print(f"  {name:21s} [{args.streams}, {vocab}] float32: median {statistics.median(values):7.1f}"
              f" us (range {min(values):.1f}-{max(values):.1f}, {args.rounds} rounds)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", default="/work/peer/models/qwen3moe-1b-bench")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--argmax-only", action="store_true")
    parser.add_argument("--no-argmax", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"tree {ROOT}", flush=True)
    if not args.no_argmax:
        bench_argmax(args)
    if args.argmax_only:
        return
    start = time.perf_counter()
    ms = measure(args)
    print(f"{args.streams} streams, {args.dtype}, {args.threads} threads ({args.steps} steps, "
          f"{time.perf_counter() - start:.0f} s in all):", flush=True)
    for name, value in sorted(ms.items(), key=lambda kv: -kv[1]):
        print(f"  {name:28s} {value:8.3f} ms", flush=True)


if __name__ == "__main__":
    main()
