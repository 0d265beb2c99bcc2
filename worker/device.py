"""The device a worker rank runs on, and the dtype it computes in: the requested one, unless
this CPU lacks native half matmul.

Without AVX512_BF16/AMX-BF16 (bfloat16) or AVX512_FP16/AMX-FP16 (float16), torch's CPU matmul
in that dtype is emulated and runs tens of times slower than float32, so the worker computes
in float32 instead (weights upcast at load, KV cache in float32 too).
`DELTASERVE_CPU_BF16=1|0` overrides the detection for both half dtypes (tests force either path).
"""
from __future__ import annotations

import functools
import logging
import os

import torch

from worker.host import amx
from worker.host.cpuinfo import cpuinfo_flags

logger = logging.getLogger("deltaserve")

ENV_OVERRIDE = "DELTASERVE_CPU_BF16"
# dtype -> (torch.cpu helper, /proc/cpuinfo flags, AMX flags); any one of them means native
# support, an AMX flag only where this process is granted AMX (worker/host/amx.py).
_NATIVE = {
    torch.bfloat16: (("_is_avx512_bf16_supported",), ("avx512_bf16",), ("amx_bf16",)),
    torch.float16: ((), ("avx512_fp16",), ("amx_fp16",)),
}


def cpu_has_native(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` natively; float32 always. Honors ENV_OVERRIDE."""
    if dtype not in _NATIVE:
        return True
    forced = os.environ.get(ENV_OVERRIDE, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    if forced:
        raise ValueError(f"{ENV_OVERRIDE} must be 0 or 1, got {forced!r}")
    return _detect(dtype)


@functools.cache
def _detect(dtype: torch.dtype) -> bool:
    helpers, flags, amx_flags = _NATIVE[dtype]
    for name in helpers:
        helper = getattr(torch.cpu, name, None)
        if helper is not None and helper():
            return True
    present = cpuinfo_flags()
    if present & set(flags):
        return True
    return bool(present & set(amx_flags)) and amx.this_process() == "granted"


def resolve_device(device: str, rank: int) -> torch.device:
    """`auto`: CUDA when available, else the CPU. `auto` or a bare `cuda` on CUDA: the GPU
    `rank % device_count`, so local ranks spread over the GPUs; `cuda:N` or `cpu` as given."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was requested but no CUDA GPU is available")
    if device == "cuda":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device(device)


def resolve_compute_dtype(requested: torch.dtype, device: torch.device) -> torch.dtype:
    """`requested`, or float32 for a half dtype on a CPU without native support for it."""
    if device.type != "cpu" or cpu_has_native(requested):
        return requested
    _log_fallback(requested)
    return torch.float32


@functools.cache
def _log_fallback(requested: torch.dtype) -> None:
    name = str(requested).removeprefix("torch.")
    short = "bf16" if requested == torch.bfloat16 else "fp16"
    logger.warning("%s requested; this CPU has no native %s, computing in float32", name, short)
