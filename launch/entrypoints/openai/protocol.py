"""Request bodies of the OpenAI-compatible API, and their translation to engine inputs.

Structural fields (`model`, `prompt`, `messages`, `stream`, ...) are typed here; sampling
fields are passed through untyped to `SamplingParams`, so a bad value gets the same message
through the server as through `LLM`; the structured-output fields are read by
`structured_outputs.constraint_of`. Unknown fields are ignored, as OpenAI's API does.
"""
from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from fastapi import Request

from launch.entrypoints.openai.errors import APIError
from launch.entrypoints.openai.structured_outputs import StructuredFields
from protocol import SamplingParams

MAX_BODY_BYTES = 16 << 20
DEFAULT_BODY_TIMEOUT_S = 30.0
MAX_PROMPTS = 1024  # prompts in one completions request
MAX_SEQUENCES = 4096  # prompts x n in one request

# vLLM's sampling fields the completion and chat routes accept, as SamplingParams names them.
SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                   "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens",
                   "presence_penalty", "frequency_penalty", "repetition_penalty",
                   "skip_special_tokens", "include_stop_str_in_output")


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Sampling(StructuredFields, kw_only=True):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False  # vLLM's extension: token ids in each choice
    n: Any = None
    temperature: Any = None
    top_p: Any = None
    top_k: Any = None
    min_p: Any = None
    seed: Any = None
    stop: Any = None
    stop_token_ids: Any = None
    ignore_eos: Any = None
    max_tokens: Any = None
    min_tokens: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    skip_special_tokens: Any = None
    include_stop_str_in_output: Any = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: Any
    echo: bool = False
    logprobs: int | None = None


class ToolCallFunction(msgspec.Struct):
    name: str
    arguments: Any = None  # a JSON object as text (OpenAI's shape); an object is taken too


class MessageToolCall(msgspec.Struct, kw_only=True):
    id: str | None = None
    type: str = "function"
    function: ToolCallFunction


class ChatMessage(msgspec.Struct, kw_only=True):
    """One message in any shape OpenAI's API accepts (see `chat_messages` for how it
    reaches the template)."""

    role: str
    content: str | list[Any] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a "tool" message answers this call
    reasoning: str | None = None  # an assistant's earlier reasoning (vLLM's name)
    reasoning_content: str | None = None  # the same, by its older name


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", ...}
    parallel_tool_calls: bool | None = None
    max_completion_tokens: Any = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


async def read_body(request: Request, kind: type[msgspec.Struct]) -> Any:
    """The JSON body as `kind`; 413 past MAX_BODY_BYTES (counted as it arrives), 408 when it
    has not arrived within the server's body timeout, 400 for anything that is not a JSON
    object of the right shape (invalid UTF-8 included)."""
    try:
        length = int(request.headers.get("content-length") or 0)
    except ValueError:
        raise APIError(400, "the Content-Length header is not a number") from None
    if length > MAX_BODY_BYTES:
        raise APIError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes")
    timeout_s = getattr(request.app.state, "body_timeout_s", DEFAULT_BODY_TIMEOUT_S)
    try:
        async with asyncio.timeout(timeout_s):
            data = await _read_capped(request)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s") from None
    try:
        return msgspec.json.decode(data, type=kind)
    except msgspec.ValidationError as e:
        where = str(e).partition(" - at `$.")[2]
        param = where.rstrip("`").split(".")[0].split("[")[0] or None
        raise APIError(400, f"invalid request: {e}", param) from None
    except msgspec.DecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    except UnicodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8: {e.reason} at byte "
                       f"{getattr(e, 'start', '?')}") from None


async def _read_capped(request: Request) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise APIError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def sampling_params(body: _Sampling, defaults: dict[str, Any] | None = None, *,
                    model_defaults: dict[str, Any] | None = None,
                    **overrides: Any) -> SamplingParams:
    """SamplingParams from the fields the body sets (null means "not set") over the model's
    `model_defaults` (its generation_config.json, launch/processing/sampling_defaults.py)
    over the route's `defaults`; a ValueError from its validation becomes a 400 with the
    same message."""
    values = {**(defaults or {}), **(model_defaults or {})}
    values.update({name: v for name in SAMPLING_FIELDS if (v := getattr(body, name)) is not None})
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return SamplingParams(**values)
    except (ValueError, TypeError) as e:
        raise APIError.bad_request(str(e)) from None


def completion_prompts(prompt: Any) -> list[str | dict[str, Any]]:
    """`prompt` as a string, a list of strings, a list of token ids or a list of such lists,
    as engine prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(type(p) is int for p in prompt):
            return [{"prompt_token_ids": prompt}]
        if all(isinstance(p, str) for p in prompt):
            prompts: list[str | dict[str, Any]] = list(prompt)
        elif all(isinstance(p, list) and all(type(t) is int for t in p) for p in prompt):
            prompts = [{"prompt_token_ids": p} for p in prompt]
        else:
            prompts = []
        if len(prompts) > MAX_PROMPTS:
            raise APIError(400, f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}",
                           "prompt")
        if prompts:
            return prompts
    raise APIError(400, "prompt must be a string, a list of strings, a list of token ids or "
                   "a list of lists of token ids (non-empty)", "prompt")
