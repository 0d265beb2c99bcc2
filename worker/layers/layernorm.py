"""RMSNorm, computed in float32 with one rounding to the output dtype; optionally with the
residual add fused in (the residual stream is float32)."""
from __future__ import annotations

import torch
from torch import nn

from worker.native.cpu_ops import native_ops


class RMSNorm(nn.Module):
    """`weight` stays float32 (the loader keeps it so). Hugging Face rounds the normalized
    input to the model dtype before the weight multiply; here the product is formed in float32
    and rounded once, as vLLM's CPU kernel does (identical to HF in float32).

    On the CPU the fused native op (worker/native/cpu_ops.py) runs when it is available and handles
    the layout; `forward_torch`/`add_and_norm_torch` are the fallback and the reference."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x: [..., size], any float dtype; returns `out_dtype` (default: x's dtype)."""
        dtype = out_dtype or x.dtype
        ops = native_ops() if x.is_cpu else None
        if ops is not None and ops.rms_norm_supported(x, self.weight, dtype):
            return ops.rms_norm(x, self.weight, self.eps, dtype)
        return self.forward_torch(x, dtype)

    def forward_torch(self, x: torch.Tensor,
                      out_dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = out_dtype or x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight).to(dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """`residual += x` in place (float32 stream, x [tokens, size] in any float dtype,
        added in float32), then RMSNorm of the updated residual in `out_dtype` (default:
        x's dtype)."""
        dtype = out_dtype or x.dtype
        ops = native_ops() if x.is_cpu else None
        if (ops is not None and ops.rms_norm_supported(x, self.weight, dtype)
                and ops.residual_supported(x, residual)):
            return ops.rms_norm(x, self.weight, self.eps, dtype, residual)
        return self.add_and_norm_torch(x, residual, dtype)

    def heads_(self, x: torch.Tensor) -> torch.Tensor:
        """Every head of x [tokens, heads, head_dim] normalized in place (per-head q/k norms);
        returns x (a new tensor where the native op does not take x)."""
        ops = native_ops() if x.is_cpu else None
        if ops is not None and ops.head_rms_norm_supported(x, self.weight):
            ops.head_rms_norm_(x, self.weight, self.eps)
            return x
        return self.forward_torch(x)

    def add_and_norm_torch(self, x: torch.Tensor, residual: torch.Tensor,
                           out_dtype: torch.dtype | None = None) -> torch.Tensor:
        residual.add_(x)
        return self.forward_torch(residual, out_dtype or x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm scales by (1 + w): checkpoints hold w, this layer's weight is 1 + w
    (float32, formed once at load as Hugging Face forms it per call), so the rest is RMSNorm."""

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape != param.shape:
            raise ValueError(f"shape mismatch: parameter {tuple(param.shape)}, "
                             f"checkpoint {tuple(loaded.shape)}")
        param.data.copy_(1.0 + loaded.float())
