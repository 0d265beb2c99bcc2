"""Activations quantized to 8 bits per block of 32, as the `gguf_a8` products do
(worker/kernels/gguf_a8.h; llama.cpp's Q8_0/Q8_1 with float32 scales), or per token, as the
`w8a8` products do (worker/kernels/w8a8.h; vLLM's dynamic per-token int8), in torch: the
references the kernels equal bit for bit, and the fallback's rounding where they cannot be
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


def quantize_tokens_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x float32 [M, K] -> q int8 [M, K], scale float32 [M], bit for bit the w8a8 kernels'
    (float32 throughout): scale = amax / 127, q = clamp(round_half_even(x * (1 / scale)),
    -127, 127), q = 0 for an all-zero row."""
    x = x.float()
    scale = x.abs().amax(-1) / torch.tensor(127.0)
    inv = torch.where(scale != 0, torch.tensor(1.0) / scale, torch.zeros_like(scale))
    q = torch.round(x * inv[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_dequantize_tokens(x: torch.Tensor) -> torch.Tensor:
    """x̂ = scale · q per token (float32 [M, K]): the activations the w8a8 products see."""
    q, scale = quantize_tokens_reference(x)
    return q.float() * scale[:, None]
