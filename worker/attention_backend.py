"""The attention backend interface and how a worker picks one."""
from __future__ import annotations

from typing import Protocol, get_args

import torch

from protocol.engine_config import AttentionBackendName
from worker.attention_metadata import AttentionMetadata

# KV cache layout, per layer: a key and a value tensor, each
#   [num_blocks, block_size, num_kv_heads, head_dim]   (token-major within a block, "NHD")
# Slot s (from slot_mapping) is row s of the tensor viewed as [num_blocks * block_size, ...].
BACKENDS = get_args(AttentionBackendName)


class AttentionBackend(Protocol):
    name: str

    def plan(self, metadata: AttentionMetadata) -> None:
        """Per-step preparation shared by all layers (stored in `metadata.plan`)."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """Write `key`/`value` [num_tokens, num_kv_heads, head_dim] into their slots, then
        attend `query` [num_tokens, num_heads, head_dim]; returns [num_tokens, num_heads,
        head_dim]. Every layer of a step writes before it reads, so a request may attend
        KV written by another request in the same step (shared prefix blocks)."""


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
        from worker.cpu_attention import make_cpu_backend
        return make_cpu_backend()
    if name == "torch":
        from worker.torch_attention import TorchAttentionBackend
        return TorchAttentionBackend()
    if name == "cupy":
        from worker.cupy_attention import CupyAttentionBackend
        return CupyAttentionBackend(device)
    from worker.emulated_attention import EmulatedAttentionBackend
    return EmulatedAttentionBackend()
