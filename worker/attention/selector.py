"""How a worker picks its attention backend."""
from __future__ import annotations

import logging
from typing import get_args

import torch

from protocol.engine_config import AttentionBackendName
from worker.attention.backend import AttentionBackend
from worker.native.library import UNAVAILABLE

logger = logging.getLogger("deltaserve")
BACKENDS = get_args(AttentionBackendName)
_fallback_warned = False


def make_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto`: CuPy kernels on CUDA, the native CPU kernel elsewhere (which falls back to
    torch, with one warning, when it cannot be compiled)."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "auto":
        name = "cupy" if device.type == "cuda" else "cpu"
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention_backend='cpu' runs on the CPU, not on {device}")
        return _cpu_backend()
    if name == "torch":
        from worker.attention.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend()
    if name == "cupy":
        from worker.attention.cuda.cupy_backend import CupyAttentionBackend
        return CupyAttentionBackend(device)
    from worker.attention.cuda.emulated_backend import EmulatedAttentionBackend
    return EmulatedAttentionBackend()


def _cpu_backend() -> AttentionBackend:
    """The native backend, or (with one warning per process) the torch backend when no
    compiler is installed or the kernel does not build here."""
    global _fallback_warned
    from worker.attention.cpu_backend import CpuAttentionBackend
    try:
        return CpuAttentionBackend()
    except UNAVAILABLE as e:
        if not _fallback_warned:
            _fallback_warned = True
            logger.warning("cpu attention kernel unavailable, using the torch backend: %s", e)
        from worker.attention.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend()
