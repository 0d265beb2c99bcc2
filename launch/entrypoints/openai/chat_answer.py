"""A chat answer's parts: reasoning (`--reasoning-parser`), content and tool calls (by the
request's tool mode), whole for a response or as deltas for a stream.

Whole and streamed agree: the streamed `reasoning_content` and `content` deltas concatenate to
the whole answer's, and each streamed call (id and name first, then argument pieces) to the
whole answer's call. The finish reason becomes "tool_calls" when an answer that stopped
normally holds calls.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from launch.entrypoints.openai.reasoning import ReasoningParser, ReasoningStream
from launch.entrypoints.openai.tool_choice import ToolChoice
from launch.entrypoints.openai.tool_parsers import (
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolStream,
)
from launch.entrypoints.openai.tool_parsers.base import call_deltas, tool_call_id


@dataclass(slots=True)
class ChatAnswer:
    content: str | None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)

    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in self.tool_calls]
        return message


@dataclass(frozen=True, slots=True)
class ChatParsers:
    """The server's parsers: `--tool-call-parser` (set only with --enable-auto-tool-choice)
    and `--reasoning-parser`; both hold no per-request state."""

    tool_parser: ToolParser | None = None
    reasoning: ReasoningParser | None = None


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if reason == "stop" and has_calls else reason


class ChatAnswerParser:
    """Per request: how its answers split into reasoning, content and calls."""

    def __init__(self, tools: ToolChoice, tool_parser: ToolParser | None,
                 reasoning: ReasoningParser | None) -> None:
        self.tools = tools
        self.tool_parser = tool_parser if tools.mode == "auto" else None
        self.reasoning = reasoning

    def parse(self, text: str, finished_normally: bool = True) -> ChatAnswer:
        stream = self.stream()
        out = [stream.feed(text), stream.finish(finished_normally)]
        answer = ChatAnswer(None)
        reasoning = "".join(o.reasoning for o in out)
        content = "".join(o.content for o in out)
        for delta in (d for o in out for d in o.tool_calls):
            if delta.name is not None:
                answer.tool_calls.append(ToolCall(delta.name, delta.arguments, delta.id))
            else:
                answer.tool_calls[delta.index].arguments += delta.arguments
        answer.reasoning = reasoning or None
        answer.content = content or (None if answer.tool_calls or answer.reasoning else "")
        return answer

    def stream(self) -> AnswerStream:
        return AnswerStream(self)


@dataclass(slots=True)
class AnswerDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class AnswerStream:
    """One sequence's streaming state: reasoning first, then the answer by tool mode."""

    def __init__(self, parser: ChatAnswerParser) -> None:
        self.mode = parser.tools.mode
        self.tools = parser.tools
        self.reasoning: ReasoningStream | None = (parser.reasoning.stream()
                                                  if parser.reasoning else None)
        self.calls: ToolStream | None = (parser.tool_parser.stream()
                                         if parser.tool_parser else None)
        self.forced = ""  # a forced answer's text so far ("required"/"named")
        self.named_id = tool_call_id() if self.mode == "named" else None

    def feed(self, text: str) -> AnswerDelta:
        if self.reasoning is not None:
            reasoning, text = self.reasoning.feed(text)
            return self._answer(text, AnswerDelta(reasoning=reasoning))
        return self._answer(text, AnswerDelta())

    def finish(self, finished_normally: bool = True) -> AnswerDelta:
        delta = AnswerDelta()
        if self.reasoning is not None:
            delta.reasoning, text = self.reasoning.finish()
            delta = self._answer(text, delta)
        if self.calls is not None:
            content, calls = self.calls.finish()
            delta.content += content
            delta.tool_calls += self._allowed(calls)
        elif self.mode == "required":
            delta = self._required(delta, finished_normally)
        return delta

    def _answer(self, text: str, delta: AnswerDelta) -> AnswerDelta:
        if self.mode == "named":
            return self._named(text, delta)
        if self.mode == "required":
            self.forced += text
        elif self.calls is not None:
            content, calls = self.calls.feed(text)
            delta.content += content
            delta.tool_calls += self._allowed(calls)
        else:
            delta.content += text
        return delta

    def _allowed(self, calls: list[ToolCallDelta]) -> list[ToolCallDelta]:
        """Under `parallel_tool_calls: false`, the first parsed call only (as vLLM)."""
        return calls if self.tools.parallel else [c for c in calls if c.index == 0]

    def _named(self, text: str, delta: AnswerDelta) -> AnswerDelta:
        """The answer is the named function's arguments, streamed as they come."""
        if not self.forced and not text:
            return delta
        if not self.forced:
            delta.tool_calls.append(ToolCallDelta(0, self.named_id, self.tools.named.name, ""))
        self.forced += text
        if text:
            delta.tool_calls.append(ToolCallDelta(0, arguments=text))
        return delta

    def _required(self, delta: AnswerDelta, finished_normally: bool) -> AnswerDelta:
        """A list of calls, emitted once whole; an answer cut short is content."""
        text, self.forced = self.forced, ""
        try:
            calls = self.tools.forced_calls(text) if finished_normally else None
        except (ValueError, KeyError, TypeError):
            calls = None
        if not calls:
            delta.content += text
            return delta
        delta.tool_calls += [d for i, call in enumerate(calls) for d in call_deltas(i, call)]
        return delta
