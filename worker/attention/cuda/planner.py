"""`KernelAttention`: planning and launching of the project's CUDA kernels
(worker/kernels/*.cu), shared by the CuPy backend (a GPU) and the emulated one (the very same
kernels in the CPU emulator).

Per step (built by the first layer, reused by the others): the requests' query tokens are cut
into work items, decode rows (query_len 1) for the decode kernel variant and prefill chunks
for the prefill variant, each launch with a split-KV decision. Per layer: reshape_and_cache,
then one attention launch per variant (plus a reduce launch where the KV range is split).
"""
from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from worker.attention.cuda.kernels import (
    DECODE_ROWS,
    NUM_THREADS,
    PREFILL_ROWS,
    KernelConfig,
    attention_smem_bytes,
    config_for,
)
from worker.attention.metadata import AttentionMetadata

_NO_SPLIT = 1 << 30  # split_tokens of a launch whose KV range is not split
_SPLIT_ALIGN = 64  # split lengths are whole tiles


class Launcher(Protocol):
    def launch(self, name: str, grid: Sequence[int], block: Sequence[int], shared_mem: int,
               args: Sequence[object]) -> None: ...


@dataclass(frozen=True)
class SplitPolicy:
    """Split a launch's KV range (flash-decoding) while it has fewer than `target_ctas`
    CTAs, into splits of at least `min_split_tokens` keys."""

    target_ctas: int
    min_split_tokens: int

    def split_tokens(self, num_ctas: int, longest: int) -> int:
        if num_ctas >= self.target_ctas or longest < 2 * self.min_split_tokens:
            return _NO_SPLIT
        splits = min(-(-self.target_ctas // num_ctas), longest // self.min_split_tokens)
        if splits < 2:
            return _NO_SPLIT
        per_split = -(-longest // splits)
        return -(-per_split // _SPLIT_ALIGN) * _SPLIT_ALIGN


@dataclass
class _Launch:
    """One paged_attention launch over work items [request, first query, query count]."""

    rows: int
    heads_per_cta: int
    ctas_per_item: int  # grid y: num_kv_heads * (group // heads_per_cta)
    work: torch.Tensor  # [num_items, 3] int32 on the device
    num_items: int
    split_tokens: int
    num_splits: int


@dataclass
class _Plan:
    key: tuple
    config: KernelConfig
    launches: list[_Launch]
    metadata: tuple[torch.Tensor, ...]  # slot_mapping, query_start_loc, seq_lens, block_table
    part_acc: torch.Tensor | None  # split partials, shared by the launches and the layers
    part_ml: torch.Tensor | None
    window: int = 0  # the metadata's sliding window


def heads_per_cta(group: int, rows: int) -> int:
    """The most query heads of a KV group that one CTA can hold (a divisor of the group)."""
    return max(d for d in range(1, min(group, rows) + 1) if group % d == 0)


class KernelAttention(abc.ABC):
    """Planning and launching shared by the CuPy and the emulated backend."""

    name = "kernels"

    def __init__(self, device: torch.device, policy: SplitPolicy,
                 split_tokens: int | None) -> None:
        self.device = device
        self.policy = policy
        self.forced_split = split_tokens  # tests: a fixed split length (0: never split)
        self._launchers: dict[KernelConfig, Launcher] = {}

    @abc.abstractmethod
    def _launcher(self, config: KernelConfig) -> Launcher:
        """Where this backend runs the kernels of `config`."""

    def plan(self, metadata: AttentionMetadata) -> None:
        metadata.plan = None  # built by the first layer, which knows the heads and the cache

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata,
                scale: float) -> torch.Tensor:
        _check_cache(k_cache, v_cache, query)
        plan = self._plan_for(metadata, query, k_cache)
        if plan.config not in self._launchers:
            self._launchers[plan.config] = self._launcher(plan.config)
        launcher = self._launchers[plan.config]
        self._write_kv(launcher, plan, key, value, k_cache, v_cache)
        query = _vector_rows(query)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        for launch in plan.launches:
            self._attend(launcher, plan, launch, out, query, k_cache, v_cache, scale)
        return out

    def _write_kv(self, launcher: Launcher, plan: _Plan, key: torch.Tensor,
                  value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """reshape_and_cache: one thread per 16-byte chunk of a token's K (and V) row."""
        key, value = _vector_rows(key.to(k_cache.dtype)), _vector_rows(value.to(v_cache.dtype))
        num_tokens = key.shape[0]
        chunks = key.shape[1] * key.shape[2] * key.element_size() // 16
        if num_tokens:
            launcher.launch(plan.config.reshape_and_cache,
                            (-(-num_tokens * chunks // NUM_THREADS),), (NUM_THREADS,), 0,
                            [k_cache, v_cache, key, value, np.int64(key.stride(0)),
                             np.int64(value.stride(0)), plan.metadata[0], np.int32(num_tokens),
                             np.int32(chunks)])

    def _attend(self, launcher: Launcher, plan: _Plan, launch: _Launch, out: torch.Tensor,
                query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                scale: float) -> None:
        """paged_attention over one launch's work items, then the reduce if KV is split."""
        num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
        _, query_start_loc, seq_lens, block_table = plan.metadata
        y = launch.ctas_per_item
        split = launch.num_splits > 1
        heads = [np.int32(num_heads), np.int32(num_kv_heads), np.int32(launch.heads_per_cta)]
        launcher.launch(
            plan.config.attention(launch.rows), (launch.num_items, y, launch.num_splits),
            (NUM_THREADS,), attention_smem_bytes(query.dtype, query.shape[2], launch.rows),
            [out, plan.part_acc if split else None, plan.part_ml if split else None, query,
             np.int64(query.stride(0)), k_cache, v_cache, block_table,
             np.int32(block_table.stride(0)), query_start_loc, seq_lens, launch.work, *heads,
             np.int32(launch.split_tokens), np.float32(scale * math.log2(math.e)),
             np.int32(plan.window)])
        if split:
            launcher.launch(
                plan.config.reduce, (launch.num_items, y), (NUM_THREADS,), 0,
                [out, plan.part_acc, plan.part_ml, query_start_loc, seq_lens, launch.work,
                 *heads, np.int32(launch.rows), np.int32(launch.split_tokens),
                 np.int32(launch.num_splits), np.int32(plan.window)])

    def _plan_for(self, metadata: AttentionMetadata, query: torch.Tensor,
                  k_cache: torch.Tensor) -> _Plan:
        key = (query.shape[1], k_cache.shape[2], query.shape[2], query.dtype, k_cache.shape[1])
        if metadata.plan is None or metadata.plan.key != key:
            metadata.plan = self._make_plan(metadata, key)
        return metadata.plan

    def _make_plan(self, metadata: AttentionMetadata, key: tuple) -> _Plan:
        num_heads, num_kv_heads, head_dim, dtype, block_size = key
        config = config_for(dtype, head_dim, block_size)
        group = num_heads // num_kv_heads
        launches = []
        for rows, decode in ((DECODE_ROWS, True), (PREFILL_ROWS, False)):
            hpc = heads_per_cta(group, rows)
            work = launch_work_items(metadata.query_lens_cpu, metadata.seq_lens_cpu, decode,
                                     rows // hpc, metadata.sliding_window)
            if len(work):
                launches.append(self._launch(work, rows, hpc, num_kv_heads * (group // hpc)))
        part_acc = part_ml = None
        slots = max((n.num_items * n.ctas_per_item * n.num_splits * n.rows
                     for n in launches if n.num_splits > 1), default=0)
        if slots:
            part_acc = torch.empty(slots * head_dim, dtype=torch.float32, device=self.device)
            part_ml = torch.empty(slots * 2, dtype=torch.float32, device=self.device)
        tensors = (metadata.slot_mapping.to(self.device, torch.int64).contiguous(),
                   *(t.to(self.device, torch.int32).contiguous() for t in (
                       metadata.query_start_loc, metadata.seq_lens, metadata.block_table)))
        return _Plan(key, config, launches, tensors, part_acc, part_ml,
                     metadata.sliding_window)

    def _launch(self, work: np.ndarray, rows: int, hpc: int, ctas_per_item: int) -> _Launch:
        longest = int(work[:, 3].max())
        if self.forced_split is not None:
            split = self.forced_split or _NO_SPLIT
        else:
            split = self.policy.split_tokens(len(work) * ctas_per_item, longest)
        items = torch.from_numpy(np.ascontiguousarray(work[:, :3])).to(self.device)
        return _Launch(rows, hpc, ctas_per_item, items, len(work), split, -(-longest // split))


def launch_work_items(query_lens: Sequence[int], seq_lens: Sequence[int], decode: bool,
                      tokens_per_item: int, sliding_window: int = 0) -> np.ndarray:
    """[num_items, 4] int32: request, first query index, query count, and the item's KV
    length (last column, host only: the keys it reads, from its first row's window on),
    longest first. `decode` selects the requests with one query token; otherwise those with
    several, cut into items of `tokens_per_item` tokens."""
    q = np.asarray(query_lens, dtype=np.int64)
    s = np.asarray(seq_lens, dtype=np.int64)
    reqs = np.flatnonzero(q == 1) if decode else np.flatnonzero(q > 1)
    per_req = -(-q[reqs] // tokens_per_item)
    req = np.repeat(reqs, per_req)
    first = (np.arange(len(req)) - np.repeat(np.cumsum(per_req) - per_req, per_req)) \
        * tokens_per_item
    count = np.minimum(q[req] - first, tokens_per_item)
    kv_end = s[req] - q[req] + first + count
    length = kv_end  # keys [kv_begin, kv_end)
    if sliding_window:
        length = kv_end - np.maximum(kv_end - count - sliding_window + 1, 0)
    order = np.argsort(-length, kind="stable")
    return np.stack([req, first, count, length], axis=1)[order].astype(np.int32)


def _vector_rows(t: torch.Tensor) -> torch.Tensor:
    """`t` [tokens, heads, dim] with heads and dims contiguous, 16-byte aligned token rows
    (a strided view of a fused qkv tensor passes as is)."""
    dim = t.shape[2]
    ok = (t.stride(2) == 1 and t.stride(1) == dim and t.data_ptr() % 16 == 0
          and (t.stride(0) * t.element_size()) % 16 == 0)
    return t if ok else t.clone(memory_format=torch.contiguous_format)


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, query: torch.Tensor) -> None:
    for cache in (k_cache, v_cache):
        if not cache.is_contiguous() or cache.dtype != query.dtype:
            raise ValueError(f"KV caches must be contiguous {query.dtype} [num_blocks, "
                             f"block_size, num_kv_heads, head_dim], got {cache.dtype} "
                             f"{tuple(cache.shape)}")
