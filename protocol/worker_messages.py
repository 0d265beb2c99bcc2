"""Messages between the engine core and its workers, besides the step messages themselves.

Start-up: a worker connects and sends `WorkerHello`; the engine core answers `WorkerInit`; the
worker loads weights, sizes and allocates its KV cache, and sends `WorkerReady` with the number
of blocks it holds. Then `SchedulerOutput`s flow down and rank 0 answers `ModelRunnerOutput`s.
"""
from __future__ import annotations

import msgspec

from protocol.model_runner_output import ModelRunnerOutput
from protocol.scheduler_output import SchedulerOutput

_WIRE = dict(array_like=True, omit_defaults=True, gc=False)


class WorkerConfig(msgspec.Struct, kw_only=True, **_WIRE):
    """Everything a worker needs to load the model and build its KV cache."""

    model: str
    tensor_parallel_size: int = 1
    dist_init_method: str = ""
    device: str = "cpu"
    dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    attention_backend: str = "auto"
    num_threads: int = 0


# --- engine core -> worker ----------------------------------------------------------------

class WorkerInit(msgspec.Struct, tag=30, **_WIRE):
    config: WorkerConfig


class WorkerShutdown(msgspec.Struct, tag=31, **_WIRE):
    pass


# --- worker -> engine core ----------------------------------------------------------------

class WorkerHello(msgspec.Struct, tag=40, **_WIRE):
    rank: int
    pid: int
    hostname: str = ""


class WorkerReady(msgspec.Struct, tag=41, **_WIRE):
    rank: int
    num_blocks: int
    max_model_len: int
    device: str = "cpu"
    attention_backend: str = "torch"
    vocab_size: int = 0
    dtype: str = ""  # the compute dtype (float32 where a half dtype has no native CPU support)


class WorkerError(msgspec.Struct, tag=42, **_WIRE):
    """A worker failed: at start-up (`step` 0) or while running `step`."""

    rank: int
    message: str
    step: int = 0


CoreToWorker = SchedulerOutput | WorkerInit | WorkerShutdown
WorkerToCore = ModelRunnerOutput | WorkerHello | WorkerReady | WorkerError
