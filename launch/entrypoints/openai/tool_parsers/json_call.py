"""A tool call written as one JSON object, read as the model writes it.

`CallScanner` reads `{"name": "<name>", "arguments" | "parameters": {...}}`: once the name
and the arguments key are known, the call's id and name are sent, then the arguments object
passes through piece by piece exactly as written (never re-serialized), so the pieces of any
cut concatenate to the same text. A call in another form (keys in another order, arguments
as a JSON string) is held until its object closes and parsed whole; a held object that does
not parse is not a call. Nesting is tracked with a counter, never by recursion, so any depth
is safe.

`JsonCallsStream` reads a run of such objects (llama3_json's `;`-separated calls, a forced
`required` answer's `[{...}, {...}]` list).
"""
from __future__ import annotations

import json

from launch.entrypoints.openai.tool_parsers.base import (
    ToolCallDelta,
    ToolParts,
    ToolStream,
    call_deltas,
    parse_call,
    tool_call_id,
)

MAX_HEAD_CHARS = 512  # a call whose name is not known within this many characters is held
_WS = " \t\r\n"


class CallScanner:
    """One call object; `feed` returns (deltas, the text after the object or None)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.state = "head"  # head -> args -> tail, or head -> held
        self.text = ""  # the object so far
        self.depth = 0
        self.in_string = self.escape = False
        self.args_start: int | None = None  # where depth first reached 2 (the value's "{")
        self.args_end: int | None = None  # just after depth came back to 1
        self.closed = False  # the object's final "}" has been read

    @property
    def committed(self) -> bool:
        """The call has been sent (its name is known): the text is a call whatever follows."""
        return self.state in ("args", "tail")

    def feed(self, text: str) -> tuple[list[ToolCallDelta], str | None]:
        end = self._scan(text)
        mine, rest = (text, None) if end < 0 else (text[:end], text[end:])
        sent = len(self.text)
        self.text += mine
        deltas: list[ToolCallDelta] = []
        if self.state == "head":
            status, value_at, name = _head(self.text)
            if status == "match":
                self.state, sent = "args", value_at
                deltas.append(ToolCallDelta(self.index, tool_call_id(), name, ""))
            elif status == "nomatch" or len(self.text) > MAX_HEAD_CHARS:
                self.state = "held"
        if self.state == "args":
            stop = len(self.text) if self.args_end is None else self.args_end
            if stop > sent:
                deltas.append(ToolCallDelta(self.index, arguments=self.text[sent:stop]))
            if self.args_end is not None:
                self.state = "tail"
        return deltas, rest

    def close(self) -> ToolParts | None:
        """The object ended (or the text did): a held object's call, [] when the call was
        already sent, None when it is not a call."""
        if self.committed:
            return []
        call = parse_call(self.text.strip())
        return None if call is None else list(call_deltas(self.index, call))

    def _scan(self, text: str) -> int:
        """Track nesting over `text`; the index just after the object closes, or -1."""
        base = len(self.text)
        for i, c in enumerate(text):
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
                if self.depth == 2 and self.args_start is None:
                    self.args_start = base + i
            elif c in "}]":
                self.depth -= 1
                if self.depth == 1 and self.args_start is not None and self.args_end is None:
                    self.args_end = base + i + 1
                if self.depth <= 0:
                    self.closed = True
                    return i + 1
        return -1


def _head(text: str) -> tuple[str, int, str]:
    """Whether `text` starts with `{"name": "<name>", "arguments": {` (or "parameters"),
    whitespace allowed between tokens: ("match", where the value starts, name), ("partial",
    ...) while it still may, ("nomatch", ...) once it cannot."""
    i = 0
    for expected in ("{", ('"name"',), ":", None, ",", ('"arguments"', '"parameters"'), ":"):
        i = _skip_ws(text, i)
        if i == len(text):
            return "partial", 0, ""
        if expected is None:  # the name: a JSON string
            end = _string_end(text, i)
            if end < 0:
                return ("partial" if text[i] == '"' else "nomatch"), 0, ""
            try:
                name = json.loads(text[i:end])
            except ValueError:
                return "nomatch", 0, ""
            i = end
            continue
        options = (expected,) if isinstance(expected, str) else expected
        rest = text[i:]
        hit = next((o for o in options if rest.startswith(o)), None)
        if hit is None:
            partial = any(o.startswith(rest) for o in options)
            return ("partial" if partial else "nomatch"), 0, ""
        i += len(hit)
    i = _skip_ws(text, i)
    if i == len(text):
        return "partial", 0, ""
    return ("match", i, name) if text[i] == "{" else ("nomatch", 0, "")


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _string_end(text: str, i: int) -> int:
    """The index after the JSON string starting at text[i] ('"'), or -1 if not closed."""
    if text[i] != '"':
        return -1
    j, escape = i + 1, False
    while j < len(text):
        c = text[j]
        if escape:
            escape = False
        elif c == "\\":
            escape = True
        elif c == '"':
            return j + 1
        j += 1
    return -1


class JsonCallsStream(ToolStream):
    """A run of call objects separated by `separators` (and whitespace), after an optional
    `prefix`. Text that is not a call (an object that does not parse, anything else between
    calls) is content from there on; `content=False` drops it instead (a forced answer,
    whose grammar allows nothing else, cut short)."""

    def __init__(self, separators: str, prefix: str = "", content: bool = True) -> None:
        self.separators = separators + _WS
        self.prefix = prefix
        self.keep_content = content
        self.buf = ""  # text not yet given to a call (between calls, or a partial prefix)
        self.lead = ""  # separators (and the prefix) skipped before the current call
        self.call: CallScanner | None = None
        self.num_calls = 0
        self.content = False  # everything from here on is content

    def feed(self, text: str) -> ToolParts:
        if self.content:
            return self._text(text)
        parts: ToolParts = []
        pending: str | None = self.buf + text
        self.buf = ""
        while pending:
            if self.call is None:
                pending = self._between(pending, parts)
                continue
            deltas, pending = self.call.feed(pending)
            parts += deltas
            if pending is not None:  # the object closed
                parts += self._end_call(pending)
                pending = "" if self.content else pending
        return parts

    def finish(self) -> ToolParts:
        parts: ToolParts = []
        if self.call is not None:
            parts += self._end_call("")
        elif self.num_calls == 0:  # separators or a part of the prefix, and nothing else
            parts += self._text(self.lead + self.buf)
        self.buf = self.lead = ""
        return parts

    def _between(self, text: str, parts: ToolParts) -> str:
        """Text outside a call: skip separators and the prefix; start a call at "{"."""
        i = 0
        while i < len(text) and text[i] in self.separators:
            i += 1
        rest = text[i:]
        at_start = self.prefix and self.num_calls == 0
        if at_start and rest.startswith(self.prefix):
            self.lead += text[:i + len(self.prefix)]
            return rest[len(self.prefix):]
        if not rest or (at_start and self.prefix.startswith(rest)):
            self.buf = text  # wait: separators only, or a part of the prefix
            return ""
        if rest[0] == "{":
            self.lead += text[:i]
            self.call = CallScanner(self.num_calls)
            return rest
        self.content = True
        parts += self._text(self.lead + text)
        self.lead = ""
        return ""

    def _end_call(self, rest: str) -> ToolParts:
        call, self.call = self.call, None
        assert call is not None
        result, lead, self.lead = call.close(), self.lead, ""
        if result is None:  # not a call: it and everything after it is content
            self.content = True
            return self._text(lead + call.text + rest)
        self.num_calls += 1
        return result

    def _text(self, text: str) -> ToolParts:
        return [text] if text and self.keep_content else []
