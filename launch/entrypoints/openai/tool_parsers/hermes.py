"""The Hermes format (Qwen2.5, Qwen3, Hermes models): each call is
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in the text.

Content is the text outside the calls, without the whitespace that only separates it from a
call. Inside a block, the call streams as the model writes it once its name is known
(`CallScanner`); a block whose name never becomes known and that does not parse as a call
stays in the content, tags and all. A block is closed by the first end tag.
"""
from __future__ import annotations

from launch.entrypoints.openai.tool_parsers.base import ToolParser, ToolParts, ToolStream
from launch.entrypoints.openai.tool_parsers.json_call import CallScanner
from launch.processing.detokenizer import partial_suffix


class TaggedToolStream(ToolStream):
    def __init__(self, start: str, end: str) -> None:
        self.start, self.end = start, end
        self.buf = ""
        self.call: CallScanner | None = None  # set inside a block
        self.block = ""  # the open block's text so far
        self.pending_ws = ""  # trailing content whitespace: dropped if a call follows
        self.held_ws = ""  # the whitespace before the open block, until it resolves
        self.after_call = False  # content right after a call loses its leading whitespace
        self.num_calls = 0

    def feed(self, text: str) -> ToolParts:
        self.buf += text
        parts: ToolParts = []
        while True:
            if self.call is not None:
                j = self.buf.find(self.end)
                if j < 0:  # all but what may begin the end tag goes to the call
                    keep = partial_suffix(self.buf, self.end)
                    self._inside(self.buf[:len(self.buf) - keep], parts)
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                self._inside(self.buf[:j], parts)
                self.buf = self.buf[j + len(self.end):]
                self._close(self.end, parts)
            else:
                i = self.buf.find(self.start)
                if i < 0:
                    keep = partial_suffix(self.buf, self.start)
                    self._content(self.buf[:len(self.buf) - keep], parts)
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                self._content(self.buf[:i], parts)
                self.buf = self.buf[i + len(self.start):]
                self.call, self.block = CallScanner(self.num_calls), ""
                self.held_ws, self.pending_ws = self.pending_ws, ""
        return parts

    def finish(self) -> ToolParts:
        parts: ToolParts = []
        if self.call is not None:  # an unclosed block: the model stopped inside or after it
            self._inside(self.buf, parts)
            self._close("", parts)
        else:
            self._content(self.buf, parts)
        self.buf = ""
        if self.pending_ws:
            parts.append(self.pending_ws)
        self.pending_ws = ""
        return parts

    def _inside(self, text: str, parts: ToolParts) -> None:
        assert self.call is not None
        self.block += text
        if not self.call.closed:
            deltas, _ = self.call.feed(text)  # what follows the object in the block is dropped
            parts += deltas

    def _close(self, end: str, parts: ToolParts) -> None:
        call, self.call = self.call, None
        assert call is not None
        deltas = call.close()
        if deltas is None:  # not a call: the block is content, as written
            parts.append(self.held_ws + self.start + self.block + end)
            self.after_call = False
        else:
            parts += deltas
            self.num_calls += 1
            self.after_call = True
        self.held_ws = self.block = ""

    def _content(self, part: str, parts: ToolParts) -> None:
        """`part` as content: leading whitespace after a call dropped, trailing whitespace
        held back until it is known not to precede a call."""
        if self.after_call:
            part = part.lstrip()
            if not part:
                return
            self.after_call = False
        combined = self.pending_ws + part
        core = combined.rstrip()
        self.pending_ws = combined[len(core):]
        if core:
            parts.append(core)


class HermesToolParser(ToolParser):
    name = "hermes"

    def stream(self) -> ToolStream:
        return TaggedToolStream("<tool_call>", "</tool_call>")

    def calls_rules(self, call_object: str, parallel: bool) -> str:
        more = ' ("\\n" tool_call)*' if parallel else ""
        return (f"tool_calls: tool_call{more}\n"
                f'tool_call: "<tool_call>\\n" {call_object} "\\n</tool_call>"\n')

