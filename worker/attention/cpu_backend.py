"""The native CPU attention backend: a compiled kernel that writes the step's K/V into their
slots and attends decode rows and prefill chunks, reading K/V in place through the block table
(no gathered or padded copies). The selector falls back to the torch backend when it cannot
be built."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker.attention.metadata import AttentionMetadata
from worker.native import cpu_attention
from worker.native.library import DTYPE_CODES

# A work unit attends at most this many query rows (tokens x the query heads of a KV head).
TILE_ROWS = 32


@dataclass(slots=True)
class _CpuPlan:
    group: int  # query heads per KV head
    items: torch.Tensor  # [num_items, 3] int32: (request, first, end query token), costly first
    query_start_loc: torch.Tensor  # int32, contiguous (kept alive for the pointers below)
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


def tile_work_items(query_lens: list[int], seq_lens: list[int], group: int,
                    window: int = 0) -> np.ndarray:
    """[num_items, 3] int32 rows (request, j0, j1): query tiles of at most TILE_ROWS rows,
    the most expensive first (keys x rows), so dynamic scheduling balances the threads."""
    tile = max(1, TILE_ROWS // group)
    if len(query_lens) == 1 and query_lens[0] <= tile:  # one decode row or short chunk
        return np.array([[0, 0, query_lens[0]]], np.int32)
    q, s = np.asarray(query_lens, np.int64), np.asarray(seq_lens, np.int64)
    tiles = -(-q // tile)
    req = np.repeat(np.arange(len(q)), tiles)
    first = np.arange(int(tiles.sum())) - np.repeat(np.cumsum(tiles) - tiles, tiles)
    j0 = first * tile
    j1 = np.minimum(j0 + tile, q[req])
    keys = s[req] - q[req] + j1
    if window:
        keys = np.minimum(keys, window + j1 - j0)
    cost = keys * (j1 - j0)
    order = np.argsort(-cost, kind="stable")
    return np.stack([req, j0, j1], axis=1)[order].astype(np.int32)


class CpuAttentionBackend:
    """Parallel over (query tile, KV head) on torch's intra-op threads; fp32 accumulation and
    an online softmax per KV block; float32, bfloat16 and float16 caches."""

    name = "cpu"

    def __init__(self, kernel=None, bf16_dot: bool | None = None) -> None:
        """`kernel`: another build of the entry point (tests, benchmarks); default this
        machine's (cpu_attention.load()). `bf16_dot`: ask for the vdpbf16ps units with bf16
        caches; None: not (a Xeon with AVX512-BF16, 2 threads, bf16, interleaved, ms per
        call set, widened vs vdpbf16ps: 32 decode rows of 16 query / 2 KV heads of dim 128,
        context 64..192, 8 layers 2.91 vs 3.70; one row at context 2048 1.30 vs 1.64; decode
        of 64 rows at context 512, 4 layers, 4/2 heads of dim 64 2.83 vs 2.85, 9/3 heads 5.28
        vs 5.19; prefill of 2 x 512 tokens 8.3 vs 10.4 (4/2) and 19.1 vs 24.0 (9/3); 32 x 64
        tokens of the 16/2 shape, 2 layers, 10.7 vs 13.2; the widened path's 8-row vector
        softmax since took 9-10 % off the first, 4 % off the second and 13-16 % off the
        prefills). Builds without AVX512-BF16 ignore
        the request; a kernel older than it rejects it."""
        self._kernel = kernel or cpu_attention.load()
        self._codes = dict(DTYPE_CODES)
        if bf16_dot:
            self._codes[torch.bfloat16] |= cpu_attention.BF16_DOT

    def dtype_code(self, dtype: torch.dtype) -> int:
        """The kernel's code for caches of `dtype`, flags included (what `forward` passes)."""
        return self._codes[dtype]

    def plan(self, metadata: AttentionMetadata) -> None:
        metadata.plan = None  # built by the first layer, which knows the head group

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata,
                scale: float) -> torch.Tensor:
        num_tokens, num_heads, head_dim = query.shape
        num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
        plan = cpu_plan(metadata, num_heads // num_kv_heads)
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("the cpu attention backend needs contiguous KV caches")
        dtype = k_cache.dtype
        query, key, value = (_rows_contiguous(t, dtype) for t in (query, key, value))
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=dtype)
        status = self._kernel(
            self._codes[dtype], query.data_ptr(), query.stride(0),
            key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
            k_cache.data_ptr(), v_cache.data_ptr(), plan.slot_mapping.data_ptr(), num_tokens,
            plan.query_start_loc.data_ptr(), plan.seq_lens.data_ptr(),
            plan.block_table.data_ptr(), plan.block_table.stride(0), plan.items.data_ptr(),
            plan.items.shape[0], out.data_ptr(), num_heads, num_kv_heads, head_dim, block_size,
            scale, torch.get_num_threads(), metadata.sliding_window)
        if status:
            raise RuntimeError(f"cpu_paged_attention rejected its arguments (status {status})")
        return out


def _rows_contiguous(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` [tokens, heads, head_dim] in `dtype` with each token's heads contiguous (a token
    row stride is allowed: q/k/v are often views of one fused projection)."""
    t = t.to(dtype)
    if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
        t = t.contiguous()
    return t


def cpu_plan(metadata: AttentionMetadata, group: int) -> _CpuPlan:
    """The step's kernel arguments for `group` query heads per KV head, made by the first
    layer that asks and kept in `metadata.plan` for the others."""
    plan: _CpuPlan | None = metadata.plan
    if plan is None or plan.group != group:
        plan = metadata.plan = _make_plan(metadata, group)
    return plan


def _make_plan(metadata: AttentionMetadata, group: int) -> _CpuPlan:
    """What differs between a step's KV groups (block table, slots) per group; the work
    items and the request columns once per step (`metadata.shared`), per distinct window."""
    def host(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return t.to("cpu", dtype).contiguous()

    table = metadata.block_table.to("cpu", torch.int32)
    if table.stride(-1) != 1:
        table = table.contiguous()
    shared = metadata.shared
    window = metadata.sliding_window if metadata.sliding_window < metadata.max_seq_len else 0
    items = shared.get(("cpu-items", group, window))
    if items is None:
        items = shared[("cpu-items", group, window)] = torch.from_numpy(tile_work_items(
            metadata.query_lens_cpu, metadata.seq_lens_cpu, group, window))
    rows = shared.get("cpu-rows")
    if rows is None:
        rows = shared["cpu-rows"] = (host(metadata.query_start_loc, torch.int32),
                                     host(metadata.seq_lens, torch.int32))
    return _CpuPlan(group, items, *rows, table, host(metadata.slot_mapping, torch.int64))
