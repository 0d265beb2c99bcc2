"""The w8a8 products (`--quantization w8a8`; worker/kernels/w8a8.h) in torch: the per-token
activation quantization they do and the product they compute, for the tests and as the
fallback where the native library cannot be built.

Not exact: each token (row of x) is rounded to int8 with one float32 scale, amax / 127
(vLLM's dynamic per-token symmetric int8), and the weights are int8 rows with one scale per
output channel. The kernels sum Σ a·q exactly in int32; y = float(Σ) · a_scale · w_scale.
"""
from __future__ import annotations

import torch

from worker.native import gguf_ops
from worker.native.q8_activations import quantize_dequantize_tokens, quantize_tokens_reference

__all__ = ["quantize_tokens_reference", "quantize_dequantize_tokens", "matmul_reference",
           "matmul"]


def matmul_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float64 [M, N] = x̂ · (scale · q)ᵀ for x float32 [M, K], q int8 [N, K], scale [N]: the
    integer sums exact (float64 holds them), then the scales."""
    a, a_scale = quantize_tokens_reference(x)
    sums = a.double() @ q.double().T
    return sums * a_scale.double()[:, None] * scale.double()[None, :]


def matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 · (scale · q)ᵀ -> [M, N] float32: the native kernel (K a multiple of
    32), else the reference rounded to float32."""
    n, k = q.shape
    if gguf_ops.native() is None or k % 32:
        return matmul_reference(x, q, scale).float()
    y = gguf_ops.matmul(x, q.view(torch.uint8), gguf_ops.W8A8_TYPE, n, k, a8=True)
    return y.mul_(scale)
