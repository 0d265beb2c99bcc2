"""`--tool-call-parser NAME` to a parser: adding a format is one file and one line here."""
from __future__ import annotations

from launch.entrypoints.openai.tool_parsers.base import ToolParser
from launch.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from launch.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}, "
                         f"got {name!r}")
    return TOOL_PARSERS[name]()
