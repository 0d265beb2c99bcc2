"""Paged attention in plain torch: the CPU backend and the reference for the CUDA kernels."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from worker.attention.metadata import AttentionMetadata

# Decode rows are attended in groups whose gathered K (or V) stays under this many elements.
_DECODE_GATHER_ELEMENTS = 1 << 24


@dataclass(slots=True)
class _DecodeGroup:
    rows: slice | torch.Tensor  # token rows (one query token per request); a slice if contiguous
    blocks: torch.Tensor  # [n * num_blocks] block ids, row-major; 0 (null block) past the end
    valid: torch.Tensor  # [n, num_blocks * block_size] bool: position < seq_len
    stale: torch.Tensor | None  # flat indices into [n * length] of partial last blocks' tails


@dataclass(slots=True)
class _Prefill:
    start: int
    end: int
    blocks: torch.Tensor  # the request's blocks from the first one a key is read from
    length: int  # keys read: positions [first_block * block_size, seq_len)
    mask: torch.Tensor | None  # [query_len, length] bool, None when plainly causal


@dataclass(slots=True)
class _TorchPlan:
    decodes: list[_DecodeGroup] = field(default_factory=list)
    prefills: list[_Prefill] = field(default_factory=list)
    has_padding: bool = False


class TorchAttentionBackend:
    """Decode rows are batched: their blocks are gathered through the block table
    (`index_select` of whole blocks) into a padded batch for one SDPA call per group. What lies
    past a request's end is made harmless before the softmax sees it: padding blocks are the
    null block, which this backend keeps zeroed, and the stale tail of a partial last block is
    zeroed in the gathered copy, so stale or poisoned cache contents never reach the result.
    Prefill chunks run one SDPA each over exactly their context."""

    name = "torch"

    def plan(self, metadata: AttentionMetadata) -> None:
        metadata.plan = None  # built lazily by the first layer, which knows the cache shape

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata,
                scale: float) -> torch.Tensor:
        # q, k, v may come in float32 over a bf16 cache (bf16_linear.py): computed in the cache's dtype
        query, key, value = (t.to(k_cache.dtype) for t in (query, key, value))
        if metadata.plan is None:
            metadata.plan = _make_plan(metadata, k_cache)
        plan: _TorchPlan = metadata.plan
        _write_kv(key, value, k_cache, v_cache, metadata.slot_mapping, plan.has_padding)
        if plan.decodes:  # padding reads the null block, which no request ever writes
            k_cache[0].zero_()
            v_cache[0].zero_()
        out = torch.empty_like(query)
        for group in plan.decodes:
            out[group.rows] = _decode(query[group.rows], k_cache, v_cache, group, scale)
        for p in plan.prefills:
            q = query[p.start:p.end].transpose(0, 1)  # [num_heads, query_len, head_dim]
            k = _gather(k_cache, p.blocks)[:p.length].transpose(0, 1)  # [kv_heads, keys, dim]
            v = _gather(v_cache, p.blocks)[:p.length].transpose(0, 1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=p.mask,
                                               is_causal=p.mask is None, scale=scale,
                                               enable_gqa=True)
            out[p.start:p.end] = o.transpose(0, 1)
        return out


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """[len(blocks) * block_size, kv_heads, dim]: the blocks' tokens, in order."""
    return cache.index_select(0, blocks).flatten(0, 1)


def _write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, slots: torch.Tensor, has_padding: bool) -> None:
    if has_padding:
        keep = slots >= 0
        key, value, slots = key[keep], value[keep], slots[keep]
    k_cache.flatten(0, 1).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.flatten(0, 1).index_copy_(0, slots, value.to(v_cache.dtype))


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: _DecodeGroup,
            scale: float) -> torch.Tensor:
    n, length = group.valid.shape
    k = _gather(k_cache, group.blocks).view(n, length, *k_cache.shape[2:])
    v = _gather(v_cache, group.blocks).view(n, length, *v_cache.shape[2:])
    if group.stale is not None:
        k.view(n * length, -1).index_fill_(0, group.stale, 0.0)
        v.view(n * length, -1).index_fill_(0, group.stale, 0.0)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=group.valid[:, None, None, :], scale=scale,
                                       enable_gqa=True)
    return o.squeeze(2)  # [n, num_heads, dim]


def _make_plan(metadata: AttentionMetadata, k_cache: torch.Tensor) -> _TorchPlan:
    block_size, device = k_cache.shape[1], k_cache.device
    plan = _TorchPlan(has_padding=bool((metadata.slot_mapping < 0).any()))
    query_lens = np.asarray(metadata.query_lens_cpu)
    starts = np.concatenate(([0], np.cumsum(query_lens)))
    window = metadata.sliding_window
    for i in np.flatnonzero(query_lens > 1).tolist():
        query_len, seq_len = int(query_lens[i]), metadata.seq_lens_cpu[i]
        context = seq_len - query_len
        first = max(0, context - window + 1) // block_size if window else 0
        mask = None
        if context or window:
            key_pos = torch.arange(first * block_size, seq_len, device=device)[None, :]
            query_pos = (context + torch.arange(query_len, device=device))[:, None]
            mask = key_pos <= query_pos
            if window:
                mask &= key_pos > query_pos - window
        blocks = metadata.block_table[i, first:-(-seq_len // block_size)].long()
        plan.prefills.append(_Prefill(int(starts[i]), int(starts[i]) + query_len, blocks,
                                      seq_len - first * block_size, mask))
    decodes = np.flatnonzero(query_lens == 1)
    if len(decodes):
        plan.decodes = _decode_groups(metadata, decodes, starts, k_cache, window)
    return plan


def _decode_groups(metadata: AttentionMetadata, reqs: np.ndarray, starts: np.ndarray,
                   k_cache: torch.Tensor, window: int) -> list[_DecodeGroup]:
    """Decode rows in groups; keys outside a row's window (past its end, or before the
    sliding window) are masked, and blocks holding none of its keys read the null block."""
    block_size, per_token = k_cache.shape[1], k_cache.shape[2] * k_cache.shape[3]
    seq_lens = np.asarray(metadata.seq_lens_cpu)[reqs]
    num_blocks = -(-int(seq_lens.max()) // block_size)
    length = num_blocks * block_size
    group_size = max(1, _DECODE_GATHER_ELEMENTS // (length * per_token))
    device = k_cache.device
    pos = torch.arange(length, device=device)
    groups = []
    for g in range(0, len(reqs), group_size):
        members = reqs[g:g + group_size]
        seq = torch.from_numpy(seq_lens[g:g + group_size]).to(device)
        table = metadata.block_table[torch.from_numpy(members).to(device), :num_blocks].long()
        valid = pos[None, :] < seq[:, None]
        if window:
            valid &= pos[None, :] >= seq[:, None] - window
        # Stale slots: past seq_len but inside a request's own (last) block.
        stale = ~valid & (pos[None, :] < (-(-seq // block_size) * block_size)[:, None])
        groups.append(_DecodeGroup(
            rows=_rows(starts[members], device),
            blocks=table.masked_fill(~valid.view(len(members), num_blocks, block_size)
                                     .any(-1), 0).flatten(),
            valid=valid, stale=stale.flatten().nonzero().flatten() if bool(stale.any()) else None))
    return groups


def _rows(rows: np.ndarray, device: torch.device) -> slice | torch.Tensor:
    """Token rows as a slice when contiguous (the usual all-decode step): no gather/scatter."""
    if rows[-1] - rows[0] == len(rows) - 1:  # increasing, so contiguous
        return slice(int(rows[0]), int(rows[-1]) + 1)
    return torch.from_numpy(rows).to(device)
