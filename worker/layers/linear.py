"""Tensor-parallel linear layers. Each parameter's `weight_loader` shards a checkpoint tensor.

Column-parallel layers split the output features across ranks (no communication); row-parallel
layers split the input features and all-reduce the partial outputs. A layer's weights belong
to its `quant_method`; loaders cut every parameter by feature ranges through its `shard_dims`.
"""
from __future__ import annotations

import torch
from torch import nn

from worker.distributed.tensor_parallel import TensorParallel
from worker.layers.quantization.base import QuantizationConfig, ShardDims, parameter
from worker.layers.quantization.unquantized import UnquantizedConfig


class LinearBase(nn.Module):
    """Weights from `quant_method` for this rank's `[out_per_rank, in_per_rank]` share; an
    optional bias `[out_per_rank]`, split with the output features. `output_part_sizes`: the
    rows of each checkpoint tensor in this rank's output, in order (one part unless merged)."""

    output_part_sizes: list[int]

    def __init__(self, in_per_rank: int, out_per_rank: int, tp: TensorParallel, bias: bool,
                 quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.tp = tp
        if not hasattr(self, "output_part_sizes"):
            self.output_part_sizes = [out_per_rank]
        self.quant_method = (quant_config or UnquantizedConfig()).get_linear_method(self, prefix)
        self.quant_method.create_weights(self, in_per_rank, out_per_rank)
        self.bias = parameter(torch.empty(out_per_rank), ShardDims(input_dim=None)) \
            if bias else None

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of this layer's input and output."""
        return self.quant_method.compute_dtype(self)

    @property
    def cache_dtype(self) -> torch.dtype:
        """The dtype this layer's outputs are stored in (KV cache), see the method's."""
        return self.quant_method.cache_dtype(self)


class ReplicatedLinear(LinearBase):
    """y = x W^T + b with the whole W on every rank (a router: every rank routes alike)."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel,
                 bias: bool = False, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__(in_features, out_features, tp, bias, quant_config, prefix)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ColumnParallelLinear(LinearBase):
    """y = x W^T + b with W's rows (output features) split across ranks."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel,
                 bias: bool = False, out_per_rank: int | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        self.out_per_rank = out_per_rank or tp.shard(out_features, "output features")
        super().__init__(in_features, self.out_per_rank, tp, bias, quant_config, prefix)

    def output_shard(self, part: object = None) -> tuple[int, int, int]:
        """Where a checkpoint tensor's part goes on this rank: (offset in this rank's output
        rows, rows, first row taken from the tensor). What weight loaders and LoRA's B
        matrices are cut by."""
        return 0, self.out_per_rank, self.tp.rank * self.out_per_rank

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      part: object = None) -> None:
        offset, size, start = self.output_shard(part)
        dims = param.shard_dims
        dims.output(param.data, offset, size).copy_(dims.output(loaded, start, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one matmul (gate and up).

    Each rank's weight is `[shard of part 0; shard of part 1; ...]`.
    """

    def __init__(self, in_features: int, part_sizes: list[int], tp: TensorParallel,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        self.part_sizes = [tp.shard(size, "merged projection") for size in part_sizes]
        self.output_part_sizes = self.part_sizes
        super().__init__(in_features, sum(part_sizes), tp, quant_config=quant_config,
                         prefix=prefix)

    def output_shard(self, part: object = 0) -> tuple[int, int, int]:
        size = self.part_sizes[part]
        return sum(self.part_sizes[:part]), size, self.tp.rank * size


class QKVParallelLinear(ColumnParallelLinear):
    """Query, key and value projections in one matmul, split by whole GQA groups.

    With at least as many KV heads as ranks, rank r holds a contiguous run of KV heads (as
    even as possible: 3 heads over 2 ranks are 2 + 1) and their query heads, so no group is
    cut and the ranks' shares may differ. With fewer KV heads than ranks, KV heads are
    replicated (rank r uses KV head `r * num_kv_heads // tp`) and query heads split evenly.
    Per rank the output is `[q | k | v]`; `q_start`/`num_heads` locate its query heads (the
    row-parallel o_proj takes the same slice of its input features).
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 tp: TensorParallel, bias: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        world, rank = tp.world_size, tp.rank
        if num_kv_heads >= world:
            self.kv_head_start, self.num_kv_heads = _even_part(num_kv_heads, world, rank)
            group = num_heads // num_kv_heads
            self.q_start, self.num_heads = self.kv_head_start * group, self.num_kv_heads * group
        elif world % num_kv_heads:
            raise ValueError(f"num_key_value_heads ({num_kv_heads}) must divide the "
                             f"tensor-parallel size ({world})")
        else:
            self.num_heads = tp.shard(num_heads, "num_attention_heads")
            self.q_start = rank * self.num_heads
            self.num_kv_heads, self.kv_head_start = 1, rank * num_kv_heads // world
        self.head_dim = head_dim
        kv_rows = self.num_kv_heads * head_dim
        self.output_part_sizes = [self.num_heads * head_dim, kv_rows, kv_rows]
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, tp, bias,
                         out_per_rank=(self.num_heads + 2 * self.num_kv_heads) * head_dim,
                         quant_config=quant_config, prefix=prefix)

    def output_shard(self, part: object = "q") -> tuple[int, int, int]:
        d = self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        if part == "q":
            return 0, q_size, self.q_start * d
        return (q_size if part == "k" else q_size + kv_size), kv_size, self.kv_head_start * d


def _even_part(total: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of part `index` when `total` items are split into `parts` contiguous
    parts whose sizes differ by at most one, the larger ones first."""
    base, extra = divmod(total, parts)
    return index * base + min(index, extra), base + (index < extra)


class RowParallelLinear(LinearBase):
    """y = all_reduce(x_shard W_shard^T) + b with W's columns (input features) split: evenly,
    or as `shard` = (start, size) gives (o_proj follows the query heads' uneven split). With
    `reduce_results=False` it returns this rank's partial product (no bias): the caller adds
    it to other partial sums and reduces once."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel,
                 bias: bool = False, shard: tuple[int, int] | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 reduce_results: bool = True) -> None:
        if shard is None:
            size = tp.shard(in_features, "input features")
            shard = (tp.rank * size, size)
        self.in_start, self.in_per_rank = shard
        if bias and not reduce_results:
            raise ValueError(f"{prefix}: a bias needs the reduced result")
        self.reduce_results = reduce_results
        super().__init__(self.in_per_rank, out_features, tp, bias, quant_config, prefix)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Weights lose the other ranks' input features; the bias (not split) loads whole."""
        param.data.copy_(param.shard_dims.input(loaded, self.in_start, self.in_per_rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x)
        if not self.reduce_results:
            return y
        y = self.tp.all_reduce(y)
        return y + self.bias if self.bias is not None else y
