"""One step's flat token batch (no padding), built from the persistent batch with numpy."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from protocol.scheduler_output import SchedulerOutput
from protocol.speculative_config import MAX_SPEC_LEN
from worker.attention.metadata import AttentionMetadata
from worker.input_batch import InputBatch, StepProtocolError, as_array
from worker.sample.metadata import SamplingMetadata


@dataclass(slots=True)
class StepInputs:
    req_ids: list[int]  # handles in batch order: new requests, then cached ones
    rows: np.ndarray  # [num_reqs] their rows in the InputBatch
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num_logits] token rows whose hidden state is sampled
    sampled: np.ndarray  # [num_reqs] bool: the step reached the request's last token
    computed: np.ndarray  # [num_reqs] tokens each request had computed before the step
    # A speculative step's [num_reqs] draft tokens each request verifies, after its known
    # tokens; a sampled request's logits rows are its last known token's, then its drafts'.
    # None in a plain step (one logits row per sampled request).
    num_drafts: np.ndarray | None = None
    counts: np.ndarray | None = None  # [num_reqs] tokens each request computes in the step
    lora_ids: np.ndarray | None = None  # [num_reqs] each request's LoRA adapter id (0: none)
    # A step's sampler inputs for its sampled rows (no drafts), gathered before the forward (the
    # model runner's; None: not gathered, or nothing sampled).
    sampling: SamplingMetadata | None = None


def prepare_step(batch: InputBatch, so: SchedulerOutput) -> StepInputs:
    """Positions, token ids, cache slots and attention metadata of every scheduled token.

    Request i's tokens are positions `[computed_i, computed_i + count_i)`; it is sampled when
    that reaches its known tokens (and its drafts, which are written after them). Each tensor
    is built once on the host and copied once.
    """
    req_ids = so.scheduled_req_ids
    rows = batch.rows_of(req_ids)
    counts = as_array(so.scheduled_token_counts)
    computed = batch.num_computed[rows]
    seq_lens = computed + counts
    drafts = _place_drafts(batch, so, rows)
    known = batch.num_tokens[rows] if drafts is None else batch.num_tokens[rows] + drafts
    _check_step(batch, so, rows, counts, seq_lens, known)
    positions, metadata = attention_inputs(batch, rows, computed, counts)
    sampled = seq_lens >= known
    batch.num_computed[rows] = seq_lens
    ends = np.cumsum(counts)
    if drafts is None:
        logits_indices = ends[sampled] - 1
    else:
        if (drafts[~sampled] > 0).any():
            raise StepProtocolError(f"step {so.step}: drafts for a request whose known "
                                    "tokens are not all scheduled")
        per_request = drafts[sampled] + 1
        logits_indices = (np.repeat(ends[sampled] - per_request, per_request)
                          + np.arange(int(per_request.sum()))
                          - np.repeat(np.cumsum(per_request) - per_request, per_request))
    token_rows = np.repeat(rows, counts)
    device = batch.device
    return StepInputs(req_ids, rows, _to(batch.token_ids[token_rows, positions], device),
                      _to(positions, device), metadata, _to(logits_indices, device), sampled,
                      computed, drafts, counts, batch.lora_ids[rows])


def attention_inputs(batch: InputBatch, rows: np.ndarray, computed: np.ndarray,
                     counts: np.ndarray) -> tuple[np.ndarray, AttentionMetadata]:
    """Positions [sum(counts)] and attention metadata of `counts[i]` tokens of row `rows[i]`
    from position `computed[i]` on, their KV going to the row's slots (any model whose cache
    has this batch's blocks: the target's, a draft model's). The metadata is KV layer group
    0's; with several groups, `metadata.for_layer(i)` is layer i's group's (its block table,
    slots and window)."""
    seq_lens = computed + counts
    ends = np.cumsum(counts)
    req_of_token = np.repeat(np.arange(len(rows)), counts)
    positions = computed[req_of_token] + np.arange(int(ends[-1])) - (ends - counts)[req_of_token]
    token_rows = rows[req_of_token]
    bs = batch.block_size
    max_blocks = -(-int(seq_lens.max()) // bs)
    device = batch.device
    query_start_loc = _to(np.concatenate(([0], ends)).astype(np.int32), device)
    seq_lens_t = _to(seq_lens.astype(np.int32), device)
    query_lens, seq_lens_list = counts.tolist(), seq_lens.tolist()
    shared: dict = {}
    groups = []
    for table, window in zip(batch.block_tables, batch.sliding_windows):
        slots = table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        groups.append(AttentionMetadata(
            slot_mapping=_to(slots, device), query_start_loc=query_start_loc,
            seq_lens=seq_lens_t, block_table=_to(table[rows, :max_blocks], device),
            max_query_len=int(counts.max()), max_seq_len=int(seq_lens.max()),
            query_lens_cpu=query_lens, seq_lens_cpu=seq_lens_list, sliding_window=window,
            shared=shared))
    metadata = groups[0]
    # Per layer: its group's metadata; a layer whose window its group does not have (without
    # the hybrid manager: all layers share group 0) gets a copy with its window.
    variants = {(g, m.sliding_window): m for g, m in enumerate(groups)}
    for g, window in zip(batch.layer_groups, batch.layer_windows):
        if (g, window) not in variants:
            variants[(g, window)] = dataclasses.replace(groups[g], sliding_window=window,
                                                        plan=None)
    if len(variants) > 1:
        metadata.by_layer = [variants[(g, w)]
                             for g, w in zip(batch.layer_groups, batch.layer_windows)]
    return positions, metadata


def _place_drafts(batch: InputBatch, so: SchedulerOutput, rows: np.ndarray,
                  ) -> np.ndarray | None:
    """Write the step's draft tokens after their requests' known tokens; the drafts per
    scheduled request ([num_reqs]), or None in a plain step."""
    spec = so.scheduled_spec_decode_tokens
    if spec is None:
        return None
    drafts = np.zeros(len(rows), np.int64)
    if not len(spec):
        return drafts
    position_of_row = np.full(len(batch.num_tokens), -1, np.int64)
    position_of_row[rows] = np.arange(len(rows))
    where = position_of_row[batch.rows_of(spec.req_ids)]
    if (where < 0).any() or (np.diff(where) <= 0).any():
        raise StepProtocolError(f"step {so.step}: drafts must name scheduled requests, in "
                                "step order")
    counts, tokens = as_array(spec.num_tokens), as_array(spec.token_ids)
    draft_rows = rows[where]
    starts = batch.num_tokens[draft_rows]
    if counts.max() > MAX_SPEC_LEN or (starts + counts >= batch.token_ids.shape[1]).any():
        raise StepProtocolError(f"step {so.step}: too many draft tokens")
    if batch.vocab_size is not None and int(tokens.max()) >= batch.vocab_size:
        raise StepProtocolError(f"step {so.step}: draft token ids outside the vocabulary")
    drafts[where] = counts
    first = np.repeat(np.cumsum(counts) - counts, counts)
    batch.token_ids[np.repeat(draft_rows, counts),
                    np.repeat(starts, counts) + np.arange(len(tokens)) - first] = tokens
    return drafts


def _check_step(batch: InputBatch, so: SchedulerOutput, rows: np.ndarray, counts: np.ndarray,
                seq_lens: np.ndarray, known: np.ndarray) -> None:
    if (counts <= 0).any() or int(counts.sum()) != so.total_num_scheduled_tokens:
        raise StepProtocolError(f"step {so.step}: token counts do not add up to "
                                f"{so.total_num_scheduled_tokens}")
    beyond = seq_lens > known
    if beyond.any():
        i = int(np.flatnonzero(beyond)[0])
        raise StepProtocolError(f"step {so.step}: request {so.scheduled_req_ids[i]} "
                                f"scheduled up to {seq_lens[i]} of {known[i]} known tokens")
    short = -(-seq_lens // batch.block_size) > batch.num_blocks[rows]
    if short.any():
        i = int(np.flatnonzero(short)[0])
        raise StepProtocolError(f"step {so.step}: request {so.scheduled_req_ids[i]} "
                                f"has too few KV blocks for {seq_lens[i]} tokens")


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=True)
