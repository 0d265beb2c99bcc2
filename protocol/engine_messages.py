"""Messages between the front-end and the engine-core process, named by direction."""
from __future__ import annotations

from typing import Literal

from protocol.lora import AddLoRA, LoRARequest, RemoveLoRA
from protocol.model_runner_output import SampleLogprobs
from protocol.pooling_params import PoolingParams
from protocol.sampling_params import SamplingParams
from protocol.wire_struct import WireStruct

FinishReason = Literal["stop", "length", "abort", "error"]


# --- front-end -> engine core -------------------------------------------------------------

class AddRequest(WireStruct, tag=10):
    """A tokenized request. `arrival_time` is set by the front-end so a replay decides alike.
    A pooling request (to a `--runner pooling` engine) has `pooling_params`; its
    `sampling_params` are unused."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    eos_token_id: int | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)
    pooling_params: PoolingParams | None = None


class AddRequests(WireStruct, tag=13):
    """Several requests in one frame: the engine sees all of them before its next step, so
    an offline batch schedules the same way on every run."""

    requests: list[AddRequest]


class AbortRequests(WireStruct, tag=11):
    request_ids: list[str]


class ShutdownEngine(WireStruct, tag=12):
    pass


class GrammarError(WireStruct):
    request_id: str
    message: str


class GrammarsCompiled(WireStruct, tag=14):
    """The engine core's own input, never the front-end's: what its grammar work did. The
    grammars of these waiting requests finished compiling (`ready`); these requests failed
    (`failed`, each one's error: its grammar did not compile in time or at all, or the
    grammar engine could not compute its next mask); these running requests' next masks were
    not ready when the step was scheduled (`late`: they sit out steps) and these are now
    (`caught_up`). Grammar work takes varying time, so the engine core records this at the
    step it notices it and applies it then; a scheduler-only replay applies it at the same
    step."""

    ready: list[str] = []
    failed: list[GrammarError] = []
    late: list[str] = []
    caught_up: list[str] = []


# --- engine core -> front-end -------------------------------------------------------------

class EngineCoreOutput(WireStruct):
    """New tokens of one request; `finish_reason` set on its last output.

    `stop_reason` is the stop token id that ended it (the front-end puts the matched stop
    string there); `error` explains a request the engine refused or failed. `scheduled_time`
    (time.time() in the engine core) is when the request was first scheduled, on its first
    output only (the front-end's queue-time metric).
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    logprobs: list[SampleLogprobs] | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    scheduled_time: float | None = None
    # A pooling request's result (on its only, final output): float32, little-endian; one
    # vector, or one row per prompt token for a per-token task.
    pooling_output: bytes | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SpecDecodingStats(WireStruct):
    """Speculative decoding since the engine started: requests' verifications with drafts
    (`num_drafts`), their draft tokens, and how many of those the target accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class SchedulerStats(WireStruct):
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    num_preemptions: int = 0
    spec_decoding: SpecDecodingStats | None = None  # None without speculative decoding


class EngineCoreOutputs(WireStruct, tag=20):
    outputs: list[EngineCoreOutput]
    step: int = 0
    stats: SchedulerStats | None = None


class EngineReady(WireStruct, tag=21):
    max_model_len: int
    num_blocks: int
    block_size: int
    world_size: int = 1
    vocab_size: int = 0
    attention_backend: str = ""  # what the workers run ("cpu", "torch", "cupy", "emulated")
    dtype: str = ""  # the workers' compute dtype
    quantization: str = ""  # the weights' method as run, e.g. "gguf (Q4_1: 210, Q8_0: 1)"
    sliding_windows: list[int] = []  # per KV layer group, as WorkerReady's
    # The longest sequence the whole KV cache holds (0: num_blocks - 1 blocks of block_size).
    max_kv_tokens: int = 0


class EngineFailed(WireStruct, tag=22):
    """The engine cannot serve any more; `process` names the process that failed or died."""

    message: str
    process: str = "engine_core"


FrontendToCore = (AddRequest | AddRequests | AbortRequests | ShutdownEngine | GrammarsCompiled
                  | AddLoRA | RemoveLoRA)
CoreToFrontend = EngineCoreOutputs | EngineReady | EngineFailed
