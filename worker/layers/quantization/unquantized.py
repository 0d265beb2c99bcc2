"""Dense weights: F.linear, or oneDNN with each weight packed once after loading where
`onednn_linear.enabled` (a CPU device)."""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from worker.layers import bf16_linear, onednn_linear
from worker.layers.quantization.base import (
    EmbeddingMethodBase,
    FusedMoEMethodBase,
    LinearMethodBase,
    NativeWeights,
    QuantizationConfig,
    ShardDims,
    parameter,
)
from worker.native import gguf_ops
from worker.native.fused_moe import bind_stacked


@dataclass(frozen=True, slots=True)
class DenseRows:
    """A dense weight [N, K] as gguf_matmul's dense driver takes it: `qweight` its rows' bytes
    (a uint8 view [N, K * element size]), `code` gguf_ops.DENSE_CODES' code of its dtype."""

    qweight: torch.Tensor
    code: int
    k: int


class UnquantizedLinearMethod(LinearMethodBase):
    """`weight` [out_per_rank, in_per_rank] in the compute dtype, packed for oneDNN after
    loading, with two routes for a 16-bit weight on a CPU (bf16_linear.py says when):

    - `weight_rows`, the plain rows of a bfloat16/float16 weight (K a multiple of 32, the GGUF
      library built), multiplied by gguf_matmul's dense driver: each weight widened to float32
      in registers, float32 sums, read at memory speed (oneDNN's bf16 product at one row read
      ~17 GB/s here). It takes up to `dense_rows` rows: every row count where this CPU's bf16
      products are slower than its float32 FMAs (then no packed bf16 copy is made), else up
      to DENSE_ROWS where oneDNN does not pack the weight.
    - `weight_float32`, a packed float32 copy of a bfloat16 weight, where float32 FMAs outrun
      bf16 products: for `bf16_linear.dense_float32_rows()` rows and more beside the plain
      rows (below it the dense driver), else FLOAT32_ROWS; the layer takes and returns float32.

    A weight is held once, or twice (its bf16 bytes and the float32 copy's) on the float32
    route; `DELTASERVE_BF16_LINEARS=bfloat16` keeps one copy."""

    def create_weights(self, layer: nn.Module, in_per_rank: int, out_per_rank: int) -> None:
        layer.weight = parameter(torch.empty(out_per_rank, in_per_rank), ShardDims())

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight.data
        layer.weight_float32 = bf16_linear.float32_copy(weight)
        layer.dense_ops = gguf_ops.dense_few_rows(weight)
        layer.weight_rows = weight if layer.dense_ops is not None else None
        layer.dense_rows = gguf_ops.DENSE_ROWS
        if not onednn_linear.enabled(weight.device):
            return
        if layer.dense_ops is not None and bf16_linear.products_slow(weight.dtype):
            layer.dense_rows = sys.maxsize
            return
        layer.weight = onednn_linear.packed_parameter(layer.weight)
        if layer.weight.is_mkldnn:  # one copy: oneDNN's serves every row count
            layer.dense_ops = layer.weight_rows = None

    def compute_dtype(self, layer: nn.Module) -> torch.dtype:
        if getattr(layer, "weight_float32", None) is not None:
            return torch.float32
        return layer.weight.dtype

    def cache_dtype(self, layer: nn.Module) -> torch.dtype:
        """The weight's dtype (bfloat16 keeps its KV cache when multiplied in float32)."""
        return layer.weight.dtype

    def native_weights(self, layer: nn.Module) -> NativeWeights | None:
        """The plain 16-bit rows where `apply` multiplies them by the dense driver and returns
        float32 (a bf16 weight on the float32 route: `weight_float32` beside them), for the
        row counts it does so; None elsewhere (oneDNN's products, or outputs rounded to
        16 bits)."""
        rows = getattr(layer, "weight_rows", None)
        if rows is None or getattr(layer, "weight_float32", None) is None:
            return None
        n, k = rows.shape
        matrix = DenseRows(rows.view(torch.uint8), gguf_ops.DENSE_CODES[rows.dtype], k)
        return NativeWeights(((matrix, 0, n),),
                             max_rows=min(layer.dense_rows, bf16_linear.dense_float32_rows() - 1))

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        weight_float32 = getattr(layer, "weight_float32", None)
        ops = getattr(layer, "dense_ops", None)
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if (ops is not None and x.dim() == 2 and rows <= layer.dense_rows
                and (weight_float32 is None or rows < bf16_linear.dense_float32_rows())):
            y = ops.dense_matmul(x.float(), layer.weight_rows)
            y = y if bias is None else y.add_(bias)
            return y if weight_float32 is not None else y.to(x.dtype)
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
    products (bf16_linear.py) also gets the packed float32 copy, used from
    `bf16_linear.dense_float32_rows()` rows.
    `weight` stays the dense table a tied embedding shares."""

    def create_weights(self, layer: nn.Module, in_per_rank: int, out_per_rank: int) -> None:
        _vocab_table(layer, in_per_rank, out_per_rank)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        table = layer.weight.detach()
        layer.dense_ops = None
        if (ops := gguf_ops.dense_few_rows(table)) is not None:
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
            if (layer.weight_float32 is not None
                    and rows >= bf16_linear.dense_float32_rows()):
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
