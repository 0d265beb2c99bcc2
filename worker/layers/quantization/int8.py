"""Weight-only int8, quantized at load from a float checkpoint: one symmetric scale per output
channel (row), `w ≈ scale[n] * q[n, k]` with q in [-127, 127] and scale = max|w[n]| / 127.

Products run through the native GGUF kernels' I8 type (int8 decoded in registers, float32
accumulation) and are then multiplied by the row scales; a rank whose input features are not
whole blocks of 32 uses torch's `_weight_int8pack_mm` instead. Activations and results are
float32. The embedding stays dense; the LM head gets its own int8 copy (a tied embedding keeps
the dense table).
"""
from __future__ import annotations

import torch
from torch import nn

from worker.layers.quantization.base import (
    EmbeddingMethodBase,
    FusedMoEMethodBase,
    LinearMethodBase,
    NativeWeights,
    QuantizationConfig,
    ShardDims,
    parameter,
)
from worker.layers.quantization.unquantized import (
    UnquantizedEmbeddingMethod,
    UnquantizedFusedMoEMethod,
)
from worker.native import gguf_ops
from worker.native.fused_moe import bind_stacked
from worker.native.gguf_matrix import GgufMatrix

I8 = gguf_ops.gguf_type("I8")


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (int8 [N, K], float32 scales [N]); an all-zero row gets scale 1."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


class Int8Matrix:
    """W = scale[:, None] * q (q int8 [N, K], scale float32 [N]) bound for many products:
    the I8 kernel where K is whole blocks of 32, else torch's `_weight_int8pack_mm`."""

    __slots__ = ("q", "scale", "_matrix")
    a8 = False  # x multiplied as it is (True: quantized per token, W8A8Matrix)

    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        self.q, self.scale = q, scale
        n, k = q.shape
        self._matrix = (GgufMatrix(q.view(torch.uint8), I8.code, n, k, a8=self.a8)
                        if k % I8.block_elems == 0 else None)

    def native_weights(self) -> NativeWeights | None:
        """The I8 matrix and the row scales (None where torch's kernel runs instead)."""
        if self._matrix is None:
            return None
        return NativeWeights(((self._matrix, 0, self._matrix.n),), self.scale)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 -> [M, N] float32."""
        if self._matrix is None:
            return self._unblocked(x)
        return self._matrix(x).mul_(self.scale)

    def _unblocked(self, x: torch.Tensor) -> torch.Tensor:
        """The product where K is not whole blocks of 32: torch's kernel."""
        return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale)


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 · (scale * q)ᵀ -> [M, N] float32 (one product; layers bind)."""
    return Int8Matrix(q, scale)(x)


class Int8LinearMethod(LinearMethodBase):
    """Loads a float `weight` [out_per_rank, in_per_rank]; after loading, `weight` is int8
    and `weight_scale` float32 [out_per_rank], bound as a `matrix`."""

    matrix = Int8Matrix

    def create_weights(self, layer: nn.Module, in_per_rank: int, out_per_rank: int) -> None:
        layer.weight = parameter(torch.empty(out_per_rank, in_per_rank), ShardDims())

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q, scale = quantize_rows(layer.weight)
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = scale
        layer.int8_matrix = self.matrix(q, scale)

    def compute_dtype(self, layer: nn.Module) -> torch.dtype:
        return torch.float32

    def native_weights(self, layer: nn.Module) -> NativeWeights | None:
        return layer.int8_matrix.native_weights()

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [tokens, in_per_rank] float32 -> [tokens, out_per_rank] float32."""
        y = layer.int8_matrix(x)
        return y if bias is None else y.add_(bias)


class Int8LMHeadMethod(LinearMethodBase):
    """`weight` stays the dense table (a tied embedding shares it); `weight_int8` and
    `weight_scale` are its int8 form, made after loading. Logits are float32."""

    def create_weights(self, layer: nn.Module, in_per_rank: int, out_per_rank: int) -> None:
        layer.weight = parameter(torch.zeros(out_per_rank, in_per_rank), ShardDims())

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.weight_int8, layer.weight_scale = quantize_rows(layer.weight)
        layer.int8_matrix = Int8Matrix(layer.weight_int8, layer.weight_scale)

    def compute_dtype(self, layer: nn.Module) -> torch.dtype:
        return torch.float32

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [n, hidden] -> [n, rows_per_rank] float32."""
        y = layer.int8_matrix(x.float())
        return y if bias is None else y.add_(bias)


class Int8FusedMoEMethod(UnquantizedFusedMoEMethod):
    """Loads float experts; after loading, `w13_weight` and `w2_weight` are int8 with
    `w13_scale` [E, 2 * inter] and `w2_scale` [E, hidden] float32 (one scale per expert row),
    multiplied by the fused kernel's I8 type (hidden and inter multiples of 32; else its
    torch fallback)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        quantized = []
        for name in ("w13_weight", "w2_weight"):
            w = getattr(layer, name).data
            q, scale = quantize_rows(w.reshape(-1, w.shape[2]))
            setattr(layer, name, nn.Parameter(q.view(w.shape), requires_grad=False))
            quantized.append((q.view(torch.uint8).view(w.shape), scale.view(w.shape[:2])))
        (q13, layer.w13_scale), (q2, layer.w2_scale) = quantized
        layer.fused_experts = bind_stacked(q13, q2, q2.shape[1], (I8.code,) * 3,
                                           layer.w13_scale, layer.w2_scale)

    def compute_dtype(self, layer: nn.Module) -> torch.dtype:
        return torch.float32


class Int8Config(QuantizationConfig):
    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase:
        return Int8LinearMethod()

    def get_embedding_method(self, layer: nn.Module, prefix: str) -> EmbeddingMethodBase:
        return UnquantizedEmbeddingMethod()

    def get_lm_head_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase:
        return Int8LMHeadMethod()

    def get_moe_method(self, layer: nn.Module, prefix: str) -> FusedMoEMethodBase:
        return Int8FusedMoEMethod()
