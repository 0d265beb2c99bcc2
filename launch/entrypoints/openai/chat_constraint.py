"""What constrains a chat answer: the body's structured-output fields or its tool mode, and,
under a reasoning parser, only the answer after the reasoning.

`response_format` (or `structured_outputs`, `guided_*`) together with `tool_choice`
"required" or a named function is a 400 naming `tool_choice`: both would constrain the same
answer, and neither silently wins ("auto" and "none" leave the answer to `response_format`).
"""
from __future__ import annotations

from engine_core.structured_output.grammar import check_grammar
from launch.entrypoints.openai.errors import APIError
from launch.entrypoints.openai.reasoning import ReasoningParser
from launch.entrypoints.openai.structured_outputs import Constraint, StructuredFields, constraint_of
from launch.entrypoints.openai.tool_choice import ToolChoice
from protocol import StructuredOutputsError, StructuredOutputsParams


def chat_constraint(body: StructuredFields, tools: ToolChoice) -> Constraint | None:
    """The one constraint of a chat request (None: free text); APIError 400 otherwise."""
    constraint = constraint_of(body)
    schema = tools.schema()
    if schema is None:
        return constraint
    if constraint is not None:
        raise APIError(400, f"{constraint.param} and tool_choice {tools.mode!r} both "
                       "constrain the answer; send one of them", "tool_choice")
    try:
        return Constraint(StructuredOutputsParams(json=schema), "tools",
                          "tools[].function.parameters")
    except StructuredOutputsError as e:
        raise APIError(400, f"tools[].function.parameters {e.reason}", "tools") from None


def after_reasoning(constraint: Constraint | None, reasoning: ReasoningParser | None
                    ) -> Constraint | None:
    """The constraint applied to the answer after the reasoning (checked first on its own,
    so a refusal names the field the client wrote). Grammar work: call off the event loop."""
    if constraint is None or reasoning is None:
        return constraint
    try:
        check_grammar(constraint.params)
    except StructuredOutputsError as e:
        raise constraint.describe(e) from None
    return Constraint(reasoning.constrain(constraint.params), constraint.param, constraint.name)
