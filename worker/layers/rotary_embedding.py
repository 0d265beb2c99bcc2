"""Rotary position embedding (the rotate-half form Llama and Qwen use), incl. Llama 3 scaling."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from worker.native.cpu_ops import native_ops


def _inv_freq(head_dim: int, base: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float()
                               / head_dim))
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    return _llama3_inv_freq(inv_freq, scaling)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3: long wavelengths slowed by `factor`, short kept, the band between blended."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Rotates query and key heads by their token's position.

    `cos`/`sin` are float32 tables `[max_positions, head_dim]`, each row `cat(f, f)` with
    `f = position * inv_freq`, exactly as Hugging Face computes them per forward.

    Numerics follow Hugging Face: cos/sin are rounded to q's dtype and the products and sum
    are formed in q's dtype (each rounded), not in float32 with one rounding (which would
    differ from HF in bfloat16 by an ulp now and then). So rotated q/k equal HF's bit for bit
    in every dtype; the native op (worker/kernels/cpu_ops.cpp) reproduces the same rounding.
    """

    def __init__(self, head_dim: int, max_positions: int, base: float,
                 scaling: dict[str, Any] | None) -> None:
        super().__init__()
        inv_freq = _inv_freq(head_dim, base, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim].
        On the CPU (native op available, heads contiguous) q and k are rotated in place and
        returned; otherwise new tensors are."""
        ops = native_ops() if q.is_cpu else None
        if ops is not None and ops.rotary_supported(q, k, self.cos):
            ops.rotary_embedding(positions, q, k, self.cos, self.sin)
            return q, k
        return self.forward_torch(positions, q, k)

    def forward_torch(self, positions: torch.Tensor, q: torch.Tensor,
                      k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
