"""Tensor-parallel linear layers. Each parameter's `weight_loader` shards a checkpoint tensor.

Column-parallel layers split the output features across ranks (no communication); row-parallel
layers split the input features and all-reduce the partial outputs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.tensor_parallel import TensorParallel


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's rows (output features) split across ranks."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel,
                 bias: bool = False) -> None:
        super().__init__()
        self.tp = tp
        self.out_per_rank = tp.shard(out_features, "output features")
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.out_per_rank), requires_grad=False) \
            if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        start = self.tp.rank * self.out_per_rank
        param.data.copy_(loaded.narrow(0, start, self.out_per_rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one matmul (gate and up).

    Each rank's weight is `[shard of part 0; shard of part 1; ...]`.
    """

    def __init__(self, in_features: int, part_sizes: list[int], tp: TensorParallel) -> None:
        super().__init__(in_features, sum(part_sizes), tp)
        self.part_sizes = [tp.shard(size, "merged projection") for size in part_sizes]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,  # type: ignore[override]
                      part: int = 0) -> None:
        size = self.part_sizes[part]
        offset = sum(self.part_sizes[:part])
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp.rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Query, key and value projections in one matmul, split by attention heads.

    Each rank holds `num_heads / tp` query heads and `max(1, num_kv_heads / tp)` key/value
    heads; with fewer KV heads than ranks, KV heads are replicated (rank r uses KV head
    `r * num_kv_heads // tp`). Per rank the output is `[q | k | v]`.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 tp: TensorParallel, bias: bool = False) -> None:
        self.num_heads = tp.shard(num_heads, "num_attention_heads")
        if num_kv_heads >= tp.world_size:
            self.num_kv_heads = tp.shard(num_kv_heads, "num_key_value_heads")
        elif tp.world_size % num_kv_heads:
            raise ValueError(f"num_key_value_heads ({num_kv_heads}) must divide the "
                             f"tensor-parallel size ({tp.world_size})")
        else:
            self.num_kv_heads = 1
        self.head_dim = head_dim
        self.kv_head_start = tp.rank * num_kv_heads // tp.world_size if \
            num_kv_heads < tp.world_size else tp.rank * self.num_kv_heads
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp.world_size
        super().__init__(hidden_size, out, tp, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,  # type: ignore[override]
                      part: str = "q") -> None:
        d = self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        if part == "q":
            offset, size, start = 0, q_size, self.tp.rank * q_size
        else:
            offset = q_size if part == "k" else q_size + kv_size
            size, start = kv_size, self.kv_head_start * d
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, start, size))


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard W_shard^T) + b with W's columns (input features) split."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel,
                 bias: bool = False) -> None:
        super().__init__()
        self.tp = tp
        self.in_per_rank = tp.shard(in_features, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) \
            if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param is self.bias:
            param.data.copy_(loaded)
            return
        start = self.tp.rank * self.in_per_rank
        param.data.copy_(loaded.narrow(1, start, self.in_per_rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y
