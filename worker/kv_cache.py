"""Sizing and allocating a worker's paged KV cache."""
from __future__ import annotations

import psutil
import torch

from worker.attention.kv_cache_spec import KVCache, KVCacheSpec

# Default CPU budget when none is given (vLLM's CPU backend also defaults to 4 GiB).
_CPU_DEFAULT_BYTES = 4 << 30


def determine_num_blocks(block_bytes: int, device: torch.device, *, max_useful: int,
                         kv_cache_memory_bytes: int | None = None,
                         num_gpu_blocks_override: int | None = None,
                         gpu_memory_utilization: float = 0.9, world_size: int = 1) -> int:
    """How many blocks (incl. the null block 0) this worker holds.

    An override wins; otherwise the byte budget (given, or a fraction of free GPU memory, or on
    CPU min(4 GiB, a quarter of available RAM per rank)), never more than `max_useful`.
    """
    if num_gpu_blocks_override is not None:
        if num_gpu_blocks_override < 2:
            raise ValueError(f"num_gpu_blocks_override must be at least 2, "
                             f"got {num_gpu_blocks_override}")
        return num_gpu_blocks_override
    if kv_cache_memory_bytes is None:
        kv_cache_memory_bytes = _default_budget(device, gpu_memory_utilization, world_size)
    num_blocks = min(kv_cache_memory_bytes // block_bytes, max_useful)
    if num_blocks < 2:
        raise ValueError(f"a KV cache budget of {kv_cache_memory_bytes} bytes holds "
                         f"{kv_cache_memory_bytes // block_bytes} blocks of {block_bytes} bytes; "
                         "at least 2 are needed")
    return int(num_blocks)


def _default_budget(device: torch.device, utilization: float, world_size: int) -> int:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return max(0, int(free - (1 - utilization) * total))
    available = psutil.virtual_memory().available
    return min(_CPU_DEFAULT_BYTES, available // (4 * world_size))


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, block_size: int,
                      device: torch.device) -> list[KVCache]:
    """Per layer a key and a value tensor [num_blocks, block_size, num_kv_heads, head_size],
    zeroed so that no slot ever holds a non-finite value it did not compute.

    The j-th layer of every layer group shares the j-th pair of tensors (vLLM's hybrid
    layout): a block id belongs to one group at a time, so its rows hold that group's layers
    only. With one group, every layer has its own pair."""
    shape = spec.shape(num_blocks, block_size)
    pairs = [(torch.zeros(shape, dtype=spec.dtype, device=device),
              torch.zeros(shape, dtype=spec.dtype, device=device))
             for _ in range(spec.group_size())]
    caches: list[KVCache | None] = [None] * spec.num_layers
    for group in spec.groups():
        for j, layer in enumerate(group.layers):
            caches[layer] = pairs[j]
    return caches
