"""`tools` and `tool_choice` of a chat request: which mode it is and the JSON schema that
enforces a forced choice (`chat_answer` reads the calls out of the answer).

Modes: "none" (tools go to the template, the answer is text), "auto" (the answer is text,
parsed for calls by `--tool-call-parser`), "required" (the answer is forced to be a JSON list
of one or more calls of the given tools: `[{"name": ..., "parameters": {...}}, ...]`, at most
one with `parallel_tool_calls: false`) and a named function (the answer is forced to be that
function's arguments, a JSON object of its parameter schema).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from launch.entrypoints.openai.errors import APIError

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    parameters: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: str  # "none" | "auto" | "required" | "named"
    tools: tuple[Tool, ...]
    named: Tool | None = None
    parallel: bool = True

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema the answer must match (None: unconstrained)."""
        if self.mode == "named":
            return self.named.parameters
        if self.mode != "required":
            return None
        call = {"anyOf": [{"type": "object", "properties": {
            "name": {"type": "string", "const": tool.name}, "parameters": tool.parameters},
            "required": ["name", "parameters"], "additionalProperties": False}
            for tool in self.tools]}
        return {"type": "array", "items": call, "minItems": 1,
                **({} if self.parallel else {"maxItems": 1})}


def parse_tool_choice(tools: list[dict[str, Any]] | None, tool_choice: Any,
                      parallel_tool_calls: bool | None) -> ToolChoice:
    """The request's tool mode; 400 naming the field for anything malformed."""
    parsed = tuple(_tool(t, i) for i, t in enumerate(tools or ()))
    if len({t.name for t in parsed}) != len(parsed):
        raise APIError(400, "tools must have distinct function names", "tools")
    if tool_choice is None:
        tool_choice = "auto" if parsed else "none"
    parallel = True if parallel_tool_calls is None else bool(parallel_tool_calls)
    if tool_choice in ("none", "auto", "required"):
        if tool_choice == "required" and not parsed:
            raise APIError(400, "tool_choice 'required' needs tools", "tool_choice")
        return ToolChoice(tool_choice, parsed, parallel=parallel)
    name = (tool_choice.get("function") or {}).get("name") \
        if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" else None
    if not isinstance(name, str):
        raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or "
                       '{"type": "function", "function": {"name": ...}}', "tool_choice")
    named = next((t for t in parsed if t.name == name), None)
    if named is None:
        raise APIError(400, f"tool_choice names the function {name!r}, which is not in "
                       "tools", "tool_choice")
    return ToolChoice("named", parsed, named, parallel)


def _tool(tool: Any, index: int) -> Tool:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
            or not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError(400, f"tools[{index}] must be {{\"type\": \"function\", \"function\": "
                       "{\"name\": ..., \"parameters\": {...}}}", "tools")
    parameters = function.get("parameters") or _ANY_OBJECT
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        got = (f"type {json.dumps(parameters.get('type'))}" if isinstance(parameters, dict)
               else type(parameters).__name__)
        raise APIError(400, f"tools[{index}].function.parameters must be a JSON schema of "
                       f'type "object" (a call\'s arguments are an object), got {got}', "tools")
    return Tool(function["name"], parameters)

