"""The engine's configuration, handed from the front-end to the engine-core process at launch."""
from __future__ import annotations

import msgspec

from protocol.worker_messages import WorkerConfig


class EngineConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Everything `LLM(...)` and `deltaserve generate` accept, validated on construction."""

    model: str
    tensor_parallel_size: int = 1
    device: str = "auto"
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"
    # Schedule the next step while the workers run the current one (see SchedulerConfig).
    async_scheduling: bool = False
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    attention_backend: str = "auto"
    # Where workers connect: None for an ipc socket in the engine's private runtime directory,
    # or "tcp://HOST:PORT" so that workers on other hosts can join.
    worker_address: str | None = None
    # Ranks the engine core starts itself (None: all); the others join with `deltaserve worker`.
    local_ranks: list[int] | None = None
    record_path: str | None = None
    startup_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        positive = ("tensor_parallel_size", "max_num_seqs", "block_size")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError("num_gpu_blocks_override must be at least 2 (block 0 is reserved)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.worker_address is not None and not self.worker_address.startswith("tcp://"):
            raise ValueError(f"worker_address must be tcp://HOST:PORT, got {self.worker_address!r}")
        for rank in self.local_ranks or ():
            if not 0 <= rank < self.tensor_parallel_size:
                raise ValueError(f"local rank {rank} is outside tensor_parallel_size "
                                 f"{self.tensor_parallel_size}")

    @property
    def spawned_ranks(self) -> list[int]:
        if self.local_ranks is None:
            return list(range(self.tensor_parallel_size))
        return sorted(self.local_ranks)

    def worker_config(self, dist_init_method: str) -> WorkerConfig:
        return WorkerConfig(
            model=self.model, tensor_parallel_size=self.tensor_parallel_size,
            dist_init_method=dist_init_method, device=self.device, dtype=self.dtype,
            max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens or 8192,
            block_size=self.block_size, kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            gpu_memory_utilization=self.gpu_memory_utilization, seed=self.seed,
            attention_backend=self.attention_backend)
