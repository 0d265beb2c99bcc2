"""Tool-call parsers for `tool_choice: "auto"` (`--tool-call-parser NAME`): model text in, the
OpenAI `tool_calls` it holds out, whole or streamed."""
from launch.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolStream,
)
from launch.entrypoints.openai.tool_parsers.registry import TOOL_PARSERS, get_tool_parser

__all__ = ["ExtractedToolCalls", "ToolCall", "ToolCallDelta", "ToolParser", "ToolStream",
           "TOOL_PARSERS", "get_tool_parser"]
