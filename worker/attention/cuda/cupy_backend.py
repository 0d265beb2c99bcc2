"""The CUDA kernels on a GPU: CuPy compiles them with NVRTC once per process and launches
them on torch's current stream, tensors passed zero-copy through DLPack. CuPy is imported
lazily, so this module imports on machines without it."""
from __future__ import annotations

import functools
import threading
from collections.abc import Sequence

import torch

from worker.attention.cuda.kernels import (
    NVRTC_OPTIONS,
    SMEM_DEFAULT_LIMIT,
    KernelConfig,
    kernel_source,
)
from worker.attention.cuda.planner import KernelAttention, Launcher, SplitPolicy


def cuda_unavailable_reason() -> str | None:
    """Why the CUDA kernels cannot run in this process, or None when they can (also the skip
    reason of the GPU tests and benchmark)."""
    if not torch.cuda.is_available():
        return "no CUDA GPU (torch.cuda.is_available() is False)"
    try:
        import cupy
    except ImportError:
        return ("CuPy is not installed: pip install 'deltaserve[gpu]' "
                "(cupy-cuda13x, nvidia-cuda-nvrtc)")
    return None if cupy.cuda.is_available() else "CuPy sees no CUDA GPU or driver"


class CupyAttentionBackend(KernelAttention):
    """The CUDA kernels through CuPy RawModule, on torch's current stream."""

    name = "cupy"

    def __init__(self, device: torch.device, split_tokens: int | None = None) -> None:
        reason = cuda_unavailable_reason()
        if device.type != "cuda" or reason:
            raise RuntimeError(f"attention_backend='cupy' needs a CUDA GPU, but the worker "
                               f"runs on {device} ({reason or 'not a CUDA device'}); use "
                               "'torch' (or 'auto'), or 'emulated' to run the CUDA kernels in "
                               "the CPU emulator")
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        super().__init__(device, SplitPolicy(target_ctas=2 * sms, min_split_tokens=256),
                         split_tokens)

    def _launcher(self, config: KernelConfig) -> Launcher:
        return CupyLauncher(config, self.device)


class CupyLauncher:
    """Launches the kernels of one config on a CUDA device, on torch's current stream, with
    tensors passed zero-copy through DLPack."""

    def __init__(self, config: KernelConfig, device: torch.device) -> None:
        self.device = device
        self.module = _cupy_module(config)
        self._functions: dict[str, object] = {}
        self._lock = threading.Lock()

    def _function(self, name: str, shared_mem: int) -> object:
        with self._lock:
            if name not in self._functions:
                self._functions[name] = self.module.get_function(name)
            function = self._functions[name]
        if shared_mem > max(SMEM_DEFAULT_LIMIT, function.max_dynamic_shared_size_bytes):
            function.max_dynamic_shared_size_bytes = shared_mem  # opt in above 48 KiB
        return function

    def launch(self, name: str, grid: Sequence[int], block: Sequence[int], shared_mem: int,
               args: Sequence[object]) -> None:
        import cupy
        function = self._function(name, shared_mem)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        with cupy.cuda.Device(self.device.index or 0), cupy.cuda.ExternalStream(stream):
            converted = tuple(cupy.from_dlpack(a) if isinstance(a, torch.Tensor) else a
                              for a in args)
            function(tuple(grid), tuple(block), converted, shared_mem=shared_mem)


@functools.cache
def _cupy_module(config: KernelConfig) -> object:
    """One NVRTC module per config, compiled on first use (CuPy caches cubins on disk)."""
    import cupy
    return cupy.RawModule(code=kernel_source(), options=NVRTC_OPTIONS, backend="nvrtc",
                          name_expressions=list(config.kernels))
