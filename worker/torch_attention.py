"""Paged attention in plain torch: the CPU backend and the reference for the CUDA kernels."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from worker.attention_metadata import AttentionMetadata

# Decode rows are attended in groups whose gathered K (or V) stays under this many elements.
_DECODE_GATHER_ELEMENTS = 1 << 24


@dataclass(slots=True)
class _DecodeGroup:
    rows: torch.Tensor  # [n] token rows (one query token per request)
    slots: torch.Tensor  # [n, L] cache slots of positions 0..L-1; slot 0 past a request's end
    valid: torch.Tensor  # [n, L] bool: position < seq_len


@dataclass(slots=True)
class _Prefill:
    start: int
    end: int
    slots: torch.Tensor  # [seq_len] cache slots of positions 0..seq_len-1
    mask: torch.Tensor | None  # [query_len, seq_len] bool, None when there is no context


@dataclass(slots=True)
class _TorchPlan:
    decodes: list[_DecodeGroup] = field(default_factory=list)
    prefills: list[_Prefill] = field(default_factory=list)
    has_padding: bool = False


class TorchAttentionBackend:
    """Decode rows are batched: their KV is gathered through the block table into a padded
    batch for one SDPA call per group. Padding positions gather slot 0 of the null block,
    which this backend keeps zeroed, so stale or poisoned cache contents (a partial last
    block's tail, unused blocks) never reach the softmax. Prefill chunks run one SDPA each
    over exactly their context."""

    name = "torch"

    def plan(self, metadata: AttentionMetadata) -> None:
        metadata.plan = None  # built lazily by the first layer, which knows the cache shape

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata,
                scale: float) -> torch.Tensor:
        if metadata.plan is None:
            metadata.plan = _make_plan(metadata, k_cache)
        plan: _TorchPlan = metadata.plan
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        k_flat = k_cache.view(num_slots, *k_cache.shape[2:])
        v_flat = v_cache.view(num_slots, *v_cache.shape[2:])
        _write_kv(key, value, k_flat, v_flat, metadata.slot_mapping, plan.has_padding)
        if plan.decodes:  # padding reads slot 0: the null block is never written otherwise
            k_flat[0].zero_()
            v_flat[0].zero_()
        out = torch.empty_like(query)
        for group in plan.decodes:
            out[group.rows] = _decode(query[group.rows], k_flat, v_flat, group, scale)
        for p in plan.prefills:
            q = query[p.start:p.end].transpose(0, 1)  # [num_heads, query_len, head_dim]
            k = k_flat[p.slots].transpose(0, 1)  # [num_kv_heads, seq_len, head_dim]
            v = v_flat[p.slots].transpose(0, 1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=p.mask,
                                               is_causal=p.mask is None, scale=scale,
                                               enable_gqa=True)
            out[p.start:p.end] = o.transpose(0, 1)
        return out


def _write_kv(key: torch.Tensor, value: torch.Tensor, k_flat: torch.Tensor,
              v_flat: torch.Tensor, slots: torch.Tensor, has_padding: bool) -> None:
    if has_padding:
        keep = slots >= 0
        key, value, slots = key[keep], value[keep], slots[keep]
    k_flat.index_copy_(0, slots, key.to(k_flat.dtype))
    v_flat.index_copy_(0, slots, value.to(v_flat.dtype))


def _decode(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, group: _DecodeGroup,
            scale: float) -> torch.Tensor:
    k = k_flat[group.slots].transpose(1, 2)  # [n, kv_heads, L, dim]
    v = v_flat[group.slots].transpose(1, 2)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v,
                                       attn_mask=group.valid[:, None, None, :], scale=scale,
                                       enable_gqa=True)
    return o.squeeze(2)  # [n, num_heads, dim]


def _slots_of(block_row: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(length, device=block_row.device)
    return block_row[pos // block_size].long() * block_size + pos % block_size


def _make_plan(metadata: AttentionMetadata, k_cache: torch.Tensor) -> _TorchPlan:
    block_size = k_cache.shape[1]
    plan = _TorchPlan(has_padding=bool((metadata.slot_mapping < 0).any()))
    starts = metadata.query_start_loc.tolist()
    decode_reqs = []
    for i, (query_len, seq_len) in enumerate(zip(metadata.query_lens_cpu,
                                                 metadata.seq_lens_cpu)):
        if query_len == 1:
            decode_reqs.append(i)
            continue
        if query_len == 0:
            continue
        context = seq_len - query_len
        mask = None
        if context:
            key_pos = torch.arange(seq_len, device=k_cache.device)
            q_pos = context + torch.arange(query_len, device=k_cache.device)
            mask = key_pos[None, :] <= q_pos[:, None]
        plan.prefills.append(_Prefill(starts[i], starts[i] + query_len,
                                      _slots_of(metadata.block_table[i], seq_len, block_size),
                                      mask))
    if decode_reqs:
        plan.decodes = _decode_groups(metadata, decode_reqs, starts, k_cache)
    return plan


def _decode_groups(metadata: AttentionMetadata, reqs: list[int], starts: list[int],
                   k_cache: torch.Tensor) -> list[_DecodeGroup]:
    block_size, per_token = k_cache.shape[1], k_cache.shape[2] * k_cache.shape[3]
    longest = max(metadata.seq_lens_cpu[i] for i in reqs)
    group_size = max(1, _DECODE_GATHER_ELEMENTS // (longest * per_token))
    device = k_cache.device
    pos = torch.arange(longest, device=device)
    groups = []
    for g in range(0, len(reqs), group_size):
        idx = torch.tensor(reqs[g:g + group_size], device=device)
        table = metadata.block_table[idx][:, pos // block_size].long()
        seq = metadata.seq_lens[idx].to(device)
        valid = pos[None, :] < seq[:, None]
        groups.append(_DecodeGroup(
            rows=torch.tensor([starts[i] for i in reqs[g:g + group_size]], device=device),
            slots=(table * block_size + pos % block_size).masked_fill_(~valid, 0),
            valid=valid))
    return groups
