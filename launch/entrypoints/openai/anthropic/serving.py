"""`POST /v1/messages` and `/v1/messages/count_tokens`: a Messages body becomes a chat request
(`protocol`), prepared, run and parsed exactly as `/v1/chat/completions` does; the answer's
items (`output_items`) become content blocks (`thinking`, `text`, `tool_use`), whole or as
Anthropic's stream events (`message_start`, `content_block_start`/`_delta`/`_stop`,
`message_delta`, `message_stop`; `error` for a failure after the stream started). A
`tool_use` block's `input` is its arguments parsed (a call cut by `max_tokens`: as much as
parses, partial JSON allowed)."""
from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pydantic_core
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse

from launch.entrypoints.openai.anthropic.protocol import (
    CountTokensRequest,
    MessagesRequest,
    anthropic_error,
    chat_request,
    error_body,
)
from launch.entrypoints.openai.chat_request import plan_chat
from launch.entrypoints.openai.errors import APIError
from launch.entrypoints.openai.output_items import ItemBuilder, ItemEvent, OutputItem, whole_items
from launch.entrypoints.openai.protocol import read_body
from launch.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat
from launch.entrypoints.openai.streaming import json_response, stream_error
from launch.entrypoints.openai.structured_outputs import Constraint
from launch.outputs import CompletionOutput

_encoder = msgspec.json.Encoder()


class AnthropicServingMessages:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create(self, raw: Request) -> Response:
        body = await read_body(raw, MessagesRequest)
        run = await self.chat.prepare(chat_request(body))
        mid = f"msg_{secrets.token_hex(12)}"
        if body.stream:
            return StreamingResponse(self._stream(mid, run), media_type="text/event-stream")
        out = await self.chat.answer(raw, run, mid)
        seq = out.outputs[0]
        _check_finished(seq)
        items = whole_items(run.answers.parts(seq.text))
        stop_reason, stop_sequence = _stop(seq, items)
        return json_response({
            "id": mid, "type": "message", "role": "assistant", "model": run.model,
            "content": [_block(item) for item in items], "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": _usage(len(out.prompt_token_ids), len(seq.token_ids),
                            out.num_cached_tokens)})

    async def count_tokens(self, raw: Request) -> Response:
        body = await read_body(raw, CountTokensRequest)
        chat = self.chat
        chat.check_model(body.model)
        request = chat_request(body)
        tokenizer = chat.engine.tokenizer
        if tokenizer is None:
            raise APIError(400, "the model directory has no tokenizer")

        partial: list[Constraint] = []

        def count() -> int:
            plan = plan_chat(request, chat.template, chat.parsers,
                             chat.engine.inputs.max_prompt_chars, partial.append)
            return len(tokenizer.encode(plan.prompt, add_special_tokens=False))
        tokens = await chat.off_loop(count)
        await chat.check_constraints(partial)
        return json_response({"input_tokens": tokens})

    async def _stream(self, mid: str, run: ChatRun) -> AsyncIterator[bytes]:
        builder, generated = ItemBuilder(), 0
        try:
            yield _event("message_start", message={
                "id": mid, "type": "message", "role": "assistant", "content": [],
                "model": run.model, "stop_reason": None, "stop_sequence": None,
                "usage": _usage(len(run.inputs.prompt_token_ids), 0, 0)})
            async for out, seq, delta in self.chat.answer_deltas(run, mid):
                generated += len(seq.token_ids)
                for e in builder.feed(delta):
                    yield _block_event(e)
                if seq.finish_reason is not None:
                    _check_finished(seq)
                    for e in builder.finish():
                        yield _block_event(e)
                    stop_reason, stop_sequence = _stop(seq, builder.items)
                    yield _event("message_delta", delta={
                        "stop_reason": stop_reason, "stop_sequence": stop_sequence},
                        usage=_usage(len(out.prompt_token_ids), generated,
                                     out.num_cached_tokens))
            yield _event("message_stop")
        except Exception as e:  # a failure after the stream started: an error event
            error = e if isinstance(e, APIError) else None
            if error is None:
                stream_error(e)  # logs an unexpected failure
                error = APIError(500, f"the stream ended early: {e!r}")
            yield _event("error", error=error_body(error)["error"])


def add_messages_routes(app: FastAPI, messages: AnthropicServingMessages) -> None:
    app.post("/v1/messages")(messages.create)
    app.post("/v1/messages/count_tokens")(messages.count_tokens)


def _check_finished(seq: CompletionOutput) -> None:
    """Anthropic has no stop reason for a failed generation: it is an error."""
    if seq.finish_reason == "error":
        raise APIError(500, f"generation failed: {seq.stop_reason}")


def _stop(seq: CompletionOutput, items: list[OutputItem]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished sequence."""
    if seq.finish_reason == "length":
        return "max_tokens", None
    if any(item.kind == "call" for item in items):
        return "tool_use", None
    if isinstance(seq.stop_reason, str):
        return "stop_sequence", seq.stop_reason
    return "end_turn", None


def _usage(prompt: int, output: int, cached: int) -> dict[str, int]:
    """Anthropic's count: `input_tokens` are the prompt tokens not read from the cache
    (the prefix cache's hits are `cache_read_input_tokens`)."""
    return {"input_tokens": prompt - cached, "output_tokens": output,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def _block(item: OutputItem) -> dict[str, Any]:
    if item.kind == "reasoning":
        return {"type": "thinking", "thinking": item.text, "signature": ""}
    if item.kind == "text":
        return {"type": "text", "text": item.text}
    return {"type": "tool_use", "id": item.call_id, "name": item.name,
            "input": tool_input(item.text)}


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as an object: parsed, or as much as parses of a cut call."""
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        try:
            value = pydantic_core.from_json(arguments, allow_partial=True)
        except ValueError:
            value = None
    return value if isinstance(value, dict) else {}


def _block_event(e: ItemEvent) -> bytes:
    if e.kind == "open":
        start = _block(OutputItem(e.item.kind, "", e.item.call_id, e.item.name))
        return _event("content_block_start", index=e.index, content_block=start)
    if e.kind == "close":
        return _event("content_block_stop", index=e.index)
    kind = e.item.kind
    delta = ({"type": "thinking_delta", "thinking": e.delta} if kind == "reasoning" else
             {"type": "text_delta", "text": e.delta} if kind == "text" else
             {"type": "input_json_delta", "partial_json": e.delta})
    return _event("content_block_delta", index=e.index, delta=delta)


def _event(kind: str, **fields: Any) -> bytes:
    return (b"event: " + kind.encode() + b"\ndata: "
            + _encoder.encode({"type": kind, **fields}) + b"\n\n")


__all__ = ["AnthropicServingMessages", "add_messages_routes", "anthropic_error"]
