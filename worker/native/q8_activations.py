"""Activations quantized to 8 bits per block of 32, as the `gguf_a8` products do
(worker/kernels/gguf_a8.h; llama.cpp's Q8_0/Q8_1 with float32 scales), in torch: the
reference the kernels equal bit for bit, and the fallback's rounding where they cannot be
built. Depends on nothing of ours (gguf_ops uses it without an import circle)."""
from __future__ import annotations

import torch

BLOCK = 32


def quantize_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x float32 [M, K] -> q int8 [M, K], d and s float32 [M, K / 32], bit for bit the
    kernels' (float32 throughout, round half to even): d = amax / 127, q = round(x * (1 / d)),
    s = d * Σ q."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // BLOCK, BLOCK)
    d = blocks.abs().amax(-1) / torch.tensor(127.0)
    inv = torch.where(d != 0, torch.tensor(1.0) / d, torch.zeros_like(d))
    q = torch.round(blocks * inv[..., None]).to(torch.int8)
    s = d * q.sum(-1, dtype=torch.int32).float()
    return q.reshape(m, k), d, s


def quantize_dequantize(x: torch.Tensor) -> torch.Tensor:
    """x̂ = d · q per block (float32 [M, K]): the activations the products see."""
    q, d, _ = quantize_reference(x)
    m, k = x.shape
    return (q.reshape(m, k // BLOCK, BLOCK).float() * d[..., None]).reshape(m, k)
