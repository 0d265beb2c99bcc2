"""`LLM.chat`'s preparation and answers: the chat route's own code (`plan_chat`,
`ChatAnswerParser`), so a conversation with tools renders, is constrained and parses offline
exactly as it does through the server; a refusal is a ValueError with the server's message."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from engine_core.structured_output.grammar import check_grammar
from launch.entrypoints.openai.chat_answer import ChatParsers
from launch.entrypoints.openai.chat_request import ChatPlan, plan_chat
from launch.entrypoints.openai.errors import APIError
from launch.entrypoints.openai.protocol import ChatCompletionRequest
from launch.entrypoints.openai.reasoning import get_reasoning_parser
from launch.entrypoints.openai.structured_outputs import Constraint
from launch.entrypoints.openai.tool_parsers import get_tool_parser
from launch.outputs import RequestOutput
from launch.processing.chat_template import ChatTemplate
from protocol import SamplingParams, StructuredOutputsError


@dataclass(frozen=True)
class ChatOptions:
    """The chat route's request fields that `LLM.chat` takes as keywords."""

    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    add_generation_prompt: bool = True


def plan_conversation(messages: list[dict[str, Any]], options: ChatOptions,
                      template: ChatTemplate, max_chars: int) -> ChatPlan:
    """A conversation's prompt, constraint and answer parser; ValueError for anything the
    server would answer 400. With tools and no `tool_choice`: "auto" when a tool-call parser
    is given, else "none" (the tools still reach the template, as vLLM's `LLM.chat`)."""
    parsers = ChatParsers(
        get_tool_parser(options.tool_call_parser) if options.tool_call_parser else None,
        get_reasoning_parser(options.reasoning_parser) if options.reasoning_parser else None)
    tool_choice = options.tool_choice
    if tool_choice is None and options.tools:
        tool_choice = "auto" if parsers.tool_parser else "none"
    try:
        body = msgspec.convert({
            "messages": messages, "tools": options.tools, "tool_choice": tool_choice,
            "parallel_tool_calls": options.parallel_tool_calls,
            "response_format": options.response_format,
            "add_generation_prompt": options.add_generation_prompt}, ChatCompletionRequest)
        return plan_chat(body, template, parsers, max_chars, _check)
    except msgspec.ValidationError as e:
        raise ValueError(f"invalid messages or tools: {e}") from None
    except APIError as e:
        raise ValueError(e.message) from None


def constrained(params: SamplingParams, plan: ChatPlan) -> SamplingParams:
    """`params` holding the plan's constraint (one constraint per request: a tool or
    response-format constraint beside the params' own is refused)."""
    if plan.constraint is None:
        return params
    if params.structured_outputs is not None:
        raise ValueError("sampling_params.structured_outputs and the tools or response_format "
                         "both constrain the answer; give one of them")
    return msgspec.structs.replace(params, structured_outputs=plan.constraint.params)


def attach_messages(outputs: list[RequestOutput], plans: list[ChatPlan]) -> None:
    """Each sequence's parsed answer as `CompletionOutput.message`."""
    for out, plan in zip(outputs, plans):
        for seq in out.outputs:
            seq.message = plan.answers.parse(seq.text).message()


def _check(constraint: Constraint) -> None:
    try:
        check_grammar(constraint.params)
    except StructuredOutputsError as e:
        raise constraint.describe(e) from None
