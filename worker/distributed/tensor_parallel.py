"""This rank's place in the tensor-parallel group, and the two collectives layers need."""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from worker.distributed.shm_all_reduce import ShmAllReduce


class TensorParallel:
    """Passed to every parallel layer; with one rank the collectives are no-ops."""

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of {world_size}")
        self.rank = rank
        self.world_size = world_size
        # Local CPU ranks: small sums and gathers through shared memory instead of gloo's TCP.
        self.shm: ShmAllReduce | None = None

    @staticmethod
    def initialize(rank: int, world_size: int, init_method: str, device: torch.device,
                   timeout_s: float = 60.0) -> TensorParallel:
        """Join the process group: gloo on CPU, NCCL on CUDA."""
        tp = TensorParallel(rank, world_size)
        if world_size > 1:
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=init_method, rank=rank,
                                    world_size=world_size, timeout=timedelta(seconds=timeout_s))
            if device.type == "cpu" and init_method.startswith("file://"):  # all ranks local
                tp.shm = ShmAllReduce.create(rank, world_size, timeout_s)
        return tp

    def shard(self, size: int, what: str) -> int:
        """The per-rank part of a dimension that must split evenly."""
        if size % self.world_size:
            raise ValueError(f"{what} ({size}) is not divisible by the tensor-parallel size "
                             f"({self.world_size})")
        return size // self.world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` in place across the ranks (identical bits on every rank)."""
        if self.world_size > 1 and not (self.shm is not None and self.shm.all_reduce(x)):
            dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dimension, in rank order."""
        if self.world_size == 1:
            return x
        if self.shm is not None and (gathered := self.shm.all_gather(x.contiguous())) is not None:
            return gathered
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def shutdown(self) -> None:
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
