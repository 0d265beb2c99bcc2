"""The Responses API's request body (`POST /v1/responses`) and its translation into the chat
request every chat-like route prepares the same way (`ChatCompletionRequest`).

Input items become chat messages: `instructions` a system message first; a `message` item
(roles user, assistant, system, developer as system) its role and text parts; consecutive
`function_call` items the tool calls of one assistant message (joining the assistant text
right before them); a `function_call_output` item a tool message; a `reasoning` item the
reasoning of the assistant message that follows. Tools are function tools; `text.format`
becomes `response_format`, `max_output_tokens` `max_tokens`.
"""
from __future__ import annotations

from typing import Any

import msgspec

from launch.entrypoints.openai.errors import APIError
from launch.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    MessageToolCall,
    ToolCallFunction,
)

_ROLES = {"user": "user", "assistant": "assistant", "system": "system",
          "developer": "system"}
# vLLM's sampling extras the route passes on, as SamplingParams names them.
_EXTRAS = ("top_k", "min_p", "seed", "stop", "repetition_penalty", "presence_penalty",
           "frequency_penalty", "structured_outputs")


class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    input: str | list[Any] = msgspec.field(default_factory=list)
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    store: bool = True
    previous_response_id: str | None = None
    background: bool | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    user: str | None = None
    truncation: str | None = None
    top_k: Any = None
    min_p: Any = None
    seed: Any = None
    stop: Any = None
    repetition_penalty: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    structured_outputs: Any = None  # vLLM's: constrains the model's whole text as written


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's own input as a list of items."""
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": body.input}]
    return list(body.input)


def chat_request(body: ResponsesRequest, items: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request answering `items` (the conversation so far, this request's input
    last) under this request's settings; 400 naming the field for anything unsupported."""
    if body.background:
        raise APIError(400, "background responses are not supported by this server",
                       "background")
    if body.top_logprobs:
        raise APIError(400, "top_logprobs is not supported on /v1/responses", "top_logprobs")
    messages = ([ChatMessage(role="system", content=body.instructions)]
                if body.instructions else [])
    messages += _messages(items)
    if not messages:
        raise APIError(400, "input must hold at least one item", "input")
    return ChatCompletionRequest(
        messages=messages, model=body.model, tools=_tools(body.tools),
        tool_choice=_tool_choice(body.tool_choice), parallel_tool_calls=body.parallel_tool_calls,
        response_format=_response_format(body.text), max_tokens=body.max_output_tokens,
        temperature=body.temperature, top_p=body.top_p,
        **{name: getattr(body, name) for name in _EXTRAS})


def _messages(items: list[Any]) -> list[ChatMessage]:
    messages: list[ChatMessage] = []
    reasoning: str | None = None  # a reasoning item's text, for the next assistant message
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise APIError(400, f"input[{i}] must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise APIError(400, f"input[{i}].role must be one of {', '.join(_ROLES)}",
                               "input")
            content = item.get("content")
            if not isinstance(content, str | list | None):
                raise APIError(400, f"input[{i}].content must be text or a list of parts",
                               "input")
            messages.append(ChatMessage(role=role, content=content,
                                        reasoning=reasoning if role == "assistant" else None))
            reasoning = None if role == "assistant" else reasoning
        elif kind == "function_call":
            call = MessageToolCall(id=_text(item, "call_id", i), function=ToolCallFunction(
                name=_text(item, "name", i), arguments=item.get("arguments") or "{}"))
            last = messages[-1] if messages else None
            if last is None or last.role != "assistant":
                last = ChatMessage(role="assistant", content=None, reasoning=reasoning)
                messages.append(last)
                reasoning = None
            last.tool_calls = [*(last.tool_calls or ()), call]
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str | list):
                raise APIError(400, f"input[{i}].output must be text or a list of parts",
                               "input")
            messages.append(ChatMessage(role="tool", content=output,
                                        tool_call_id=_text(item, "call_id", i)))
        elif kind == "reasoning":
            reasoning = (reasoning or "") + _reasoning_text(item)
        else:
            raise APIError(400, f"input[{i}] has type {kind!r}; supported: message, "
                           "function_call, function_call_output, reasoning", "input")
    return messages


def _text(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"input[{i}].{key} must be a string", "input")
    return value


def _reasoning_text(item: dict[str, Any]) -> str:
    parts = item.get("content") or item.get("summary") or []
    return "".join(p.get("text", "") for p in parts if isinstance(p, dict)
                   and isinstance(p.get("text"), str))


def _tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise APIError(400, f"tools[{i}] has type {kind!r}; this server runs function "
                           "tools only", "tools")
        function = {key: tool[key] for key in ("name", "description", "parameters")
                    if tool.get(key) is not None}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or "
                           '{"type": "function", "name": ...}', "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {
            "name": fmt.get("name"), "schema": fmt.get("schema"), "strict": fmt.get("strict")}}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise APIError(400, "text.format.type must be one of text, json_object, json_schema",
                   "text")
