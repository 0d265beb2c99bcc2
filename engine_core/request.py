"""A request as the scheduler tracks it, and its status."""
from __future__ import annotations

import enum
import sys
import time
from typing import Any

from protocol.lora import LoRARequest, lora_hash_keys
from protocol.pooling_params import PoolingParams
from protocol.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Every status above PREEMPTED is final.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6
    # Queued but not schedulable yet: its grammar is still compiling. Below PREEMPTED.
    WAITING_FOR_GRAMMAR = -1


# The finish reason a final status reports (the only place it is derived).
FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One generation request, described by token counts.

    Invariant: `all_token_ids == prompt_token_ids + output_token_ids`, `num_tokens` is its
    length and `0 <= num_computed_tokens <= num_tokens + num_output_placeholders`. Tokens
    `[0, num_computed_tokens)` have (or, once this step runs, will have) their KV in the
    request's blocks. Each step schedules some of the remaining tokens and advances
    `num_computed_tokens` at once; when it reaches the end the worker samples a token,
    `num_tokens` grows by one, and the request is behind by one token again. Prefill, chunked
    prefill, prefix-cache hits and recompute after preemption are all this one rule.
    Speculative decoding adds `spec_token_ids`, proposed tokens after `all_token_ids` that the
    next step schedules as if they were known: while that step runs `num_computed_tokens`
    counts them too, and its update takes back those the target rejected.
    """

    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "arrival_time",
                 "priority", "eos_token_id", "output_token_ids", "all_token_ids",
                 "num_computed_tokens", "status", "req_id", "block_hashes", "num_cached_tokens",
                 "stop_reason", "max_tokens", "num_output_placeholders", "stop_tokens",
                 "length_end", "scheduled_time", "block_hash_extra_keys", "spec_token_ids",
                 "spec_state", "min_tokens", "structured_output", "mask_late", "lora_request",
                 "pooling_params", "reads_prefix_cache")

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, arrival_time: float | None = None,
                 priority: int = 0, eos_token_id: int | None = None,
                 block_hash_extra_keys: tuple[int | str, ...] = (),
                 lora_request: LoRARequest | None = None,
                 pooling_params: PoolingParams | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.eos_token_id = eos_token_id
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # A constrained request waits for its grammar before it can be scheduled.
        self.status = (RequestStatus.WAITING if sampling_params.structured_outputs is None
                       else RequestStatus.WAITING_FOR_GRAMMAR)
        # Wire handle, assigned when first scheduled and kept until the request finishes.
        self.req_id = -1
        # The LoRA adapter it runs with (None: the base model): part of its KV's identity.
        self.lora_request = lora_request
        # Chained hashes of the full blocks of all_token_ids, extended lazily; the extra
        # keys (none by default; an adapter's) go into every block's hash.
        self.block_hashes: list[bytes] = []
        self.block_hash_extra_keys = block_hash_extra_keys or lora_hash_keys(lora_request)
        self.num_cached_tokens = -1
        self.stop_reason: int | str | None = None
        self.max_tokens = sampling_params.max_tokens or sys.maxsize
        # Tokens that may stop it (EOS unless ignored, stop token ids): a sampled token
        # outside them, below `length_end`, never stops it; `check_stop` decides the rest.
        stops = set(sampling_params.stop_token_ids or ())
        if eos_token_id is not None and not sampling_params.ignore_eos:
            stops.add(eos_token_id)
        self.stop_tokens = frozenset(stops)
        # The sequence length that ends it by length (the scheduler caps it at max_seq_len).
        self.length_end = len(self.prompt_token_ids) + self.max_tokens
        # Tokens scheduled to be sampled whose values have not come back yet (async
        # scheduling only; they sit after all_token_ids, and only the workers know them).
        self.num_output_placeholders = 0
        self.scheduled_time: float | None = None  # time.time() when first scheduled
        self.spec_token_ids: list[int] = []  # draft tokens for the next step to verify
        self.spec_state = None  # engine_core.spec_decode's per-request DraftState, if any
        # Outputs before which stop tokens do not stop it (a grammar may waive the rest).
        self.min_tokens = sampling_params.min_tokens
        # Its grammar state (a StructuredOutputRequest) once its grammar is ready; None while
        # it waits for it, and always for an unconstrained request.
        self.structured_output: Any = None
        # Its next mask was not ready when a step was scheduled: it sits out the steps until
        # the engine says it caught up (Scheduler.hold/release).
        self.mask_late = False
        # A pooling request runs its prompt once and finishes with the pooler's result.
        self.pooling_params = pooling_params
        # False when its result needs every prompt position's hidden state (MEAN, CLS, per
        # token): prefix-cache hits would skip positions, so none are read.
        self.reads_prefix_cache = True

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def lora_id(self) -> int:
        """Its adapter's id, 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    def append_output_token_ids(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, req_id={self.req_id}, {self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")
