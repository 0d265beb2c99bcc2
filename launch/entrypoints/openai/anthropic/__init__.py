"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`), served over
the chat path as vLLM and llama-server serve it."""
from launch.entrypoints.openai.anthropic.protocol import ANTHROPIC_PATHS, anthropic_error
from launch.entrypoints.openai.anthropic.serving import (
    AnthropicServingMessages,
    add_messages_routes,
)

__all__ = ["ANTHROPIC_PATHS", "AnthropicServingMessages", "add_messages_routes",
           "anthropic_error"]
