"""The CUDA kernels run in the CPU emulator (worker/emulator): slow, for tests and debugging."""
from __future__ import annotations

import torch

from worker.attention.cuda.kernels import KernelConfig, source_paths
from worker.attention.cuda.planner import KernelAttention, Launcher, SplitPolicy


class EmulatedAttentionBackend(KernelAttention):
    """The same CUDA kernels run in the CPU emulator (worker/emulator): slow, for tests.
    Its split policy pretends a tiny GPU so that short contexts exercise split-KV too."""

    name = "emulated"

    def __init__(self, split_tokens: int | None = None) -> None:
        super().__init__(torch.device("cpu"), SplitPolicy(target_ctas=8, min_split_tokens=32),
                         split_tokens)

    def _launcher(self, config: KernelConfig) -> Launcher:
        from worker.emulator import load_library
        return load_library(source_paths(), config.kernels, tag=f"attention-{config.label}")
