"""The gated SiLU activation of the Llama MLP, applied to its fused gate_up projection."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.native.cpu_ops import native_ops


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [tokens, 2 * d] = [gate | up] -> silu(gate) * up [tokens, d] in x's dtype, computed
    in float32 and rounded once (the native op on the CPU when it handles x, else torch)."""
    ops = native_ops() if x.is_cpu else None
    if ops is not None and ops.silu_and_mul_supported(x):
        return ops.silu_and_mul(x)
    return silu_and_mul_torch(x)


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    # no-op conversions when computing in float32
    return (F.silu(gate.float()) * up.float()).to(x.dtype)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [tokens, 2 * d] = [gate | up] -> gelu_tanh(gate) * up [tokens, d] (Gemma's MLP; the
    tanh approximation, as Hugging Face's gelu_pytorch_tanh), in x's dtype, computed in float32
    and rounded once (the native op on the CPU when it handles x, else torch)."""
    ops = native_ops() if x.is_cpu else None
    if ops is not None and ops.silu_and_mul_supported(x):
        return ops.gelu_tanh_and_mul(x)
    return gelu_tanh_and_mul_torch(x)


def gelu_tanh_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return (F.gelu(gate.float(), approximate="tanh") * up.float()).to(x.dtype)
