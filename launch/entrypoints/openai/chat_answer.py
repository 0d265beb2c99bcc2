"""A chat answer's parts: reasoning (`--reasoning-parser`), content and tool calls (by the
request's tool mode), whole for a response or as ordered deltas for a stream. Every API that
answers chat (chat completions, Responses, Anthropic Messages, `LLM.chat`) reads answers here.

Whole and streamed agree: for any cut of the text, the streamed parts come in the same order
and concatenate to the whole answer's reasoning, content and calls (each call's id and name
first, then argument pieces as the model writes them). A call cut short (by `max_tokens`)
keeps the arguments written so far, as OpenAI returns a truncated call; a forced answer never
shows its grammar's own text as content. The finish reason becomes "tool_calls" when an
answer that stopped normally holds calls.
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
from launch.entrypoints.openai.tool_parsers.base import ToolParts, tool_call_id
from launch.entrypoints.openai.tool_parsers.json_call import JsonCallsStream


@dataclass(slots=True)
class ChatAnswer:
    content: str | None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)

    def message(self) -> dict[str, Any]:
        """OpenAI's assistant message; reasoning under vLLM's current name `reasoning` and
        its older `reasoning_content` (which LiteLLM and DeepSeek-style clients read)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            message["reasoning"] = message["reasoning_content"] = self.reasoning
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

    def parts(self, text: str) -> AnswerDelta:
        """The parts of a whole answer, in order (what a stream of any cut gives)."""
        stream = self.stream()
        delta = stream.feed(text)
        delta.parts += stream.finish().parts
        return delta

    def parse(self, text: str) -> ChatAnswer:
        delta = self.parts(text)
        answer = ChatAnswer(None, delta.reasoning or None)
        for call in delta.tool_calls:
            if call.name is not None:
                answer.tool_calls.append(ToolCall(call.name, call.arguments, call.id))
            else:
                answer.tool_calls[call.index].arguments += call.arguments
        answer.content = delta.content or (None if answer.tool_calls or answer.reasoning
                                           else "")
        return answer

    def stream(self) -> AnswerStream:
        return AnswerStream(self)


@dataclass(slots=True)
class AnswerDelta:
    """New parts of an answer in the order written: ("reasoning", text), ("content", text)
    and ("call", ToolCallDelta)."""

    parts: list[tuple[str, Any]] = field(default_factory=list)

    def add(self, kind: str, value: Any) -> None:
        if value == "":
            return
        if kind != "call" and self.parts and self.parts[-1][0] == kind:
            self.parts[-1] = (kind, self.parts[-1][1] + value)
        else:
            self.parts.append((kind, value))

    @property
    def reasoning(self) -> str:
        return "".join(value for kind, value in self.parts if kind == "reasoning")

    @property
    def content(self) -> str:
        return "".join(value for kind, value in self.parts if kind == "content")

    @property
    def tool_calls(self) -> list[ToolCallDelta]:
        return [value for kind, value in self.parts if kind == "call"]


class AnswerStream:
    """One sequence's streaming state: reasoning first, then the answer by tool mode."""

    def __init__(self, parser: ChatAnswerParser) -> None:
        self.mode = parser.tools.mode
        self.tools = parser.tools
        self.reasoning: ReasoningStream | None = (parser.reasoning.stream()
                                                  if parser.reasoning else None)
        self.calls: ToolStream | None = None
        if parser.tool_parser is not None:
            self.calls = parser.tool_parser.stream()
        elif self.mode == "required":  # `[{"name": ..., "parameters": {...}}, ...]`
            self.calls = JsonCallsStream(",[]", content=False)
        self.named_id = tool_call_id() if self.mode == "named" else None
        self.named_started = False

    def feed(self, text: str) -> AnswerDelta:
        delta = AnswerDelta()
        if self.reasoning is not None:
            reasoning, text = self.reasoning.feed(text)
            delta.add("reasoning", reasoning)
        self._answer(text, delta)
        return delta

    def finish(self) -> AnswerDelta:
        delta = AnswerDelta()
        if self.reasoning is not None:
            reasoning, text = self.reasoning.finish()
            delta.add("reasoning", reasoning)
            self._answer(text, delta)
        if self.calls is not None:
            self._parts(self.calls.finish(), delta)
        return delta

    def _answer(self, text: str, delta: AnswerDelta) -> None:
        if self.mode == "named":
            self._named(text, delta)
        elif self.calls is not None:
            self._parts(self.calls.feed(text), delta)
        else:
            delta.add("content", text)

    def _parts(self, parts: ToolParts, delta: AnswerDelta) -> None:
        """Under `parallel_tool_calls: false`, the first call only (as vLLM)."""
        for part in parts:
            if isinstance(part, str):
                delta.add("content", part)
            elif self.tools.parallel or part.index == 0:
                delta.add("call", part)

    def _named(self, text: str, delta: AnswerDelta) -> None:
        """The answer is the named function's arguments, streamed as they come."""
        if not text:
            return
        if not self.named_started:
            self.named_started = True
            delta.add("call", ToolCallDelta(0, self.named_id, self.tools.named.name, ""))
        delta.add("call", ToolCallDelta(0, arguments=text))
