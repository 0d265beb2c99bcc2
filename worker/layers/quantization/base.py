"""The weight-method interfaces a quantization config hands to each layer, and where a
parameter's features lie so that tensor-parallel loading can cut any of its parameters."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from worker.distributed.tensor_parallel import TensorParallel
    from worker.native.gguf_matrix import GgufMatrix


@dataclass(frozen=True, slots=True)
class ShardDims:
    """Where a parameter's features lie relative to its layer's logical weight
    `[out_features, in_features]`, so a weight_loader cuts every parameter (a dense weight,
    packed quantized blocks, their scales, a bias) by the same feature ranges.

    Output features run along `output_dim` and input features along `input_dim` (None: the
    parameter is not split by them and every rank loads all of it, e.g. a per-tensor scale or
    a row-parallel bias). One stored element along a dim covers `output_block`/`input_block`
    features (e.g. 32 inputs per quantized block), so a rank's ranges must be whole blocks;
    along the input dim a block may span `input_block_stored` elements (a GGUF row's bytes:
    32 weights of Q4_1 in 20 bytes)."""

    output_dim: int | None = 0
    input_dim: int | None = 1
    output_block: int = 1
    input_block: int = 1
    input_block_stored: int = 1

    def output(self, tensor: torch.Tensor, start: int, size: int) -> torch.Tensor:
        """The part of `tensor` holding output features `[start, start + size)`."""
        return _narrow(tensor, self.output_dim, start, size, self.output_block)

    def input(self, tensor: torch.Tensor, start: int, size: int) -> torch.Tensor:
        """The part of `tensor` holding input features `[start, start + size)`."""
        return _narrow(tensor, self.input_dim, start, size, self.input_block,
                       self.input_block_stored)


def _narrow(tensor: torch.Tensor, dim: int | None, start: int, size: int, block: int,
            stored: int = 1) -> torch.Tensor:
    if dim is None:
        return tensor
    if start % block or size % block:
        raise ValueError(f"features [{start}, {start + size}) are not whole blocks of {block}")
    return tensor.narrow(dim, start // block * stored, size // block * stored)


def parameter(data: torch.Tensor, dims: ShardDims) -> nn.Parameter:
    """A frozen parameter carrying where its features lie (`param.shard_dims`)."""
    param = nn.Parameter(data, requires_grad=False)
    param.shard_dims = dims
    return param


class QuantizeMethodBase(ABC):
    """Owns one layer's weight parameters: creates them, finishes them after loading."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, in_per_rank: int, out_per_rank: int) -> None:
        """Register on `layer` the parameters holding this rank's `[out_per_rank, in_per_rank]`
        share of the weight, each made with `parameter`. Floating-point parameters are float32
        placeholders that the loader casts to the compute dtype; others keep their dtype."""

    @abstractmethod
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once when every weight is loaded (no weight_loader runs after): the final
        form, e.g. a packed or repacked layout."""


@dataclass(frozen=True, slots=True)
class NativeWeights:
    """A linear layer's weight as native callers take it (worker/native/cpu_decoder.py):
    `segments` (matrix, start, stop) cover output rows [start, stop) in order, each matrix a
    GgufMatrix or anything with its `code`, `qweight` (uint8 rows) and `k` (dense 16-bit rows:
    unquantized.DenseRows); `scale` (float32 [out_per_rank], or None) multiplies output
    column n by scale[n] afterwards; `max_rows`: the most x rows whose products equal
    `apply`'s this way (None: any)."""

    segments: tuple[tuple[GgufMatrix, int, int], ...]
    scale: torch.Tensor | None = None
    max_rows: int | None = None


class LinearMethodBase(QuantizeMethodBase):
    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in_per_rank] -> x W^T + b [..., out_per_rank]."""

    def compute_dtype(self, layer: nn.Module) -> torch.dtype:
        """The dtype `apply` takes and returns: the dense weight's; quantized methods say."""
        return layer.weight.dtype

    def cache_dtype(self, layer: nn.Module) -> torch.dtype:
        """The dtype in which the activations this layer makes are stored (a QKV projection's
        KV cache): `compute_dtype`, unless the method computes in float32 for speed alone."""
        return self.compute_dtype(layer)

    def native_weights(self, layer: nn.Module) -> NativeWeights | None:
        """The weight as GGUF-kernel matrices, whose products equal `apply`'s (without the
        bias); None where this method has no such form."""
        return None


class EmbeddingMethodBase(QuantizeMethodBase):
    @abstractmethod
    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """ids [n] within this rank's rows -> their rows [n, hidden] in the compute dtype."""


class FusedMoEMethodBase(QuantizeMethodBase):
    """A FusedMoE layer's expert weights (worker/layers/fused_moe/layer.py): `w13_weight`
    (gate and up of each expert, [E, 2 * inter_per_rank, hidden] as stored) and `w2_weight`
    (down, [E, hidden, inter_per_rank]); each parameter's `shard_dims` describe one expert's
    [out, in] matrix. After loading, `layer.fused_experts` (worker/native/fused_moe.py) is
    bound to them and runs every product."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, num_experts: int, hidden: int,  # type: ignore[override]
                       inter_per_rank: int) -> None:
        """Register `w13_weight` and `w2_weight` on `layer`, made with `parameter`."""

    def compute_dtype(self, layer: nn.Module) -> torch.dtype:
        """The dtype of the layers around these experts: the dense weights' (as a dense
        linear method says), float32 for quantized ones. The experts themselves take and
        return float32 whatever their weights' dtype."""
        return torch.float32

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] float32, the routing [T, top_k] -> this rank's partial sum
        Σ_j weight · expert(x) [T, hidden] float32 (not reduced across ranks)."""
        return layer.fused_experts(x, topk_weights, topk_ids)


class QuantizationConfig(ABC):
    """Which weight method each layer gets; `prefix` is the layer's name in the model
    (`model.layers.0.self_attn.qkv_proj`), for configs that treat some layers differently."""

    @abstractmethod
    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase:
        """A tensor-parallel linear layer's method."""

    @abstractmethod
    def get_embedding_method(self, layer: nn.Module, prefix: str) -> EmbeddingMethodBase:
        """The vocabulary embedding's method (weights `[rows_per_rank, hidden]`)."""

    @abstractmethod
    def get_lm_head_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase:
        """The LM head's method (weights `[rows_per_rank, hidden]`); its `apply` returns
        float32 logits whatever the compute dtype."""

    def process_model_after_loading(self, model: nn.Module, tp: TensorParallel,
                                    model_dir: str) -> None:
        """Runs once every weight is loaded, before the layers' methods finish theirs (e.g.
        w8a8's smoothing, which rewrites float weights across layers). Default: nothing."""

    def get_moe_method(self, layer: nn.Module, prefix: str) -> FusedMoEMethodBase:
        """A FusedMoE layer's method (`prefix`: the layer's name, e.g.
        `model.layers.0.mlp.experts`)."""
        raise NotImplementedError(f"{type(self).__name__} has no mixture-of-experts weights")
