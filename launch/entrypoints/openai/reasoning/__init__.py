"""Reasoning parsers (`--reasoning-parser NAME`): a model's thinking moved out of the answer
into `reasoning_content`, whole or streamed."""
from launch.entrypoints.openai.reasoning.base import ReasoningParser, ReasoningStream
from launch.entrypoints.openai.reasoning.registry import REASONING_PARSERS, get_reasoning_parser

__all__ = ["ReasoningParser", "ReasoningStream", "REASONING_PARSERS", "get_reasoning_parser"]
