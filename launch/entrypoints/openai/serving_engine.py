"""What the completion and chat routes share: the engine, model names, submitting a request's
prompts, merging their streams, server-sent events and client disconnects."""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import msgspec
from fastapi import Request, Response

from launch.async_llm import AsyncLLM
from launch.entrypoints.openai.errors import APIError
from launch.errors import EngineDeadError
from launch.outputs import RequestOutput, RequestOutputKind
from launch.processing.input_processor import ProcessedInput
from launch.processing.request_stream import RequestStream

T = TypeVar("T")
_END = object()


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, served_model_name: str) -> None:
        self.engine = engine
        self.model_name = served_model_name

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                           f"{self.model_name!r}", "model", "model_not_found")

    def check_alive(self) -> None:
        if self.engine.dead is not None:
            raise APIError(503, f"the engine is not available: {self.engine.dead}")

    def process(self, prompt: Any, params: Any, add_special_tokens: bool = True
                ) -> ProcessedInput:
        try:
            return self.engine.process_inputs(prompt, params, add_special_tokens)
        except ValueError as e:
            raise APIError.bad_request(e) from None

    def submit(self, request_id: str, inputs: list[ProcessedInput],
               kind: RequestOutputKind) -> list[RequestStream]:
        """Submit every (already validated) prompt; on failure abort the ones submitted."""
        self.check_alive()
        streams: list[RequestStream] = []
        try:
            for i, processed in enumerate(inputs):
                streams.append(self.engine.add_request(f"{request_id}-{i}", processed,
                                                       output_kind=kind))
        except EngineDeadError as e:
            self.abort(streams)
            raise APIError(503, f"the engine is not available: {e}") from None
        return streams

    def abort(self, streams: list[RequestStream]) -> None:
        for stream in streams:
            if not stream.finished:
                self.engine.abort_request(stream.request_id)

    async def collect(self, streams: list[RequestStream]) -> list[RequestOutput]:
        """The final output of each stream (FINAL_ONLY streams yield just that)."""
        async def last(stream: RequestStream) -> RequestOutput:
            out = None
            async for out in stream:
                pass
            assert out is not None
            return out
        try:
            return list(await asyncio.gather(*(last(s) for s in streams)))
        except EngineDeadError as e:
            raise APIError(503, f"the engine is not available: {e}") from None
        finally:
            self.abort(streams)  # cancelled (a disconnect) or failed: free the engine's work


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
    if isinstance(error, APIError):
        return sse(error.body())
    status = 503 if isinstance(error, EngineDeadError) else 500
    return sse(APIError(status, f"the stream ended early: {error}").body())
