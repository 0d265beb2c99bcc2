"""What constrains a chat answer: the body's structured-output fields, its tool mode, or
both; under a reasoning parser, only the answer after the reasoning.

The rule when tools and an output schema (`response_format`) come together, as agent
frameworks send them:
- `tool_choice` "auto" (with `--tool-call-parser`): one grammar with two branches, calls of
  the given tools in the parser's format or content matching the schema; so a constrained
  agent can still call its tools and still ends with schema-valid content.
- "required" or a named function: the forced call; the schema is checked (a bad one is still
  a 400) and applies to later turns' content, when the client stops forcing a call.
- "none": the schema holds the answer.
vLLM's own fields (`structured_outputs`, `guided_*`) constrain the model's whole text as
written, whatever the tool mode (under "auto" the parser then reads that text), so a client
can pin a call's exact text; with "required" or a named function they are refused, as both
would constrain the same text.
"""
from __future__ import annotations

from typing import Any

from engine_core.structured_output.grammar import answer_lark
from launch.entrypoints.openai.errors import APIError
from launch.entrypoints.openai.reasoning import ReasoningParser
from launch.entrypoints.openai.structured_outputs import Constraint, StructuredFields, constraint_of
from launch.entrypoints.openai.tool_choice import ToolChoice
from launch.entrypoints.openai.tool_parsers import ToolParser
from protocol import StructuredOutputsError, StructuredOutputsParams

_TOOLS_NAME = "tools[].function.parameters"


class ChatConstraint:
    """A request's constraints: `answer` is what the engine enforces (None: free text);
    `checks` are the constraints to validate on their own first, so a refusal names the
    field the client wrote (the response format under a forced call is only checked)."""

    def __init__(self, answer: Constraint | None, checks: tuple[Constraint, ...] = ()) -> None:
        self.answer = answer
        self.checks = checks


def chat_constraint(body: StructuredFields, tools: ToolChoice,
                    tool_parser: ToolParser | None) -> ChatConstraint:
    """The constraints of a chat request by the rule above; APIError 400 for a malformed one."""
    response_format = constraint_of(body)
    forced = tools.schema()
    if forced is not None:
        if response_format is not None and response_format.param != "response_format":
            raise APIError(400, f"{response_format.param} and tool_choice {tools.mode!r} both "
                           "constrain the answer's text; send one of them", "tool_choice")
        checks = (response_format,) if response_format else ()
        return ChatConstraint(_tools_constraint({"json": forced}), checks)
    if tools.mode != "auto" or response_format is None or tool_parser is None \
            or response_format.param != "response_format":
        return ChatConstraint(response_format)
    try:
        calls = tool_parser.calls_grammar([(t.name, t.parameters) for t in tools.tools],
                                          tools.parallel)
    except StructuredOutputsError as e:
        raise APIError(400, f"{_TOOLS_NAME} {e.reason}", "tools") from None
    try:
        answer = answer_lark(response_format.params)
    except StructuredOutputsError as e:
        raise response_format.describe(e) from None
    grammar = f"start: tool_calls | answer\n{calls}answer: {answer}\n"
    return ChatConstraint(_tools_constraint({"grammar": grammar}), (response_format,))


def _tools_constraint(fields: dict[str, Any]) -> Constraint:
    try:
        return Constraint(StructuredOutputsParams(**fields), "tools", _TOOLS_NAME)
    except StructuredOutputsError as e:
        raise APIError(400, f"{_TOOLS_NAME} {e.reason}", "tools") from None


def after_reasoning(constraint: Constraint | None, reasoning: ReasoningParser | None
                    ) -> Constraint | None:
    """The constraint applied to the answer after the reasoning (the caller checks it on its
    own first, so a refusal names the field the client wrote)."""
    if constraint is None or reasoning is None:
        return constraint
    return Constraint(reasoning.constrain(constraint.params), constraint.param, constraint.name)
