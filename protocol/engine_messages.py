"""Messages between the front-end and the engine-core process, named by direction."""
from __future__ import annotations

from typing import Literal

import msgspec

from protocol.model_runner_output import SampleLogprobs
from protocol.sampling_params import SamplingParams

_WIRE = dict(array_like=True, omit_defaults=True, gc=False)

FinishReason = Literal["stop", "length", "abort", "error"]


# --- front-end -> engine core -------------------------------------------------------------

class AddRequest(msgspec.Struct, tag=10, **_WIRE):
    """A tokenized request. `arrival_time` is set by the front-end so a replay decides alike."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    eos_token_id: int | None = None


class AddRequests(msgspec.Struct, tag=13, **_WIRE):
    """Several requests in one frame: the engine sees all of them before its next step, so
    an offline batch schedules the same way on every run."""

    requests: list[AddRequest]


class AbortRequests(msgspec.Struct, tag=11, **_WIRE):
    request_ids: list[str]


class ShutdownEngine(msgspec.Struct, tag=12, **_WIRE):
    pass


# --- engine core -> front-end -------------------------------------------------------------

class EngineCoreOutput(msgspec.Struct, **_WIRE):
    """New tokens of one request; `finish_reason` set on its last output.

    `stop_reason` is the stop token id that ended it (the front-end puts the matched stop
    string there); `error` explains a request the engine refused or failed.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    logprobs: list[SampleLogprobs] | None = None
    num_cached_tokens: int = 0
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, **_WIRE):
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    num_preemptions: int = 0


class EngineCoreOutputs(msgspec.Struct, tag=20, **_WIRE):
    outputs: list[EngineCoreOutput]
    step: int = 0
    stats: SchedulerStats | None = None


class EngineReady(msgspec.Struct, tag=21, **_WIRE):
    max_model_len: int
    num_blocks: int
    block_size: int
    world_size: int = 1
    vocab_size: int = 0
    attention_backend: str = ""  # what the workers run ("torch", "cupy", "emulated")


class EngineFailed(msgspec.Struct, tag=22, **_WIRE):
    """The engine cannot serve any more; `process` names the process that failed or died."""

    message: str
    process: str = "engine_core"


FrontendToCore = AddRequest | AddRequests | AbortRequests | ShutdownEngine
CoreToFrontend = EngineCoreOutputs | EngineReady | EngineFailed
