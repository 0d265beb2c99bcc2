"""`deltaserve` command line (also `python -m launch`)."""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default_model")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags, named like `vllm serve`'s."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="Hugging Face style model directory (default: the shipped demo model)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=True)
    g.add_argument("--num-gpu-blocks-override", type=int)
    g.add_argument("--kv-cache-memory-bytes", type=int)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--scheduling-policy", dest="policy", default="fcfs",
                   choices=["fcfs", "priority"])
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=False,
                   help="schedule the next step while the workers run the current one")
    g.add_argument("--attention-backend", default="auto",
                   choices=["auto", "torch", "cupy", "emulated"])
    g.add_argument("--worker-address", help="tcp://HOST:PORT to let remote workers join")
    g.add_argument("--local-ranks", type=int, nargs="*",
                   help="ranks to start locally (default: all)")
    g.add_argument("--record", dest="record_path", help="write a message journal to this path")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    names = ("tensor_parallel_size", "device", "dtype", "max_model_len", "max_num_seqs",
             "max_num_batched_tokens", "block_size", "enable_prefix_caching",
             "enable_chunked_prefill", "num_gpu_blocks_override", "kv_cache_memory_bytes",
             "gpu_memory_utilization", "policy", "async_scheduling", "attention_backend",
             "worker_address", "local_ranks", "record_path", "seed")
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for one or more prompts")
    p.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--stop", action="append")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    add_engine_args(p)


def generate(args: argparse.Namespace) -> int:
    from launch import LLM, SamplingParams
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            stop=args.stop, ignore_eos=args.ignore_eos)
    start = time.perf_counter()
    with LLM(args.model, **engine_kwargs(args)) as llm:
        ready = time.perf_counter()
        outputs = llm.generate(args.prompt, params, use_tqdm=len(args.prompt) > 8)
        done = time.perf_counter()
    for out in outputs:
        if len(outputs) > 1:
            print(f"--- prompt {out.request_id} ---")
        print(out.prompt + out.outputs[0].text)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"[{tokens} tokens in {done - ready:.2f} s ({tokens / (done - ready):.1f} tokens/s); "
          f"engine start {ready - start:.1f} s; tensor parallel {args.tensor_parallel_size}]",
          file=sys.stderr)
    return 0


def _replay_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replay", help="replay a journal into fresh workers or a scheduler")
    p.add_argument("journal")
    p.add_argument("--model", help="model directory (default: the recorded one)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int)
    p.add_argument("--until-step", type=int)
    p.add_argument("--scheduler-only", action="store_true",
                   help="replay into a fresh scheduler; expect byte-identical step messages")
    p.add_argument("--dump-step", type=int, help="write the worker inputs of this step")
    p.add_argument("--out", help="directory for --dump-step")


def _journal_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("journal", help="read journals")
    commands = p.add_subparsers(dest="journal_command", required=True)
    commands.add_parser("show", help="one line per step").add_argument("journal")
    d = commands.add_parser("diff", help="the first step where two journals differ")
    d.add_argument("a")
    d.add_argument("b")
    t = commands.add_parser("timeline", help="a picture of every request over steps")
    t.add_argument("journal")
    t.add_argument("-o", "--output", default="timeline.png")


def replay(args: argparse.Namespace) -> int:
    from launch import replay as replays
    if args.dump_step is not None:
        if not args.out:
            raise ValueError("--dump-step needs --out DIR")
        return replays.dump_step(args.journal, args.dump_step, args.out)
    if args.scheduler_only:
        return replays.replay_scheduler(args.journal)
    return replays.replay_workers(args.journal, args.model, args.tensor_parallel_size,
                                  args.until_step)


def journal(args: argparse.Namespace) -> int:
    from launch import journal_tools, timeline
    if args.journal_command == "show":
        return journal_tools.show(args.journal)
    if args.journal_command == "diff":
        return journal_tools.diff(args.a, args.b)
    return timeline.draw(args.journal, args.output)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deltaserve", description="deltaserve LLM engine")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    worker = sub.add_parser("worker", help="run one worker rank and join an engine")
    worker.add_argument("--connect", required=True)
    worker.add_argument("--rank", type=int, required=True)
    _replay_parser(sub)
    _journal_parser(sub)
    from launch import model_commands
    model_commands.add_parsers(sub)
    args = parser.parse_args(argv)
    if args.command == "worker":
        from worker.worker_proc import main as worker_main
        return worker_main(["--connect", args.connect, "--rank", str(args.rank)])
    from launch.errors import EngineDeadError
    from protocol.journal import JournalError
    try:
        if args.command == "replay":
            return replay(args)
        if args.command == "journal":
            return journal(args)
        if args.command in ("download", "convert"):
            return model_commands.run(args)
        return generate(args)
    except JournalError as e:
        print(f"deltaserve: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as e:
        print(f"deltaserve: error: {e}", file=sys.stderr)
        return 2
    except EngineDeadError as e:
        print(f"deltaserve: the engine died: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
