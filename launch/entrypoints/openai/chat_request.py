"""The one preparation of a chat request, shared by every API that answers chat (chat
completions, Responses, Anthropic Messages) and by `LLM.chat`: its tool mode, its
constraint (tools, output schema, reasoning), its messages normalized, bounded and rendered.
What each API differs in is only how its body becomes a `ChatCompletionRequest` and how the
answer is shaped."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from launch.entrypoints.openai.chat_answer import ChatAnswerParser, ChatParsers
from launch.entrypoints.openai.chat_constraint import after_reasoning, chat_constraint
from launch.entrypoints.openai.chat_messages import message_dicts, prompt_chars, render
from launch.entrypoints.openai.errors import APIError
from launch.entrypoints.openai.protocol import ChatCompletionRequest
from launch.entrypoints.openai.structured_outputs import Constraint
from launch.entrypoints.openai.tool_choice import parse_tool_choice
from launch.processing.chat_template import ChatTemplate


@dataclass(frozen=True, slots=True)
class ChatPlan:
    """A chat request made ready: the prompt text, the constraint the engine enforces on the
    answer (None: free text) and how the answer splits into reasoning, content and calls."""

    prompt: str
    constraint: Constraint | None
    answers: ChatAnswerParser


def answer_parser(body: ChatCompletionRequest, parsers: ChatParsers) -> ChatAnswerParser:
    """How the request's answers split: its tool mode (400 for a malformed one, or for
    "auto" without a tool-call parser, as vLLM answers)."""
    tools = parse_tool_choice(body.tools, body.tool_choice, body.parallel_tool_calls)
    if tools.mode == "auto" and parsers.tool_parser is None:
        raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and '
                       "--tool-call-parser to be set", "tool_choice")
    return ChatAnswerParser(tools, parsers.tool_parser, parsers.reasoning)


def plan_chat(body: ChatCompletionRequest, template: ChatTemplate | None,
              parsers: ChatParsers, max_chars: int,
              check: Callable[[Constraint], None]) -> ChatPlan:
    """Everything before tokenizing, in order: tool mode, constraints (each handed alone to
    `check`, so a refusal names the field the client wrote; the server collects them and
    checks them in the grammar validator after this), messages normalized, bounded to
    `max_chars` and rendered. Rendering: call off the event loop. Any failure is an
    APIError; a request nested too deeply for any step is a 400."""
    try:
        answers = answer_parser(body, parsers)
        constraints = chat_constraint(body, answers.tools, parsers.tool_parser)
        for constraint in constraints.checks:
            check(constraint)
        if constraints.answer is not None and parsers.reasoning is not None:
            check(constraints.answer)
        return ChatPlan(_prompt(body, template, max_chars),
                        after_reasoning(constraints.answer, parsers.reasoning), answers)
    except RecursionError:
        raise APIError(400, "the request nests too deeply to be read") from None


def _prompt(body: ChatCompletionRequest, template: ChatTemplate | None, max_chars: int) -> str:
    if template is None:
        raise APIError(400, "the model has no chat template (no chat_template in its "
                       "tokenizer_config.json, no chat_template.jinja); start the server "
                       "with --chat-template FILE", "messages")
    if not body.messages:
        raise APIError(400, "messages must not be empty", "messages")
    messages = message_dicts(body.messages)
    chars = prompt_chars(messages, body.tools)
    if chars > max_chars:
        raise APIError(400, f"the messages hold {chars} characters, more than a prompt of "
                       f"the model's max_model_len tokens can ({max_chars})", "messages")
    return render(template, messages, body.add_generation_prompt, body.tools)
