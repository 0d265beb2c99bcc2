"""What a tool parser gives: the calls a model's text holds, whole (`extract`) or as a stream
of content and tool-call deltas (`stream`).

Invariant of every parser: feeding a text to a stream piece by piece, in any cut, yields
content deltas that concatenate to `extract(text).content` (or "" for None) and, per call
index, one delta with the call's id and name followed by argument deltas that concatenate to
`extract(text).tool_calls[index].arguments`. A stream emits a call only once the model has
written it whole and it parses, so no half-parsed call is ever sent; text that looked like
a call but does not parse is content, as it is for `extract`.
"""
from __future__ import annotations

import abc
import json
import secrets
from dataclasses import dataclass, field
from typing import Any


def tool_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=tool_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class ExtractedToolCalls:
    content: str | None  # the text outside the calls (None: only calls)
    tool_calls: list[ToolCall]

    @property
    def tools_called(self) -> bool:
        return bool(self.tool_calls)


@dataclass(slots=True)
class ToolCallDelta:
    """One streamed piece of call `index`: its id and name first, then argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        if self.name is not None:
            return {"index": self.index, "id": self.id, "type": "function",
                    "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": self.index, "function": {"arguments": self.arguments}}


def parse_call(text: str) -> ToolCall | None:
    """`{"name": ..., "arguments" | "parameters": {...}}` as a call, or None."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def call_deltas(index: int, call: ToolCall) -> list[ToolCallDelta]:
    return [ToolCallDelta(index, call.id, call.name, ""),
            ToolCallDelta(index, arguments=call.arguments)]


class ToolStream(abc.ABC):
    """One sequence's streaming state."""

    @abc.abstractmethod
    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """New model text in; (content delta, tool-call deltas) out."""

    @abc.abstractmethod
    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The sequence ended: whatever was held back."""


class ToolParser(abc.ABC):
    name: str

    @abc.abstractmethod
    def stream(self) -> ToolStream: ...

    def extract(self, text: str) -> ExtractedToolCalls:
        """The whole text at once: the stream's own result, so both always agree."""
        stream = self.stream()
        content, deltas = stream.feed(text)
        tail, more = stream.finish()
        calls: list[ToolCall] = []
        for delta in deltas + more:
            if delta.name is not None:
                calls.append(ToolCall(delta.name, delta.arguments, delta.id))
            else:
                calls[delta.index].arguments += delta.arguments
        content += tail
        return ExtractedToolCalls(None if calls and not content else content, calls)
