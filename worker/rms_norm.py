"""RMSNorm, computed in float32 with one rounding to the output dtype."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """`weight` stays float32 (the loader keeps it so). Hugging Face rounds the normalized
    input to the model dtype before the weight multiply; here the product is formed in float32
    and rounded once, as vLLM's CPU kernel does (identical to HF in float32)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x: [..., size], any float dtype; returns `out_dtype` (default: x's dtype)."""
        dtype = out_dtype or x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight).to(dtype)
