"""What a tool parser gives: the calls a model's text holds, whole (`extract`) or as a stream
of parts (`stream`): content text and tool-call deltas, in the order the model wrote them.

Invariant of every parser: feeding a text to a stream piece by piece, in any cut, yields
content parts that concatenate to `extract(text).content` (or "" for None) and, per call
index, one delta with the call's id and name followed by argument deltas that concatenate to
`extract(text).tool_calls[index].arguments`; the order of content and calls is the same for
every cut. Once a call's name is known its arguments stream as the model writes them (the
text of the arguments object, as written); text that never became a call is content, as it
is for `extract`. JSON is parsed with recursion guarded: no model output can raise.
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


# What a stream gives: content text and call deltas, in the order the model wrote them.
ToolParts = list[str | ToolCallDelta]


def parse_call(text: str) -> ToolCall | None:
    """`{"name": ..., "arguments" | "parameters": {...}}` as a call, or None (also for JSON
    nested deeper than the parser follows)."""
    try:
        value = json.loads(text)
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            arguments = json.loads(arguments)
        if not isinstance(arguments, dict):
            return None
        return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))
    except (ValueError, RecursionError):
        return None


def call_deltas(index: int, call: ToolCall) -> list[ToolCallDelta]:
    return [ToolCallDelta(index, call.id, call.name, ""),
            ToolCallDelta(index, arguments=call.arguments)]


class ToolStream(abc.ABC):
    """One sequence's streaming state."""

    @abc.abstractmethod
    def feed(self, text: str) -> ToolParts:
        """New model text in; content and call deltas out, in the order written."""

    @abc.abstractmethod
    def finish(self) -> ToolParts:
        """The sequence ended: whatever was held back."""


class ToolParser(abc.ABC):
    name: str
    arguments_key = "arguments"  # what the format calls a call's arguments

    @abc.abstractmethod
    def stream(self) -> ToolStream: ...

    @abc.abstractmethod
    def calls_rules(self, call_object: str, parallel: bool) -> str:
        """Lark rules whose `tool_calls` rule is one call (or several, if `parallel`) in this
        format; `call_object` is the rule body of one call object (`%json {...}`)."""

    def calls_grammar(self, tools: list[tuple[str, dict[str, Any]]], parallel: bool) -> str:
        """Lark rules (`tool_calls`) that hold an answer to calls of `tools` ((name,
        parameter schema) pairs) in this format, with the engine's JSON whitespace rule."""
        from engine_core.structured_output.grammar import answer_lark
        from protocol import StructuredOutputsParams
        schema = {"anyOf": [{"type": "object", "properties": {
            "name": {"const": name}, self.arguments_key: parameters},
            "required": ["name", self.arguments_key], "additionalProperties": False}
            for name, parameters in tools]}
        return self.calls_rules(answer_lark(StructuredOutputsParams(json=schema)), parallel)

    def extract(self, text: str) -> ExtractedToolCalls:
        """The whole text at once: the stream's own result, so both always agree."""
        stream = self.stream()
        content, calls = "", []
        for part in stream.feed(text) + stream.finish():
            if isinstance(part, str):
                content += part
            elif part.name is not None:
                calls.append(ToolCall(part.name, part.arguments, part.id))
            else:
                calls[part.index].arguments += part.arguments
        return ExtractedToolCalls(None if calls and not content else content, calls)
