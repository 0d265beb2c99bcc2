"""Scheduler and KV-cache configuration (frozen; facts learned at run time travel as messages)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

from protocol.engine_config import SchedulingPolicy
from protocol.speculative_config import SpeculativeConfig

POLICIES = get_args(SchedulingPolicy)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    policy: str = "fcfs"
    # Caps the tokens one prefill chunk may take in a step (0: no cap beyond the budget).
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    # Schedule step N+1 while step N runs: decode tokens whose values are still being sampled
    # are scheduled as placeholders (the workers know them), and handles are reused only once
    # no step in flight can name them. Off: every step is scheduled after the previous update.
    async_scheduling: bool = False
    # Draft tokens proposed per request (n-gram lookup here, or a draft model in the
    # workers) and verified as extra tokens of the next step; None: off.
    speculative_config: SpeculativeConfig | None = None
    # Most distinct LoRA adapters among the running requests (so in any step); None: LoRA off.
    max_loras: int | None = None

    def __post_init__(self) -> None:
        if self.speculative_config is not None and self.async_scheduling:
            raise ValueError("speculative decoding does not work with async scheduling")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be non-negative")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be at least max_model_len "
                f"({self.max_model_len}), or long prompts could never be scheduled")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    # Physical KV blocks, including the reserved null block 0 (so num_blocks - 1 are usable).
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    # Per KV layer group, its attention window (0: full attention); block ids travel in
    # this order.
    sliding_windows: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (block 0 is reserved), "
                             f"got {self.num_blocks}")
