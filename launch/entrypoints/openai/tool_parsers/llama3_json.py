"""Llama 3.1+ JSON tool calls: the whole answer is `{"name": ..., "parameters": {...}}`
(or several, separated by `;`), optionally after `<|python_tag|>`. An answer that starts like
that is held until it ends and becomes calls if every part parses; otherwise it is content.
An answer that starts otherwise streams as content."""
from __future__ import annotations

import json

from launch.entrypoints.openai.tool_parsers.base import (
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolStream,
    call_deltas,
    parse_call,
)

PYTHON_TAG = "<|python_tag|>"


class JsonCallsStream(ToolStream):
    def __init__(self) -> None:
        self.buf = ""
        self.mode: str | None = None  # None: undecided; "calls"; "content"

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        if self.mode == "content":
            return text, []
        self.buf += text
        if self.mode is None:
            head = self.buf.lstrip()
            if head.startswith(("{", PYTHON_TAG)):
                self.mode = "calls"
            elif head and not PYTHON_TAG.startswith(head):
                self.mode = "content"
                out, self.buf = self.buf, ""
                return out, []
        return "", []

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        text, self.buf = self.buf, ""
        calls = parse_calls(text) if self.mode == "calls" else None
        if calls is None:
            return text, []
        return "", [d for i, call in enumerate(calls) for d in call_deltas(i, call)]


def parse_calls(text: str) -> list[ToolCall] | None:
    """Every `;`-separated JSON call in `text`, or None unless all of it is calls."""
    rest = text.strip().removeprefix(PYTHON_TAG).strip()
    decoder, calls = json.JSONDecoder(), []
    while rest:
        try:
            value, end = decoder.raw_decode(rest)
        except (ValueError, RecursionError):
            return None
        call = parse_call(json.dumps(value))
        if call is None:
            return None
        calls.append(call)
        rest = rest[end:].strip()
        if rest.startswith(";"):
            rest = rest[1:].strip()
        elif rest:
            return None
    return calls or None


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def stream(self) -> ToolStream:
        return JsonCallsStream()
