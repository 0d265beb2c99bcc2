"""Chat messages as a chat template reads them: every message shape OpenAI's API accepts,
normalized the way vLLM normalizes them before a Hugging Face template renders them.

- `content` null or absent is "" (templates concatenate it); a list of text parts is their
  texts joined by "\n" (a `refusal` part counts as text); other parts (images, audio, files)
  are a 400, since the model takes text only. This holds for every role.
- An assistant's `tool_calls` carry their `arguments` parsed back into objects (what templates
  render); `arguments` that are not a JSON object become {} (vLLM's rule: a malformed call in
  the history must not make every later turn fail), arguments nested deeper than the parser
  can follow are a 400. An empty `tool_calls` list is dropped.
- An assistant's earlier reasoning (`reasoning` or its older name `reasoning_content`) reaches
  the template under both names; `name` and a tool message's `tool_call_id` are kept.

A template that fails is a 400 naming the first message it fails on (found by rendering
prefixes of the conversation, a bounded number of times).
"""
from __future__ import annotations

import json
from typing import Any

from launch.entrypoints.openai.errors import APIError
from launch.entrypoints.openai.protocol import ChatMessage, MessageToolCall
from launch.processing.chat_template import ChatTemplate, ChatTemplateError

_TEXT_PARTS = {"text": "text", "refusal": "refusal", "input_text": "text",
               "output_text": "text"}


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages in the shape Hugging Face templates read (see the module's rules)."""
    out = []
    for i, m in enumerate(messages):
        message: dict[str, Any] = {"role": m.role, "content": _content(m.content, i)}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        reasoning = m.reasoning if m.reasoning is not None else m.reasoning_content
        if reasoning is not None:
            message["reasoning"] = message["reasoning_content"] = reasoning
        if m.tool_calls:
            message["tool_calls"] = [_template_call(c, i, j) for j, c in enumerate(m.tool_calls)]
        out.append(message)
    return out


def prompt_chars(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
    """What the messages and tools hold, in characters (bounded before rendering)."""
    chars = len(json.dumps(tools)) if tools else 0
    for m in messages:
        chars += len(m["content"]) + len(m.get("reasoning") or "")
        chars += sum(len(json.dumps(c["function"]["arguments"])) for c in m.get("tool_calls", ()))
    return chars


def render(template: ChatTemplate, messages: list[dict[str, Any]],
           add_generation_prompt: bool, tools: list[dict[str, Any]] | None) -> str:
    """The prompt; a template failure is a 400 naming the first message it fails on."""
    try:
        return template.render(messages, add_generation_prompt, tools=tools)
    except ChatTemplateError as e:
        where = _failing_message(template, messages, tools)
        prefix = f"messages[{where}]: " if where is not None else ""
        raise APIError(400, f"{prefix}{e}", "messages") from None
    except RecursionError:
        raise APIError(400, "the chat template failed: the messages nest too deeply",
                       "messages") from None


def _failing_message(template: ChatTemplate, messages: list[dict[str, Any]],
                     tools: list[dict[str, Any]] | None, max_renders: int = 16) -> int | None:
    """The smallest k such that messages[:k + 1] fails to render (binary search over
    prefixes, at most `max_renders` renders), or None if the prefixes all render."""
    def fails(k: int) -> bool:
        try:
            template.render(messages[:k + 1], False, tools=tools)
            return False
        except (ChatTemplateError, RecursionError):
            return True
    lo, hi = 0, len(messages) - 1
    if not fails(hi):
        return None
    for _ in range(max_renders):
        if lo >= hi:
            break
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fails(mid) else (mid + 1, hi)
    return hi


def _content(content: str | list[Any] | None, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        key = _TEXT_PARTS.get(kind)  # type: ignore[arg-type]
        if key is None or not isinstance(part.get(key), str):
            raise APIError(400, f"messages[{index}]: only text content parts are supported "
                           f"(this model reads text), got a part of type {kind!r}", "messages")
        texts.append(part[key])
    return "\n".join(texts)


def _template_call(call: MessageToolCall, index: int, position: int) -> dict[str, Any]:
    if call.type != "function":
        raise APIError(400, f"messages[{index}].tool_calls[{position}]: only function calls "
                       f"are supported, got type {call.type!r}", "messages")
    arguments = call.function.arguments
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            arguments = None
        except RecursionError:
            raise APIError(400, f"messages[{index}].tool_calls[{position}].function.arguments"
                           " nests too deeply", "messages") from None
    return {"id": call.id, "type": "function",
            "function": {"name": call.function.name,
                         "arguments": arguments if isinstance(arguments, dict) else {}}}
