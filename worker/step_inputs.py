"""One step's flat token batch (no padding), built from the persistent batch with numpy."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from protocol.scheduler_output import SchedulerOutput
from worker.attention.metadata import AttentionMetadata
from worker.input_batch import InputBatch, StepProtocolError, as_array


@dataclass(slots=True)
class StepInputs:
    req_ids: list[int]  # handles in batch order: new requests, then cached ones
    rows: np.ndarray  # [num_reqs] their rows in the InputBatch
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled] token rows whose hidden state is sampled
    sampled: np.ndarray  # [num_reqs] bool: the step reached the request's last token


def prepare_step(batch: InputBatch, so: SchedulerOutput) -> StepInputs:
    """Positions, token ids, cache slots and attention metadata of every scheduled token.

    Request i's tokens are positions `[computed_i, computed_i + count_i)`; it is sampled when
    that reaches its known tokens. Each tensor is built once on the host and copied once.
    """
    req_ids = so.scheduled_req_ids
    rows = batch.rows_of(req_ids)
    counts = as_array(so.scheduled_token_counts)
    computed = batch.num_computed[rows]
    seq_lens = computed + counts
    _check_step(batch, so, rows, counts, seq_lens)
    ends = np.cumsum(counts)
    req_of_token = np.repeat(np.arange(len(rows)), counts)
    positions = computed[req_of_token] + np.arange(int(ends[-1])) - (ends - counts)[req_of_token]
    token_rows = rows[req_of_token]
    bs = batch.block_size
    slots = batch.block_table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
    max_blocks = -(-int(seq_lens.max()) // bs)
    sampled = seq_lens >= batch.num_tokens[rows]
    batch.num_computed[rows] = seq_lens
    device = batch.device
    metadata = AttentionMetadata(
        slot_mapping=_to(slots, device),
        query_start_loc=_to(np.concatenate(([0], ends)).astype(np.int32), device),
        seq_lens=_to(seq_lens.astype(np.int32), device),
        block_table=_to(batch.block_table[rows, :max_blocks], device),
        max_query_len=int(counts.max()), max_seq_len=int(seq_lens.max()),
        query_lens_cpu=counts.tolist(), seq_lens_cpu=seq_lens.tolist())
    return StepInputs(req_ids, rows, _to(batch.token_ids[token_rows, positions], device),
                      _to(positions, device), metadata, _to(ends[sampled] - 1, device), sampled)


def _check_step(batch: InputBatch, so: SchedulerOutput, rows: np.ndarray, counts: np.ndarray,
                seq_lens: np.ndarray) -> None:
    if (counts <= 0).any() or int(counts.sum()) != so.total_num_scheduled_tokens:
        raise StepProtocolError(f"step {so.step}: token counts do not add up to "
                                f"{so.total_num_scheduled_tokens}")
    beyond = seq_lens > batch.num_tokens[rows]
    if beyond.any():
        i = int(np.flatnonzero(beyond)[0])
        raise StepProtocolError(f"step {so.step}: request {so.scheduled_req_ids[i]} "
                                f"scheduled up to {seq_lens[i]} of {batch.num_tokens[rows[i]]} "
                                "known tokens")
    short = -(-seq_lens // batch.block_size) > batch.num_blocks[rows]
    if short.any():
        i = int(np.flatnonzero(short)[0])
        raise StepProtocolError(f"step {so.step}: request {so.scheduled_req_ids[i]} "
                                f"has too few KV blocks for {seq_lens[i]} tokens")


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=True)
