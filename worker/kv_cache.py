"""Sizing and allocating a worker's paged KV cache."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from common.byte_size import byte_size
from worker.attention.kv_cache_spec import KVCache, KVCacheSpec
from worker.host.memory import available_memory

# Default CPU budget when none is given (vLLM's CPU backend also defaults to 4 GiB).
_CPU_DEFAULT_BYTES = 4 << 30


@dataclass(frozen=True)
class KVCacheSize:
    """How many blocks (incl. the null block 0) a worker holds, and how the count was chosen
    (for the startup line and for the error where too few fit)."""

    num_blocks: int
    reason: str


def determine_num_blocks(block_bytes: int, device: torch.device, *, max_useful: int,
                         kv_cache_memory_bytes: int | None = None,
                         num_gpu_blocks_override: int | None = None,
                         gpu_memory_utilization: float = 0.9, world_size: int = 1) -> KVCacheSize:
    """An override wins; otherwise the byte budget (given, or a fraction of free GPU memory, or
    on CPU min(4 GiB, a quarter of what the host can give per rank: worker/host/memory.py),
    never more than `max_useful` blocks."""
    if num_gpu_blocks_override is not None:
        if num_gpu_blocks_override < 2:
            raise ValueError(f"num_gpu_blocks_override must be at least 2, "
                             f"got {num_gpu_blocks_override}")
        return KVCacheSize(num_gpu_blocks_override, "num_gpu_blocks_override")
    if kv_cache_memory_bytes is None:
        kv_cache_memory_bytes, reason = _default_budget(device, gpu_memory_utilization,
                                                        world_size)
    else:
        reason = f"kv_cache_memory_bytes {byte_size(kv_cache_memory_bytes)}"
    fit = kv_cache_memory_bytes // block_bytes
    if fit < 2:
        raise ValueError(f"a KV cache budget of {byte_size(kv_cache_memory_bytes)} ({reason}) "
                         f"holds {fit} block{'' if fit == 1 else 's'} of {byte_size(block_bytes)}; at least 2 are "
                         "needed: give the host more memory, or set kv_cache_memory_bytes "
                         "or num_gpu_blocks_override")
    if fit > max_useful:
        return KVCacheSize(max_useful, f"{reason}; max_num_seqs sequences of max_model_len "
                                       f"tokens use no more")
    return KVCacheSize(int(fit), reason)


def _default_budget(device: torch.device, utilization: float, world_size: int,
                    ) -> tuple[int, str]:
    """The bytes a rank takes when none are configured, and where they come from."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return (max(0, int(free - (1 - utilization) * total)),
                f"free GPU memory less {1 - utilization:.0%} of {byte_size(total)}")
    available, source = available_memory()
    share = available // (4 * world_size)
    ranks = f" over {world_size} ranks" if world_size > 1 else ""
    if share >= _CPU_DEFAULT_BYTES:
        return _CPU_DEFAULT_BYTES, (f"the CPU default of 4 GiB, under a quarter of "
                                    f"{byte_size(available)} ({source}){ranks}")
    return share, f"a quarter of {byte_size(available)} ({source}){ranks}"


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
