"""`deltaserve` command line (also `python -m launch`)."""
from __future__ import annotations

import argparse
import logging
import sys
import time

from launch.cli.engine_args import add_engine_args, engine_kwargs
from worker.worker_args import add_worker_args


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for one or more prompts")
    p.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    p.add_argument("--chat", action="store_true",
                   help="each prompt is a user message, rendered with the model's chat template")
    # Sampling flags left out take the model's generation_config.json defaults
    # (--generation-config), else greedy decoding and 64 tokens.
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--min-p", type=float)
    p.add_argument("--stop", action="append")
    p.add_argument("--ignore-eos", action="store_true")
    add_engine_args(p)


def generate(args: argparse.Namespace) -> int:
    from launch import LLM, SamplingParams
    given = {name: getattr(args, name) for name in ("max_tokens", "temperature", "top_p",
                                                    "top_k", "min_p")
             if getattr(args, name) is not None}
    start = time.perf_counter()
    with LLM(args.model, **engine_kwargs(args)) as llm:
        ready = time.perf_counter()
        params = SamplingParams(**{"max_tokens": 64, "temperature": 0.0,
                                   **llm.inputs.sampling_defaults, **given},
                                stop=args.stop, ignore_eos=args.ignore_eos)
        run = llm.chat if args.chat else llm.generate
        prompts = [[{"role": "user", "content": p}] for p in args.prompt] if args.chat \
            else args.prompt
        outputs = run(prompts, params, use_tqdm=len(args.prompt) > 8)
        done = time.perf_counter()
    for out in outputs:
        if len(outputs) > 1:
            print(f"--- prompt {out.request_id} ---")
        print((f"{out.prompt.rstrip()}\n" if args.chat else out.prompt) + out.outputs[0].text)
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
    p.add_argument("--allow-truncated", action="store_true",
                   help="replay what a journal without its trailer holds (killed recordings)")


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
    from replay import replay as replays
    if args.dump_step is not None:
        if not args.out:
            raise ValueError("--dump-step needs --out DIR")
        return replays.dump_step(args.journal, args.dump_step, args.out,
                                 allow_truncated=args.allow_truncated)
    if args.scheduler_only:
        return replays.replay_scheduler(args.journal, allow_truncated=args.allow_truncated)
    return replays.replay_workers(args.journal, args.model, args.tensor_parallel_size,
                                  args.until_step, allow_truncated=args.allow_truncated)


def journal(args: argparse.Namespace) -> int:
    from replay import journal_tools, timeline
    if args.journal_command == "show":
        return journal_tools.show(args.journal)
    if args.journal_command == "diff":
        return journal_tools.diff(args.a, args.b)
    return timeline.draw(args.journal, args.output)


def _serve_parsers(sub: argparse._SubParsersAction) -> None:
    from launch.cli.bench_serve import add_bench_serve_args
    from launch.cli.serve import add_serve_args
    add_serve_args(sub.add_parser("serve", help="an OpenAI-compatible HTTP server"))
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(
        dest="bench_command", required=True)
    add_bench_serve_args(bench.add_parser(
        "serve", help="drive an OpenAI-compatible server with a load; report its latency"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deltaserve", description="deltaserve LLM engine")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _serve_parsers(sub)
    worker = sub.add_parser("worker", help="run one worker rank and join an engine",
                            description="Run one worker rank and join an engine.")
    add_worker_args(worker)
    _replay_parser(sub)
    _journal_parser(sub)
    from launch.cli import kernels, model_commands
    model_commands.add_parsers(sub)
    kernels.add_parsers(sub)
    args = parser.parse_args(argv)
    if args.command == "worker":
        from worker.worker_proc import run_worker
        return run_worker(args, worker)
    from common.process import configure_logging
    from launch.errors import EngineDeadError
    from protocol.journal import JournalError
    try:
        if args.command == "replay":
            return replay(args)
        if args.command == "journal":
            return journal(args)
        if args.command in ("download", "convert"):
            return model_commands.run(args)
        if args.command == "kernels":
            return kernels.run(args)
        if args.command in ("generate", "serve"):  # the front-end's startup lines show
            configure_logging(getattr(logging, getattr(args, "log_level", "info").upper()))
        if args.command == "serve":
            from launch.cli.serve import serve
            return serve(args)
        if args.command == "bench":
            from launch.cli.bench_serve import bench_serve
            return bench_serve(args)
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
