"""Results returned by `LLM.generate`, shaped like vLLM's."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from protocol.lora import LoRARequest


class RequestOutputKind(enum.Enum):
    """What each `RequestOutput` of a stream carries, as vLLM's `output_kind`: CUMULATIVE,
    everything so far (`LLM` and `AsyncLLM`'s default); DELTA, only what is new since the
    previous output of the stream (what the server streams); FINAL_ONLY, one output when the
    request has finished."""

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # `LLM.chat` only: the answer as the chat route returns it (OpenAI's assistant message:
    # content, reasoning, tool_calls), parsed by the same code
    message: dict[str, Any] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: None = None
    metrics: dict = field(default_factory=dict)
    lora_request: LoRARequest | None = None  # the adapter it ran with (vLLM's field)
