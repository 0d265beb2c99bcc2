"""`/v1/responses`: OpenAI's Responses API over the chat path. `POST` answers (whole, or
streamed as typed events), `GET` and `DELETE /v1/responses/{id}` read and drop a stored
response, `GET .../input_items` lists what it answered, `POST .../cancel` is a 400 (this
server runs no background responses).

A request becomes a chat request (`responses_protocol`), prepared, run and parsed exactly as
`/v1/chat/completions` does (`OpenAIServingChat.prepare`, `answer`, `answer_deltas`); its
answer's parts become output items (`output_items`). With `store` (the default) the finished
response and the conversation it answered are kept (`responses_store`), so a request with
`previous_response_id` continues that conversation (its `instructions` are not carried over,
as in OpenAI's API)."""
from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from launch.entrypoints.openai.errors import APIError
from launch.entrypoints.openai.output_items import ItemBuilder, whole_items
from launch.entrypoints.openai.protocol import read_body
from launch.entrypoints.openai.responses_output import (
    ResponseEvents,
    item_id,
    item_json,
    reasoning_tokens,
    status_of,
    usage_json,
)
from launch.entrypoints.openai.responses_protocol import (
    ResponsesRequest,
    chat_request,
    input_items,
)
from launch.entrypoints.openai.responses_store import ResponseStore
from launch.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat
from launch.entrypoints.openai.streaming import json_response
from launch.outputs import CompletionOutput, RequestOutput

