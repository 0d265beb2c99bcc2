"""The 8-bit-activation GGUF products (`--quantization gguf_a8`; worker/kernels/gguf_a8.h) in
torch: the activation quantization they do and the product they approximate, for the tests
and as the fallback where the native library cannot be built.

Not exact: x is rounded per block of 32 to int8 with a float32 scale (llama.cpp's Q8_0/Q8_1
with float32 instead of float16 scales), so y = x̂ · Wᵀ with x̂ = d · a, where the weights W
are decoded exactly. The kernels compute each block's Σ q·a as an exact integer sum; what
remains is float32 rounding of the per-block scaling and of the sum over blocks.
"""
from __future__ import annotations

import torch

from worker.native import gguf_ops
from worker.native.q8_activations import BLOCK, quantize_dequantize, quantize_reference

__all__ = ["BLOCK", "quantize_dequantize", "quantize_reference", "supported",
           "matmul_reference"]


def supported(qtype: str | int) -> bool:
    """An 8-bit-activation kernel exists for this GGML type (by name or code)."""
    return gguf_ops.supported(qtype) and gguf_ops.gguf_type(qtype).name in gguf_ops.A8_TYPES


def matmul_reference(x: torch.Tensor, qweight: torch.Tensor, qtype: str | int, n: int,
                     k: int) -> torch.Tensor:
    """float64 [M, N]: x̂ · Wᵀ with the exact weights (what the kernels round to float32)."""
    w = gguf_ops.dequantize_reference(qweight, qtype, n, k).double()
    return quantize_dequantize(x).double() @ w.T
