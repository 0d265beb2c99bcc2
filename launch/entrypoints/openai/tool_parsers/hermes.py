"""The Hermes format (Qwen2.5, Qwen3, Hermes models): each call is
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in the text.

Content is the text outside the calls, without the whitespace that only separates it from a
call; a block that does not parse as a call stays in the content, tags and all.
"""
from __future__ import annotations

from launch.entrypoints.openai.tool_parsers.base import (
    ToolCallDelta,
    ToolParser,
    ToolStream,
    call_deltas,
    parse_call,
)
from launch.processing.detokenizer import partial_suffix


class TaggedToolStream(ToolStream):
    def __init__(self, start: str, end: str) -> None:
        self.start, self.end = start, end
        self.buf = ""
        self.inside = False
        self.pending_ws = ""  # trailing content whitespace: dropped if a call follows
        self.held_ws = ""  # the whitespace before the open block, until it resolves
        self.after_call = False  # content right after a call loses its leading whitespace
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self.buf += text
        content, deltas = [], []
        while True:
            if self.inside:
                j = self.buf.find(self.end)
                if j < 0:
                    break
                block, self.buf = self.buf[:j], self.buf[j + len(self.end):]
                self._close(block, self.end, content, deltas)
            else:
                i = self.buf.find(self.start)
                if i < 0:
                    keep = partial_suffix(self.buf, self.start)
                    content.append(self._content(self.buf[:len(self.buf) - keep]))
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                content.append(self._content(self.buf[:i]))
                self.buf = self.buf[i + len(self.start):]
                self.inside, self.held_ws, self.pending_ws = True, self.pending_ws, ""
        return "".join(content), deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        if self.inside:  # an unclosed call: whole if it parses (the model stopped after it)
            self._close(self.buf, "", content, deltas)
        else:
            content.append(self._content(self.buf))
        self.buf = ""
        content.append(self.pending_ws)
        self.pending_ws = ""
        return "".join(content), deltas

    def _close(self, block: str, end: str, content: list[str],
               deltas: list[ToolCallDelta]) -> None:
        self.inside = False
        call = parse_call(block.strip())
        if call is None:  # not a call: the block is content, as written
            content.append(self.held_ws + self.start + block + end)
            self.after_call = False
        else:
            deltas += call_deltas(self.num_calls, call)
            self.num_calls += 1
            self.after_call = True
        self.held_ws = ""

    def _content(self, part: str) -> str:
        """`part` as content: leading whitespace after a call dropped, trailing whitespace
        held back until it is known not to precede a call."""
        if self.after_call:
            part = part.lstrip()
            if not part:
                return ""
            self.after_call = False
        combined = self.pending_ws + part
        core = combined.rstrip()
        self.pending_ws = combined[len(core):]
        return core



class HermesToolParser(ToolParser):
    name = "hermes"

    def stream(self) -> ToolStream:
        return TaggedToolStream("<tool_call>", "</tool_call>")
