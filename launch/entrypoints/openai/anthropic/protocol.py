"""Anthropic's Messages request body, its translation into the chat request every chat-like
route prepares alike, and Anthropic's error shape.

`system` becomes a system message; a user turn's `tool_result` blocks become tool messages
(in order, before the turn's text), its text blocks a user message; an assistant turn's text
blocks its content, `tool_use` blocks its tool calls, `thinking` blocks its reasoning.
`tools` (`input_schema`) become function tools; `tool_choice` auto, any, tool and none become
"auto", "required", a named function and "none" (`disable_parallel_tool_use`:
`parallel_tool_calls: false`); `stop_sequences` become `stop`. Images and documents are
refused (the model reads text).
"""
from __future__ import annotations

import json
from typing import Any

import msgspec
from fastapi.responses import JSONResponse

from launch.entrypoints.openai.errors import APIError
from launch.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    MessageToolCall,
    ToolCallFunction,
)

ANTHROPIC_PATHS = ("/v1/messages",)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 408: "timeout_error",
                413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


class MessagesRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    messages: list[Any]
    max_tokens: int
    system: str | list[Any] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class CountTokensRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    messages: list[Any]
    system: str | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None


def anthropic_error(error: APIError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=error.status)


def error_body(error: APIError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(error.status, "api_error"),
                                       "message": error.message}}


def chat_request(body: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The chat request of a Messages body; 400 naming the field for anything unsupported."""
    messages = []
    if body.system:
        messages.append(ChatMessage(role="system", content=_text(body.system, "system")))
    for i, message in enumerate(body.messages):
        messages += _turn(message, i)
    parallel, tool_choice = _tool_choice(body.tool_choice)
    fields: dict[str, Any] = {}
    if isinstance(body, MessagesRequest):
        fields = {"max_tokens": body.max_tokens, "temperature": body.temperature,
                  "top_p": body.top_p, "top_k": body.top_k, "stop": body.stop_sequences}
    return ChatCompletionRequest(messages=messages, model=body.model, tools=_tools(body.tools),
                                 tool_choice=tool_choice, parallel_tool_calls=parallel,
                                 **fields)


def _turn(message: Any, i: int) -> list[ChatMessage]:
    where = f"messages[{i}]"
    role = message.get("role") if isinstance(message, dict) else None
    if role not in ("user", "assistant"):
        raise APIError(400, f"{where}.role must be user or assistant", "messages")
    content = message.get("content")
    if isinstance(content, str):
        return [ChatMessage(role=role, content=content)]
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be text or a list of blocks", "messages")
    texts, calls, results, thinking = [], [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            calls.append(MessageToolCall(id=block.get("id"), function=ToolCallFunction(
                name=block.get("name"), arguments=json.dumps(block.get("input") or {}))))
        elif kind == "tool_result" and role == "user":
            results.append(ChatMessage(role="tool", tool_call_id=block.get("tool_use_id"),
                                       content=_text(block.get("content") or "", at)))
        elif kind == "thinking" and role == "assistant":
            thinking.append(block.get("thinking") or "")
        elif kind != "redacted_thinking":
            raise APIError(400, f"{at} has type {kind!r}; supported: text, tool_use and "
                           "thinking (assistant), tool_result (user); the model reads text",
                           "messages")
    turn = ChatMessage(role=role, content="\n".join(texts),
                       tool_calls=calls or None, reasoning="".join(thinking) or None)
    return [*results, turn] if texts or calls or thinking or not results else results


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                         and isinstance(b.get("text"), str) for b in content):
        return "\n".join(b["text"] for b in content)
    raise APIError(400, f"{where} must be text or a list of text blocks", "messages")


def _tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) \
                or tool.get("type") not in (None, "custom"):
            raise APIError(400, f"tools[{i}] must be a client tool {{name, description, "
                           "input_schema}} (this server runs no server tools)", "tools")
        function = {"name": tool["name"], "parameters": tool.get("input_schema") or {}}
        if tool.get("description"):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: dict[str, Any] | None) -> tuple[bool | None, Any]:
    """(parallel_tool_calls, tool_choice) of Anthropic's `tool_choice`."""
    if choice is None:
        return None, None
    parallel = False if choice.get("disable_parallel_tool_use") else None
    kind = choice.get("type")
    if kind == "tool" and isinstance(choice.get("name"), str):
        return parallel, {"type": "function", "function": {"name": choice["name"]}}
    modes = {"auto": "auto", "any": "required", "none": "none"}
    if kind not in modes:
        raise APIError(400, "tool_choice.type must be auto, any, tool (with name) or none",
                       "tool_choice")
    return parallel, modes[kind]
