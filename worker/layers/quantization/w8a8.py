"""`--quantization w8a8`: a dense checkpoint quantized at load to int8 weights, one symmetric
scale per output channel (int8.quantize_rows: amax / 127, round half to even, [-127, 127]),
multiplied with activations quantized per token to int8 at run time (vLLM's CPU W8A8 with
dynamic per-token symmetric activations; worker/native/w8a8.py, worker/kernels/w8a8.h).
NOT exact: an opt-in trade of accuracy for int32 dot products (VNNI / AVX2), held to the
accuracy contract its tests check (perplexity, agreement with float32).

Tensor parallelism: each rank quantizes its own share after loading, so a column-parallel
layer's scales follow its rows and a row-parallel layer's rows get one scale per rank's part
of K (as its activations do: each rank quantizes the tokens' part it holds, as in vLLM).
The embedding and the LM head stay exact (vLLM leaves lm_head unquantized); a MoE layer's
experts are weight-only int8 (Int8FusedMoEMethod: activations exact), there being no W8A8
expert kernel. A rank whose K is not a multiple of 32 runs the torch reference.
"""
from __future__ import annotations

import torch
from torch import nn

from worker.layers.quantization.base import (
    LinearMethodBase,
    NativeWeights,
)
from worker.layers.quantization.int8 import (
    Int8Config,
    Int8LinearMethod,
    quantize_rows,
)
from worker.layers.quantization.unquantized import (
    UnquantizedLMHeadMethod,
)
from worker.native import gguf_ops
from worker.native import w8a8 as w8a8_ops
from worker.native.gguf_matrix import GgufMatrix


class W8A8Matrix:
    """W = scale[:, None] * q (q int8 [N, K], scale float32 [N]) bound for many products with
    per-token int8 activations: the native kernel (I8 rows, A8_FLAG) where K is whole blocks
    of 32 and the library is built, else the torch reference."""

    __slots__ = ("q", "scale", "_matrix")

    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        self.q, self.scale = q, scale
        n, k = q.shape
        self._matrix = (GgufMatrix(q.view(torch.uint8), gguf_ops.W8A8_TYPE, n, k, a8=True)
                        if k % 32 == 0 and gguf_ops.native() is not None else None)

    def native_weights(self) -> NativeWeights | None:
        """The matrix (code I8 | A8_FLAG) and the row scales, for the native layer loop."""
        if self._matrix is None:
            return None
        return NativeWeights(((self._matrix, 0, self._matrix.n),), self.scale)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 -> [M, N] float32."""
        if self._matrix is None:
            return w8a8_ops.matmul_reference(x, self.q, self.scale).float()
        return self._matrix(x).mul_(self.scale)


class W8A8LinearMethod(Int8LinearMethod):
    """Loads a float `weight` [out_per_rank, in_per_rank]; after loading, `weight` is int8 and
    `weight_scale` float32 [out_per_rank]; products quantize x per token."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q, scale = quantize_rows(layer.weight)
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = scale
        layer.int8_matrix = W8A8Matrix(q, scale)

    def compute_dtype(self, layer: nn.Module) -> torch.dtype:
        return torch.float32


class W8A8Config(Int8Config):
    """Every linear layer W8A8; embedding and LM head dense; experts weight-only int8."""

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase:
        return W8A8LinearMethod()

    def get_lm_head_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase:
        return UnquantizedLMHeadMethod()
