"""The worker's persistent per-request state, updated by each step's deltas."""
from __future__ import annotations

import heapq

import numpy as np
import torch

from protocol.int_column import IntColumn
from protocol.pooling_params import PoolingParams
from protocol.sampling_params import GREEDY_EPS
from protocol.scheduler_output import GrammarBitmask, NewRequestData, SchedulerOutput
from worker.sample.metadata import SamplingMetadata
from worker.sample.sampling_table import SamplingTable

MAX_HANDLES = 1 << 20  # far above any live request count; bounds row_of_handle's size


class StepProtocolError(RuntimeError):
    """A step message contradicts what this worker knows (a desync, never guessed around)."""


class InputBatch:
    """One row per live request handle, kept until the request finishes (also while it is
    preempted: the worker keeps its tokens, only its blocks are gone).

    Row r holds `token_ids[r, :num_tokens[r]]` (prompt then outputs; the worker appends its own
    samples), `num_computed[r]` tokens with KV in `block_tables[g, r, :num_blocks[r]]` for each
    KV layer group g (`block_table` is group 0's). Block ids arrive group-major (each group's
    part of equal length); a sliding-window group's null blocks (0) stand where blocks left
    its window, never read.
    """

    def __init__(self, max_model_len: int, block_size: int, device: torch.device,
                 rows: int = 16, num_kv_blocks: int | None = None,
                 vocab_size: int | None = None,
                 sliding_windows: tuple[int, ...] = (0,),
                 layer_groups: tuple[int, ...] = (),
                 layer_windows: tuple[int, ...] = ()) -> None:
        self.block_size = block_size
        # Bounds on what a step may name, so that no message can make this batch grow without
        # limit or index out of range: block ids below num_kv_blocks, token ids in the
        # vocabulary, handles below MAX_HANDLES.
        self.num_kv_blocks = num_kv_blocks
        self.vocab_size = vocab_size
        self.device = device
        self.max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((rows, max_model_len + 1), np.int32)
        self.num_tokens = np.zeros(rows, np.int64)
        self.num_prompt_tokens = np.zeros(rows, np.int64)
        self.num_computed = np.zeros(rows, np.int64)
        self.sliding_windows = tuple(sliding_windows) or (0,)  # per KV layer group
        self.layer_groups = layer_groups  # per model layer, its group
        self.layer_windows = layer_windows  # per model layer, its attention window
        self.block_tables = np.zeros((len(self.sliding_windows), rows, self.max_blocks), np.int32)
        self.num_blocks = np.zeros(rows, np.int64)
        self.lora_ids = np.zeros(rows, np.int64)  # each row's LoRA adapter id (0: none)
        self.row_of_handle = np.full(rows, -1, np.int64)
        self.request_ids: list[str | None] = [None] * rows
        self.pooling_params: list[PoolingParams | None] = [None] * rows  # pooling requests'
        self.sampling = SamplingTable(rows)
        self._free_rows = list(range(rows))

    @property
    def block_table(self) -> np.ndarray:
        """Group 0's block table [rows, max_blocks]."""
        return self.block_tables[0]

    # --- deltas -----------------------------------------------------------------------------

    def apply(self, so: SchedulerOutput) -> None:
        """Finished leave, preempted lose their blocks, new arrive, cached update."""
        for handle in so.finished_req_ids:
            self._remove(handle)
        for handle in so.preempted_req_ids:
            self.num_blocks[self._row(handle)] = 0
        for new in so.scheduled_new_reqs:
            self.add_request(new)
        cached = so.scheduled_cached_reqs
        if not len(cached.req_ids):
            return
        rows = self.rows_of(cached.req_ids)
        resumed = np.isin(rows, self.rows_of(cached.resumed_req_ids))
        computed = as_array(cached.num_computed_tokens)
        stale = ~resumed & (self.num_computed[rows] != computed)
        if stale.any():
            i = int(np.flatnonzero(stale)[0])
            raise StepProtocolError(
                f"step {so.step}: handle {cached.req_ids[i]} has {self.num_computed[rows[i]]} "
                f"computed tokens here, the scheduler says {computed[i]}")
        self.num_computed[rows] = computed
        self.num_blocks[rows[resumed]] = 0  # a resumed request's list is replaced
        for i, block_ids in enumerate(cached.new_block_ids):
            if block_ids:
                self._append_blocks(int(rows[i]), block_ids)

    def rows_of(self, handles: IntColumn | list[int]) -> np.ndarray:
        handles = as_array(handles) if len(handles) else np.zeros(0, np.int64)
        if len(handles) and (int(handles.max()) >= len(self.row_of_handle)
                             or int(handles.min()) < 0):
            bad = int(handles.max()) if int(handles.min()) >= 0 else int(handles.min())
            raise StepProtocolError(f"unknown request handle {bad}")
        rows = self.row_of_handle[handles]
        if (rows < 0).any():
            raise StepProtocolError(f"unknown request handle {int(handles[rows < 0][0])}")
        return rows

    def live_rows(self) -> np.ndarray:
        """The rows of the requests this batch holds."""
        return self.row_of_handle[self.row_of_handle >= 0]

    def _row(self, handle: int) -> int:
        return int(self.rows_of([handle])[0])

    def add_request(self, new: NewRequestData) -> None:
        if not 0 <= new.req_id < MAX_HANDLES:
            raise StepProtocolError(f"request handle {new.req_id} is outside [0, {MAX_HANDLES})")
        if new.req_id < len(self.row_of_handle) and self.row_of_handle[new.req_id] >= 0:
            raise StepProtocolError(f"new request handle {new.req_id} is already live")
        n = len(new.prompt_token_ids)
        if n >= self.token_ids.shape[1]:
            raise StepProtocolError(f"prompt of {n} tokens exceeds max_model_len")
        if n and (min(new.prompt_token_ids) < 0 or self.vocab_size is not None
                  and max(new.prompt_token_ids) >= self.vocab_size):
            raise StepProtocolError(f"request {new.request_id!r} has token ids outside the "
                                    f"vocabulary (size {self.vocab_size})")
        if not self._free_rows:
            self._grow()
        row = heapq.heappop(self._free_rows)
        if new.req_id >= len(self.row_of_handle):
            grown = np.full(max(2 * len(self.row_of_handle), new.req_id + 1), -1, np.int64)
            grown[:len(self.row_of_handle)] = self.row_of_handle
            self.row_of_handle = grown
        self.row_of_handle[new.req_id] = row
        self.token_ids[row, :n] = new.prompt_token_ids
        self.num_tokens[row] = self.num_prompt_tokens[row] = n
        self.num_computed[row] = new.num_computed_tokens
        self.num_blocks[row] = 0
        self._append_blocks(row, new.block_ids)
        self.request_ids[row] = new.request_id
        self.lora_ids[row] = new.lora_request.lora_int_id if new.lora_request else 0
        self.pooling_params[row] = new.pooling_params
        self.sampling.set_row(row, new.sampling_params, new.eos_token_id, self.device)

    def _remove(self, handle: int) -> None:
        row = self._row(handle)
        self.row_of_handle[handle] = -1
        self.request_ids[row] = None
        self.lora_ids[row] = 0
        self.pooling_params[row] = None
        self.sampling.clear_row(row)
        heapq.heappush(self._free_rows, row)

    def _append_blocks(self, row: int, block_ids: list[int]) -> None:
        """Append group-major ids: each group's equal share to its table's row."""
        start, groups = int(self.num_blocks[row]), len(self.sliding_windows)
        n = len(block_ids) // groups
        if n * groups != len(block_ids):
            raise StepProtocolError(f"{len(block_ids)} block ids for {groups} KV layer groups")
        if start + n > self.max_blocks:
            raise StepProtocolError(f"{start + n} blocks exceed max_model_len")
        ids = np.asarray(block_ids, np.int64).reshape(groups, n)
        # Null blocks only where a window no longer reads (never in a full-attention group).
        low = np.where(np.asarray(self.sliding_windows) > 0, 0, 1)[:, None]
        if n and ((ids < low).any() or self.num_kv_blocks is not None
                  and int(ids.max()) >= self.num_kv_blocks):
            raise StepProtocolError(f"block ids {int(ids.min())}..{int(ids.max())} are outside "
                                    f"the KV cache (blocks 1..{self.num_kv_blocks})")
        self.block_tables[:, row, start:start + n] = ids
        self.num_blocks[row] = start + n

    def _grow(self) -> None:
        old = len(self.request_ids)
        for name in ("token_ids", "num_tokens", "num_prompt_tokens", "num_computed",
                     "num_blocks", "lora_ids"):
            array = getattr(self, name)
            grown = np.zeros((2 * old, *array.shape[1:]), array.dtype)
            grown[:old] = array
            setattr(self, name, grown)
        tables = np.zeros((len(self.sliding_windows), 2 * old, self.max_blocks), np.int32)
        tables[:, :old] = self.block_tables
        self.block_tables = tables
        self.request_ids += [None] * old
        self.pooling_params += [None] * old
        self.sampling.grow(2 * old)
        for row in range(old, 2 * old):
            heapq.heappush(self._free_rows, row)

    # --- tokens -----------------------------------------------------------------------------

    def append_tokens(self, rows: np.ndarray, tokens: list[int]) -> None:
        self.token_ids[rows, self.num_tokens[rows]] = tokens
        self.num_tokens[rows] += 1

    def append_verified(self, rows: np.ndarray, tokens: list[list[int]],
                        num_drafts: np.ndarray) -> None:
        """After a speculative step: row `rows[i]` verified `num_drafts[i]` drafts and emits
        `tokens[i]` (its accepted drafts, then one more); the KV of its rejected drafts no
        longer counts as computed."""
        for row, emitted, drafts in zip(rows.tolist(), tokens, num_drafts.tolist()):
            n = int(self.num_tokens[row])
            self.token_ids[row, n:n + len(emitted)] = emitted
            self.num_tokens[row] = n + len(emitted)
            self.num_computed[row] -= drafts + 1 - len(emitted)

    def prompt_and_output(self, row: int, end: int | None = None,
                          ) -> tuple[np.ndarray, np.ndarray]:
        """Views of the row's prompt and outputs (up to token `end`, default its known ones;
        a speculative step looks past them, at its drafts)."""
        n, p = int(self.num_tokens[row]) if end is None else end, int(self.num_prompt_tokens[row])
        return self.token_ids[row, :p], self.token_ids[row, p:n]

    # --- sampling ---------------------------------------------------------------------------

    def sampling_metadata(self, rows: np.ndarray, grammar: GrammarBitmask | None = None,
                          offsets: np.ndarray | None = None) -> SamplingMetadata:
        """The sampler's inputs for `rows` (the sampled requests' rows, in logits order): numpy
        gathers, plus per-request Python only for non-greedy rows (their own generators) and
        rows with penalties or below min_tokens. `grammar`: the step's masks. In a speculative
        step a row repeats once per logits row of its request, and `offsets` says how many of
        its drafts (written after its known tokens) precede that logits row: they count as
        its outputs there."""
        table = self.sampling
        temperature = table.temperature[rows]
        random = np.flatnonzero(temperature >= GREEDY_EPS)
        penalized = np.flatnonzero(table.penalties[rows])
        ends = self.num_tokens[rows] if offsets is None else self.num_tokens[rows] + offsets
        views = [self.prompt_and_output(int(rows[i]), int(ends[i])) for i in penalized]
        grammar_rows, bitmask = self._grammar(rows, grammar)
        below = ends - self.num_prompt_tokens[rows] < table.min_tokens[rows]
        if grammar_rows is not None:
            below[grammar_rows] = False
        below_min = np.flatnonzero(below)
        logprobs = table.logprobs[rows]
        plain = not (len(random) or len(penalized) or len(below_min)
                     or grammar_rows is not None or (logprobs >= 0).any())
        return SamplingMetadata(
            temperature=temperature, all_greedy=not len(random), top_k=table.top_k[rows],
            top_p=table.top_p[rows], min_p=table.min_p[rows],
            generators={i: generator for i in random.tolist()
                        if (generator := table.generators[rows[i]]) is not None},
            logprobs=logprobs, penalized=penalized,
            penalty_params=[table.params[rows[i]] for i in penalized],
            prompt_tokens=[prompt for prompt, _ in views],
            output_tokens=[output for _, output in views], below_min_tokens=below_min,
            stop_tokens=[table.stop_tokens(int(rows[i])) for i in below_min],
            grammar_rows=grammar_rows, grammar_bitmask=bitmask, plain=plain)

    def _grammar(self, rows: np.ndarray, grammar: GrammarBitmask | None,
                 ) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The logits rows of the step's masks (increasing) and the masks in that order."""
        if grammar is None:
            return None, None
        batch_rows = self.rows_of(grammar.req_ids)
        words = -(-(self.vocab_size or 0) // 32)
        if not words or len(grammar.bitmask) != 4 * words * len(batch_rows):
            raise StepProtocolError(f"a grammar bitmask of {len(grammar.bitmask)} bytes for "
                                    f"{len(batch_rows)} rows of {words} words")
        bitmask = np.frombuffer(grammar.bitmask, "<i4").reshape(len(batch_rows), words)
        # A request's k-th mask row goes to its k-th logits row (several in a speculative
        # step, where its mask rows are consecutive and as many as its logits rows).
        order = np.argsort(rows, kind="stable")
        found = np.searchsorted(rows, batch_rows, sorter=order) + _run_index(batch_rows)
        positions = order[np.minimum(found, len(rows) - 1)]
        if len(rows) == 0 or (rows[positions] != batch_rows).any() or \
                len(np.unique(positions)) != len(positions) or \
                np.isin(rows, batch_rows).sum() != len(batch_rows):
            raise StepProtocolError("a grammar bitmask's rows do not match the logits rows of "
                                    "its requests")
        if not bitmask.any(axis=1).all():
            raise StepProtocolError("a grammar bitmask row allows no token")
        increasing = np.argsort(positions)
        return positions[increasing], bitmask[increasing]


def _run_index(values: np.ndarray) -> np.ndarray:
    """For each entry, how many equal entries directly precede it: [5, 5, 7, 5] -> [0, 1, 0, 0]."""
    index = np.arange(len(values))
    starts = np.ones(len(values), bool)
    starts[1:] = values[1:] != values[:-1]
    return index - np.maximum.accumulate(np.where(starts, index, 0))


def as_array(column: IntColumn | list[int]) -> np.ndarray:
    if isinstance(column, IntColumn):
        return np.frombuffer(column, dtype=column.typecode).astype(np.int64)
    return np.asarray(column, dtype=np.int64)
