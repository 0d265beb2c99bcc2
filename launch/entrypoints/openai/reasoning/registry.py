"""`--reasoning-parser NAME` to a parser: adding one is a file and a line here."""
from __future__ import annotations

from launch.entrypoints.openai.reasoning.base import ReasoningParser
from launch.entrypoints.openai.reasoning.think_tags import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
)

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, "
                         f"got {name!r}")
    return REASONING_PARSERS[name]()
