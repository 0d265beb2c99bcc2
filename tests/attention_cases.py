"""Random paged-attention cases and a dense float64 reference (shared by backend and kernel
tests).

A case holds a step's q/k/v for several requests, each with `context_len` tokens already in
the cache (written at permuted physical blocks) and `query_len` new tokens. Every slot that
is not written (unused blocks, the null block, the tail of partial last blocks) holds NaN, so
any read outside a request's context shows up in the result. With a sliding window, the blocks
before each request's first needed one are NaN too and its table names the null block there,
as the KV cache manager leaves them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from worker.attention.metadata import AttentionMetadata


@dataclass
class AttentionCase:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    metadata: AttentionMetadata
    specs: list[tuple[int, int]]  # (context_len, query_len) per request
    context_k: list[torch.Tensor]  # per request [context_len, num_kv_heads, head_dim]
    context_v: list[torch.Tensor]
    num_padding: int  # trailing tokens with slot -1 that belong to no request

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.query.shape[-1])

    def to(self, device: torch.device | str) -> AttentionCase:
        """The same case with every tensor on `device` (host lists and the reference's
        context K/V stay where they are)."""
        m = self.metadata
        metadata = AttentionMetadata(
            m.slot_mapping.to(device), m.query_start_loc.to(device), m.seq_lens.to(device),
            m.block_table.to(device), m.max_query_len, m.max_seq_len, m.query_lens_cpu,
            m.seq_lens_cpu, sliding_window=m.sliding_window)
        return AttentionCase(self.query.to(device), self.key.to(device), self.value.to(device),
                             self.k_cache.to(device), self.v_cache.to(device), metadata,
                             self.specs, self.context_k, self.context_v, self.num_padding)


def make_case(specs: list[tuple[int, int]], num_heads: int = 4, num_kv_heads: int = 2,
              head_dim: int = 64, block_size: int = 16, dtype: torch.dtype = torch.float32,
              num_padding: int = 0, seed: int = 0, spare_blocks: int = 3,
              sliding_window: int = 0) -> AttentionCase:
    gen = torch.Generator().manual_seed(seed)
    blocks_of = [-(-(c + q) // block_size) for c, q in specs]
    num_blocks = 1 + sum(blocks_of) + spare_blocks
    physical = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0: null
    table = torch.zeros(len(specs), max(blocks_of), dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen).to(dtype)

    slots, context_k, context_v = [], [], []
    for i, ((context, query_len), n) in enumerate(zip(specs, blocks_of)):
        table[i, :n] = torch.tensor(physical[:n], dtype=torch.int32)
        physical = physical[n:]
        pos = torch.arange(context + query_len)
        req_slots = table[i, pos // block_size].long() * block_size + pos % block_size
        ck, cv = rand(context, num_kv_heads, head_dim), rand(context, num_kv_heads, head_dim)
        k_cache.view(-1, num_kv_heads, head_dim)[req_slots[:context]] = ck
        v_cache.view(-1, num_kv_heads, head_dim)[req_slots[:context]] = cv
        context_k.append(ck)
        context_v.append(cv)
        slots.append(req_slots[context:])
        if sliding_window:  # blocks left the window: NaN, and the table names the null block
            skipped = max(0, context - sliding_window + 1) // block_size
            k_cache[table[i, :skipped].long()] = float("nan")
            v_cache[table[i, :skipped].long()] = float("nan")
            table[i, :skipped] = 0
    slots.append(torch.full((num_padding,), -1, dtype=torch.long))
    num_tokens = sum(q for _, q in specs) + num_padding
    query_lens = [q for _, q in specs]
    seq_lens = [c + q for c, q in specs]
    metadata = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        query_start_loc=torch.tensor([0] + list(_cumsum(query_lens)), dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table=table,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens, seq_lens_cpu=seq_lens, sliding_window=sliding_window)
    return AttentionCase(rand(num_tokens, num_heads, head_dim),
                         rand(num_tokens, num_kv_heads, head_dim),
                         rand(num_tokens, num_kv_heads, head_dim), k_cache, v_cache, metadata,
                         specs, context_k, context_v, num_padding)


def _cumsum(values: list[int]) -> list[int]:
    total, out = 0, []
    for v in values:
        total += v
        out.append(total)
    return out


def reference(case: AttentionCase) -> torch.Tensor:
    """Dense causal attention per request in float64: [num_real_tokens, num_heads, head_dim]."""
    out = []
    start = 0
    group = case.query.shape[1] // case.key.shape[1]
    for (context, query_len), ck, cv in zip(case.specs, case.context_k, case.context_v):
        q = case.query[start:start + query_len].double()
        k = torch.cat([ck, case.key[start:start + query_len]]).double()
        v = torch.cat([cv, case.value[start:start + query_len]]).double()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * case.scale
        key_pos = torch.arange(context + query_len)[None, :]
        query_pos = (context + torch.arange(query_len))[:, None]
        allowed = key_pos <= query_pos
        if case.metadata.sliding_window:
            allowed &= key_pos > query_pos - case.metadata.sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        start += query_len
    return torch.cat(out)
