"""`deltaserve serve`: flags, engine start, uvicorn, and an orderly exit on SIGTERM/Ctrl-C.

Exit order: stop accepting connections, end in-flight streams with an error event (their
requests fail with EngineDeadError "shutting down"), stop the engine's processes, remove its
runtime directory, exit 0.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from types import FrameType
from typing import TYPE_CHECKING, Any

from launch.cli.engine_args import add_engine_args, engine_kwargs
from launch.entrypoints.openai.chat_answer import ChatParsers
from launch.entrypoints.openai.http_limits import HttpLimits, bounded_h11_protocol
from launch.entrypoints.openai.reasoning import REASONING_PARSERS, get_reasoning_parser
from launch.entrypoints.openai.responses_store import DEFAULT_MAX_BYTES, DEFAULT_MAX_RESPONSES
from launch.entrypoints.openai.serving_lora import add_lora_args, parse_lora_modules
from launch.entrypoints.openai.tool_parsers import TOOL_PARSERS, get_tool_parser
from launch.errors import EngineDeadError

if TYPE_CHECKING:
    from fastapi import FastAPI

    from launch.async_llm import AsyncLLM
    from launch.metrics.prometheus import PrometheusStatLogger

logger = logging.getLogger("deltaserve")
EXIT_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", nargs="+",
                        help="the model name(s) clients may send; the first is reported in "
                             "responses and metrics (default: --model, exactly as given)")
    parser.add_argument("--api-key", help="require `Authorization: Bearer KEY` on every route "
                        "but /health, /version and /metrics (prefer $DELTASERVE_API_KEY or "
                        "--api-key-file: a flag's value is visible to every local user in ps)")
    parser.add_argument("--api-key-file", help="read the API key from this file (first line)")
    parser.add_argument("--chat-template", help="a Jinja chat template file, for a model "
                        "without one or to override its own")
    parser.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"])
    _add_chat_parser_args(parser)
    _add_http_limit_args(parser)
    add_lora_args(parser)
    add_engine_args(parser)


def _add_chat_parser_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("tool calls and reasoning")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='let the model decide to call tools (tool_choice "auto"); needs '
                            "--tool-call-parser")
    group.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS),
                       help="how the model writes tool calls (hermes: Qwen2.5/Qwen3 "
                            "<tool_call>{...}</tool_call>; llama3_json: Llama 3.x JSON)")
    group.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS),
                       help="move <think>...</think> into reasoning (and reasoning_content); "
                            "a structured-output constraint then holds the answer after it")
    group.add_argument("--responses-store-max-responses", type=int,
                       default=DEFAULT_MAX_RESPONSES,
                       help="/v1/responses keeps at most this many stored responses (store: "
                            "true), least recently used out first (default %(default)s)")
    group.add_argument("--responses-store-max-bytes", type=int, default=DEFAULT_MAX_BYTES,
                       help="... and at most this many bytes of them, as JSON (default "
                            "%(default)s)")


def chat_parsers(args: argparse.Namespace) -> ChatParsers:
    """The parsers `serve` was started with; ValueError for an incomplete pair of flags."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    tool_parser = (get_tool_parser(args.tool_call_parser)
                   if args.enable_auto_tool_choice else None)
    reasoning = get_reasoning_parser(args.reasoning_parser) if args.reasoning_parser else None
    return ChatParsers(tool_parser, reasoning)


def _add_http_limit_args(parser: argparse.ArgumentParser) -> None:
    d = HttpLimits()
    group = parser.add_argument_group("HTTP limits")
    group.add_argument("--h11-max-incomplete-event-size", type=int,
                       default=d.max_incomplete_event_size,
                       help="the most bytes of one request's line and headers (default "
                            "%(default)s); more is answered 400 and the connection closed")
    group.add_argument("--h11-max-header-count", type=int, default=d.max_header_count,
                       help="the most headers of one request (default %(default)s; 431 above)")
    group.add_argument("--limit-concurrency", type=int, default=d.limit_concurrency,
                       help="open connections (or requests) before new requests are answered "
                            "503 (default %(default)s)")
    group.add_argument("--timeout-keep-alive", type=int, default=d.timeout_keep_alive_s,
                       help="seconds an idle keep-alive connection stays open (default "
                            "%(default)s)")
    group.add_argument("--request-header-timeout", type=float, default=d.header_timeout_s,
                       help="seconds for a request's headers to arrive once a connection is "
                            "open or idle (default %(default)s); the connection is closed "
                            "after")
    group.add_argument("--request-body-timeout", type=float, default=d.body_timeout_s,
                       help="seconds for a request's body to arrive (default %(default)s; 408 "
                            "after)")


def http_limits(args: argparse.Namespace) -> HttpLimits:
    limits = HttpLimits(args.h11_max_incomplete_event_size, args.h11_max_header_count,
                        args.request_header_timeout, args.request_body_timeout,
                        args.limit_concurrency, args.timeout_keep_alive)
    for flag, value in (("--h11-max-incomplete-event-size", limits.max_incomplete_event_size),
                        ("--h11-max-header-count", limits.max_header_count),
                        ("--request-header-timeout", limits.header_timeout_s),
                        ("--request-body-timeout", limits.body_timeout_s),
                        ("--limit-concurrency", limits.limit_concurrency),
                        ("--timeout-keep-alive", limits.timeout_keep_alive_s)):
        if not value > 0:
            raise ValueError(f"{flag} must be positive, got {value}")
    return limits