# Chat-request fields as the Responses API names them, for error messages.
_RENAMED = (("response_format.json_schema.schema", "text.format.schema"),
            ("response_format", "text.format"), ("max_tokens", "max_output_tokens"),
            ("messages", "input"))


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponseStore) -> None:
        self.chat = chat
        self.store = store

    async def create(self, raw: Request) -> Response:
        body = await read_body(raw, ResponsesRequest)
        history = (self.store.get(body.previous_response_id, "previous_response_id").history
                   if body.previous_response_id else [])
        items = [*history, *input_items(body)]
        try:
            run = await self.chat.prepare(chat_request(body, items))
        except APIError as e:
            raise _renamed(e) from None
        rid = f"resp_{secrets.token_hex(24)}"
        if body.stream:
            return StreamingResponse(self._stream(rid, body, run, items),
                                     media_type="text/event-stream")
        out = await self.chat.answer(raw, run, rid)
        seq = out.outputs[0]
        status, incomplete = status_of(seq.finish_reason)
        built = whole_items(run.answers.parts(seq.text))
        output = [item_json(item, item_id(item), status if i == len(built) - 1 else "completed")
                  for i, item in enumerate(built)]
        response = self._response(rid, body, run, status, output,
                                  usage=self._usage(run, out, seq), incomplete=incomplete,
                                  error=_error(seq))
        if body.store:
            self.store.put(response, items)
        return json_response(response)

    async def get(self, response_id: str) -> Response:
        return json_response(self.store.get(response_id).response)

    async def delete(self, response_id: str) -> Response:
        if not self.store.delete(response_id):
            self.store.get(response_id)  # the 404
        return json_response({"id": response_id, "object": "response", "deleted": True})

    async def cancel(self, response_id: str) -> Response:
        self.store.get(response_id)
        raise APIError(400, "only background responses can be cancelled, and this server "
                       "runs no background responses (this one has finished)")

    async def input_items(self, response_id: str) -> Response:
        items = self.store.get(response_id).items
        return json_response({"object": "list", "data": items, "has_more": False,
                              "first_id": None, "last_id": None})

    def _response(self, rid: str, body: ResponsesRequest, run: ChatRun, status: str,
                  output: list[dict[str, Any]], *, usage: dict[str, Any] | None = None,
                  incomplete: dict[str, Any] | None = None,
                  error: dict[str, Any] | None = None, created: int | None = None
                  ) -> dict[str, Any]:
        params, tools = run.inputs.params, run.answers.tools
        fmt = (body.text or {}).get("format") or {"type": "text"}
        return {
            "id": rid, "object": "response", "created_at": created or int(time.time()),
            "status": status, "background": False, "error": error,
            "incomplete_details": incomplete, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "max_tool_calls": None,
            "model": run.model, "output": output,
            "parallel_tool_calls": tools.parallel,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": (body.reasoning or {}).get("effort"), "summary": None},
            "service_tier": "default", "store": body.store, "temperature": params.temperature,
            "text": {"format": fmt}, "tool_choice": _tool_choice(body.tool_choice, tools.mode),
            "tools": body.tools or [], "top_logprobs": 0, "top_p": params.top_p,
            "truncation": "disabled", "usage": usage, "user": body.user,
            "metadata": body.metadata or {}}

    def _usage(self, run: ChatRun, out: RequestOutput, seq: CompletionOutput
               ) -> dict[str, Any]:
        parser = self.chat.parsers.reasoning
        reasoning = 0
        if parser is not None:
            has_reasoning = bool(run.answers.parts(seq.text).reasoning)
            reasoning = reasoning_tokens(self.chat.engine.tokenizer, seq.token_ids, seq.text,
                                         has_reasoning, parser.end_tag)
        return usage_json(len(out.prompt_token_ids), len(seq.token_ids),
                          out.num_cached_tokens, reasoning)

    async def _stream(self, rid: str, body: ResponsesRequest, run: ChatRun,
                      items: list[dict[str, Any]]) -> AsyncIterator[bytes]:
        events, builder, created = ResponseEvents(), ItemBuilder(), int(time.time())
        text, token_ids, last = "", [], None
        try:
            started = self._response(rid, body, run, "in_progress", [], created=created)
            yield events.event("response.created", response=started)
            yield events.event("response.in_progress", response=started)
            async for out, seq, delta in self.chat.answer_deltas(run, rid):
                text += seq.text
                token_ids += seq.token_ids
                for e in builder.feed(delta):
                    for chunk in events.of_item(e):
                        yield chunk
                if seq.finish_reason is not None:
                    last = (out, seq, status_of(seq.finish_reason)[0])
                    for e in builder.finish():
                        for chunk in events.of_item(e, last[2]):
                            yield chunk
            assert last is not None
            out, seq, status = last
            whole = CompletionOutput(0, text, token_ids, finish_reason=seq.finish_reason,
                                     stop_reason=seq.stop_reason)
            output = [item_json(item, events.ids[i],
                                status if i == len(builder.items) - 1 else "completed")
                      for i, item in enumerate(builder.items)]
            response = self._response(rid, body, run, status, output,
                                      usage=self._usage(run, out, whole),
                                      incomplete=status_of(seq.finish_reason)[1],
                                      error=_error(seq), created=created)
            if body.store:
                self.store.put(response, items)
            kind = {"completed": "response.completed", "incomplete": "response.incomplete"}
            yield events.event(kind.get(status, "response.failed"), response=response)
        except Exception as e:  # a failure after the stream started: the response failed
            error = e if isinstance(e, APIError) else APIError(500, f"internal error: {e!r}")
            failed = self._response(rid, body, run, "failed", [], created=created,
                                    error={"code": str(error.code), "message": error.message})
            yield events.event("response.failed", response=failed)


def _renamed(e: APIError) -> APIError:
    message, param = e.message, e.param
    for old, new in _RENAMED:
        if old != "messages":  # messages[i] counts the instructions too: kept as it is
            message = message.replace(old, new)
        param = new.split(".")[0] if param == old else param
    return APIError(e.status, message, param, e.code)


def _error(seq: CompletionOutput) -> dict[str, Any] | None:
    if seq.finish_reason != "error":
        return None
    return {"code": "server_error", "message": f"generation failed: {seq.stop_reason}"}


def _tool_choice(choice: Any, mode: str) -> Any:
    return choice if choice is not None else mode
