"""Llama 3.1+ JSON tool calls: the answer is `{"name": ..., "parameters": {...}}` (or several,
separated by `;`), optionally after `<|python_tag|>`. An answer that starts with `{` (after
whitespace) or the tag is read as calls, each streaming as written once its name is known;
an object that is not a call, and anything after the calls that is not one, is content. An
answer that starts otherwise streams as content."""
from __future__ import annotations

from launch.entrypoints.openai.tool_parsers.base import ToolParser, ToolStream
from launch.entrypoints.openai.tool_parsers.json_call import JsonCallsStream

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    arguments_key = "parameters"

    def stream(self) -> ToolStream:
        return JsonCallsStream(";", prefix=PYTHON_TAG)

    def calls_rules(self, call_object: str, parallel: bool) -> str:
        more = ' ("; " tool_call)*' if parallel else ""
        return f"tool_calls: tool_call{more}\ntool_call: {call_object}\n"