def api_key_of(args: argparse.Namespace) -> str | None:
    """--api-key, else the first line of --api-key-file, else $DELTASERVE_API_KEY."""
    if args.api_key_file is not None:
        try:
            with open(args.api_key_file) as f:
                key = f.readline().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--api-key-file: cannot read {args.api_key_file!r}: {e}") from None
        if not key:
            raise ValueError(f"--api-key-file: {args.api_key_file!r} holds no key")
        return key
    return args.api_key or os.environ.get("DELTASERVE_API_KEY") or None


def _graceful_server(config, on_exit):
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn's server, telling the app's streams to end as soon as a signal arrives
        (uvicorn would otherwise wait for them before its shutdown)."""

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            on_exit()
            super().handle_exit(sig, frame)
    return GracefulServer(config)


def _exit_zero(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def _check_port(host: str, port: int) -> None:
    """Fail before the slow engine start if the address cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None


def serve(args: argparse.Namespace) -> int:
    from launch.async_llm import AsyncLLM
    from launch.metrics.prometheus import PrometheusStatLogger
    _check_port(args.host, args.port)
    names = args.served_model_name or [args.model]
    options = _app_options(args)
    previous = {sig: signal.signal(sig, _exit_zero) for sig in EXIT_SIGNALS}
    engine = None
    try:
        metrics = PrometheusStatLogger(names[0])
        engine = AsyncLLM(args.model, stat_loggers=[metrics], **engine_kwargs(args))
        metrics.log_cache_config(engine.config, engine.engine.readies)
        metrics.log_lora_config(engine.config)
        app = _app(engine, args, names, metrics, options)
        logger.info("serving %s as %r on http://%s:%d", args.model, names[0], args.host,
                    args.port)
        if not _run_server(engine, app, args, options["limits"]):
            print(f"deltaserve: error: the server did not start on {args.host}:{args.port}",
                  file=sys.stderr)
            return 1
    except SystemExit as e:  # a signal (code 0), or uvicorn failing to start
        return e.code if isinstance(e.code, int) else 1
    finally:
        for sig in EXIT_SIGNALS:  # a second signal must not cut the cleanup short
            signal.signal(sig, signal.SIG_IGN)
        if engine is not None:
            engine.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _app_options(args: argparse.Namespace) -> dict[str, Any]:
    """build_app's keyword arguments that come from the flags alone (checked before the slow
    engine start): API key, HTTP limits, chat parsers, LoRA modules."""
    options = dict(api_key=api_key_of(args), limits=http_limits(args),
                   chat_parsers=chat_parsers(args))
    lora_modules = parse_lora_modules(args.lora_modules)
    runtime_lora = args.allow_runtime_lora_updating or os.environ.get(
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true")
    if (lora_modules or runtime_lora) and not args.enable_lora:
        raise ValueError("--lora-modules and --allow-runtime-lora-updating need --enable-lora")
    if args.chat_template is not None and not os.path.isfile(args.chat_template):
        raise ValueError(f"--chat-template: no such file {args.chat_template!r}")
    return options | dict(lora_modules=lora_modules, allow_runtime_lora_updating=runtime_lora)


def _app(engine: AsyncLLM, args: argparse.Namespace, names: list[str],
         metrics: PrometheusStatLogger, options: dict[str, Any]) -> FastAPI:
    from launch.entrypoints.openai.api_server import build_app
    from launch.entrypoints.openai.responses_store import ResponseStore
    from launch.processing.chat_template import ChatTemplate
    return build_app(engine, names, metrics=metrics,
                     chat_template=ChatTemplate.load(engine.config.model, args.chat_template),
                     responses_store=ResponseStore(args.responses_store_max_responses,
                                                   args.responses_store_max_bytes),
                     **options)


def _run_server(engine: AsyncLLM, app: FastAPI, args: argparse.Namespace,
                limits: HttpLimits) -> bool:
    """Serve `app` until a signal; False if uvicorn did not start. A signal ends the
    engine's in-flight streams at once (their requests fail "shutting down")."""
    import uvicorn
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=False, timeout_graceful_shutdown=5,
                            http=bounded_h11_protocol(limits),
                            h11_max_incomplete_event_size=limits.max_incomplete_event_size,
                            limit_concurrency=limits.limit_concurrency,
                            timeout_keep_alive=limits.timeout_keep_alive_s)
    loop_of: dict[str, asyncio.AbstractEventLoop] = {}
    shutting_down = EngineDeadError("the server is shutting down", "front-end")

    def on_exit() -> None:
        loop = loop_of.get("loop")
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(engine.fail_all, shutting_down)
    server = _graceful_server(config, on_exit)

    async def run() -> None:
        loop_of["loop"] = asyncio.get_running_loop()
        await server.serve()
    uvicorn_loop(run)
    return server.started


def uvicorn_loop(main) -> None:
    """Run `main()` on uvloop where available (as uvicorn's "auto" loop would)."""
    try:
        import uvloop
        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    with runner:
        runner.run(main())
