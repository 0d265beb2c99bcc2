"""CPU linear layers through oneDNN with weights packed once, after loading.

On a CPU, torch's `F.linear` multiplies float32 with MKL's sgemm, which repacks the weight on
every call, and bfloat16 with oneDNN, which reorders it on every call. At decode batch sizes
(tens of rows) the per-call repacking dominates: packed oneDNN measured 1.2-1.6x faster on the
demo and SmolLM2 float32 projections at 32 rows, 2.6x on SmolLM2's 49k-row LM head, and
1.2-1.35x in bfloat16 (benchmarks/bench_onednn_linear.py). A packed weight is an opaque `torch._mkldnn` tensor with
the dense weight's shape and dtype; `linear()` dispatches on it, so a layer works either way.
Results agree with `F.linear` to float32 rounding (a different summation order), not bitwise.
`DELTASERVE_ONEDNN=0` keeps dense weights and `F.linear`.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

ENV_SWITCH = "DELTASERVE_ONEDNN"
# The row count oneDNN tunes a packed layout for; any row count works with it.
BATCH_HINT = 64


def enabled(device: torch.device) -> bool:
    """Packing applies: a CPU device, torch built with oneDNN, and not switched off."""
    return (device.type == "cpu" and os.environ.get(ENV_SWITCH, "1") != "0"
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] dense weight -> the same weight in oneDNN's blocked layout; the dense weight
    itself where oneDNN has no packed path for its dtype on this CPU (float16 needs
    AVX512-FP16 or AVX-NE-CONVERT, for instance)."""
    if weight.dtype not in (torch.float32, torch.bfloat16):
        return weight
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), BATCH_HINT)
    except RuntimeError:
        return weight


def packed_parameter(param: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(pack(param.data), requires_grad=False)


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b for a dense or packed W (x in W's dtype)."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
