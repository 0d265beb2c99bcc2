"""What the routes' responses are made of: a request's output streams merged as they come,
work cancelled when the client disconnects, JSON bodies, server-sent events and the error
event that ends a stream."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import msgspec
from fastapi import Request, Response

from launch.entrypoints.openai.errors import APIError
from launch.errors import EngineDeadError
from launch.outputs import RequestOutput
from launch.processing.request_stream import RequestStream

logger = logging.getLogger("deltaserve")
T = TypeVar("T")
_END = object()


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) from all streams as they come; aborts what is left unread."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
            queue.put_nowait((i, _END))
        except BaseException as e:
            queue.put_nowait((i, e))
    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work` unless the client disconnects first (then cancel it; the caller's cleanup
    aborts its requests). A disconnect is the ASGI `http.disconnect` after the body."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        raise APIError(499, "the client disconnected")
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


_encoder = msgspec.json.Encoder()


def sse(data: Any) -> bytes:
    return b"data: " + _encoder.encode(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def json_response(data: Any, status: int = 200) -> Response:
    return Response(_encoder.encode(data), status_code=status, media_type="application/json")


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def stream_error(error: BaseException) -> bytes:
    """The error event that ends a stream (then `[DONE]`): never a dropped connection."""
    if isinstance(error, APIError):
        return sse(error.body())
    if isinstance(error, ValueError):
        return sse(APIError.bad_request(error).body())
    if isinstance(error, EngineDeadError):
        return sse(APIError(503, f"the stream ended early: {error}").body())
    logger.error("a stream failed", exc_info=error)
    return sse(APIError(500, f"the stream ended early: internal error {error!r}").body())
