"""Messages between the engine core and its workers, besides the step messages themselves.

Start-up: a worker connects and sends `WorkerHello`; the engine core answers `WorkerInit`; the
worker loads weights, sizes and allocates its KV cache, and sends `WorkerReady` with the number
of blocks it holds. Then `SchedulerOutput`s flow down and rank 0 answers `ModelRunnerOutput`s.
"""
from __future__ import annotations

from protocol.engine_config import EngineConfig
from protocol.lora import LoadLoRA, UnloadLoRA
from protocol.model_runner_output import ModelRunnerOutput
from protocol.scheduler_output import (
    MaskedSchedulerOutput,
    SchedulerOutput,
    SpecDecodeSchedulerOutput,
)
from protocol.wire_struct import WireStruct

# --- engine core -> worker ----------------------------------------------------------------

class WorkerInit(WireStruct, tag=30):
    """The engine's options, and where the tensor-parallel group meets (torch.distributed's
    init_method, e.g. tcp://HOST:PORT)."""

    config: EngineConfig
    dist_init_method: str = ""


class WorkerShutdown(WireStruct, tag=31):
    pass


class WorkerPing(WireStruct, tag=32):
    """Ignored by workers: sent only to learn whether a worker is still connected."""


# --- worker -> engine core ----------------------------------------------------------------

class WorkerHello(WireStruct, tag=40):
    """`proof` is an HMAC of rank, pid and the worker's socket identity under the engine's
    worker secret (common.worker_auth): hellos without a valid one are ignored."""

    rank: int
    pid: int
    hostname: str = ""
    proof: bytes = b""


class WorkerReady(WireStruct, tag=41):
    rank: int
    num_blocks: int
    max_model_len: int
    device: str = "cpu"
    attention_backend: str = "torch"
    vocab_size: int = 0
    dtype: str = ""  # the compute dtype (float32 where a half dtype has no native CPU support)
    quantization: str = ""  # the weights' method as run (gguf, int8, none) and what it kept
    # The KV cache's layer groups: each one's attention window (0: full attention), in the
    # order block ids travel; empty: one full-attention group.
    sliding_windows: list[int] = []
    host: str = ""  # a CPU rank's threads and why, its OpenMP waits, AMX (for the ready line)
    # This rank's KV cache bytes per block id (keys and values of the layers a block holds:
    # one layer group's, and a draft model's; 0: not said)
    block_bytes: int = 0


class WorkerError(WireStruct, tag=42):
    """A worker failed: at start-up (`step` 0) or while running `step`."""

    rank: int
    message: str
    step: int = 0


CoreToWorker = (SchedulerOutput | MaskedSchedulerOutput | SpecDecodeSchedulerOutput | WorkerInit
                | WorkerShutdown | WorkerPing | LoadLoRA | UnloadLoRA)
WorkerToCore = ModelRunnerOutput | WorkerHello | WorkerReady | WorkerError
