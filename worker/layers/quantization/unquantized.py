"""Dense weights: F.linear, or oneDNN with each weight packed once after loading where
`onednn_linear.enabled` (a CPU device)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.layers import bf16_linear, onednn_linear
from worker.layers.quantization.base import (
    EmbeddingMethodBase,
    FusedMoEMethodBase,
    LinearMethodBase,
    QuantizationConfig,
    ShardDims,
    parameter,
)
from worker.native import gguf_ops
from worker.native.fused_moe import bind_stacked


class UnquantizedLinearMethod(LinearMethodBase):
    """`weight` [out_per_rank, in_per_rank] in the compute dtype, packed after loading. A
    bfloat16 weight on a CPU where float32 FMAs outrun bf16 products (bf16_linear.py) also
    gets `weight_float32`, a packed float32 copy; the layer then takes and returns float32."""

    def create_weights(self, layer: nn.Module, in_per_rank: int, out_per_rank: int) -> None:
        layer.weight = parameter(torch.empty(out_per_rank, in_per_rank), ShardDims())

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.weight_float32 = bf16_linear.float32_copy(layer.weight)
        if onednn_linear.enabled(layer.weight.device):
            layer.weight = onednn_linear.packed_parameter(layer.weight)

    def compute_dtype(self, layer: nn.Module) -> torch.dtype:
        if getattr(layer, "weight_float32", None) is not None:
            return torch.float32
        return layer.weight.dtype

    def cache_dtype(self, layer: nn.Module) -> torch.dtype:
        """The weight's dtype (bfloat16 keeps its KV cache when multiplied in float32)."""
        return layer.weight.dtype

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        weight_float32 = getattr(layer, "weight_float32", None)
        if weight_float32 is not None:
            return bf16_linear.linear(x, layer.weight, weight_float32, bias)
        return onednn_linear.linear(x, layer.weight, bias)


def _vocab_table(layer: nn.Module, hidden_size: int, rows_per_rank: int) -> None:
    """`weight` [rows_per_rank, hidden_size]; rows past the vocabulary (the last rank's
    padding) stay zero."""
    layer.weight = parameter(torch.zeros(rows_per_rank, hidden_size), ShardDims())


class UnquantizedEmbeddingMethod(EmbeddingMethodBase):
    def create_weights(self, layer: nn.Module, in_per_rank: int, out_per_rank: int) -> None:
        _vocab_table(layer, in_per_rank, out_per_rank)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """The dense table is final as loaded (a tied LM head shares it)."""

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, layer.weight)


class UnquantizedLMHeadMethod(LinearMethodBase):
    """Logits in float32 whatever the compute dtype: a half-precision product rounds logits
    to 8 (bf16) bits, which turns near-ties into exact ties and flips greedy tokens. A float32
    table is packed for oneDNN on a CPU (`weight_float32`). A bfloat16 or float16 table on a
    CPU with the GGUF library is multiplied as it is (its weights widened to float32 in
    registers, float32 sums: the float32 copy's values, reading half the bytes); elsewhere
    `weight_float32` is a float32 copy. A bfloat16 table where float32 FMAs outrun bf16
    products (bf16_linear.py) also gets the packed float32 copy, used from FLOAT32_ROWS rows.
    `weight` stays the dense table a tied embedding shares."""

    def create_weights(self, layer: nn.Module, in_per_rank: int, out_per_rank: int) -> None:
        _vocab_table(layer, in_per_rank, out_per_rank)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        table = layer.weight.detach()
        layer.dense_ops = None
        if (table.dtype in (torch.bfloat16, torch.float16) and table.is_cpu
                and table.shape[1] % gguf_ops.DENSE_BLOCK == 0 and (ops := gguf_ops.native()) is not None):
            layer.dense_ops = ops
            layer.weight_float32 = bf16_linear.float32_copy(table)
            return
        weight = table.float()
        layer.weight_float32 = (onednn_linear.pack(weight)
                                if onednn_linear.enabled(weight.device) else weight)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [n, hidden] -> [n, rows_per_rank] float32."""
        if layer.dense_ops is not None:
            rows = x.numel() // x.shape[-1]
            if layer.weight_float32 is not None and rows >= bf16_linear.FLOAT32_ROWS:
                return onednn_linear.linear(x.float(), layer.weight_float32,
                                            None if bias is None else bias.float())
            logits = layer.dense_ops.dense_matmul(x.float(), layer.weight.data)
            return logits if bias is None else logits.add_(bias)
        return onednn_linear.linear(x.float(), layer.weight_float32, bias)


class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
    """Dense experts in the model dtype (float32, bfloat16 or float16, as the loader casts
    them), multiplied by the fused kernel with float32 accumulation."""

    def create_weights(self, layer: nn.Module, num_experts: int, hidden: int,  # type: ignore[override]
                       inter_per_rank: int) -> None:
        layer.w13_weight = parameter(torch.empty(num_experts, 2 * inter_per_rank, hidden),
                                     ShardDims())
        layer.w2_weight = parameter(torch.empty(num_experts, hidden, inter_per_rank),
                                    ShardDims())

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.fused_experts = bind_stacked(layer.w13_weight.data, layer.w2_weight.data,
                                           layer.w2_weight.shape[1])

    def compute_dtype(self, layer: nn.Module) -> torch.dtype:
        return layer.w13_weight.dtype


class UnquantizedConfig(QuantizationConfig):
    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase:
        return UnquantizedLinearMethod()

    def get_embedding_method(self, layer: nn.Module, prefix: str) -> EmbeddingMethodBase:
        return UnquantizedEmbeddingMethod()

    def get_lm_head_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase:
        return UnquantizedLMHeadMethod()

    def get_moe_method(self, layer: nn.Module, prefix: str) -> FusedMoEMethodBase:
        return UnquantizedFusedMoEMethod()
