"""The counters of every request that holds a handle, as numpy columns: the decode fast path."""
from __future__ import annotations

import numpy as np

from engine_core.kv_cache.kv_cache_manager import KVCacheManager
from engine_core.request import Request
from protocol.model_runner_output import ModelRunnerOutput
from protocol.scheduler_output import SchedulerOutput

_NEVER = np.iinfo(np.int64).max


class RequestTable:
    """Row `h` describes the request whose handle is `h` (running, or preempted and waiting).

    Columns (int64, one entry per handle; rows of released handles are stale until reused):
      num_computed  mirrors `Request.num_computed_tokens`
      num_tokens    mirrors `Request.num_tokens` (prompt + sampled outputs)
      placeholders  mirrors `Request.num_output_placeholders`
      num_spec      mirrors `len(Request.spec_token_ids)` (draft tokens to verify next)
      length_end    mirrors `Request.length_end` (constant)
      slot_end      tokens its KV blocks hold (`KVCacheManager.num_slots`)
      publish_end   computed length at which it fills a block not yet in the prefix cache
                    (`KVCacheManager.publish_end`; never when caching is off)
      held          mirrors `Request.mask_late` (1: it takes no tokens until released)
    Every change to one of these facts writes its column in the same scheduler step;
    `check` compares the columns with the objects.
    """

    COLUMNS = ("num_computed", "num_tokens", "placeholders", "num_spec", "length_end",
               "slot_end", "publish_end", "held")

    def __init__(self, rows: int = 64, speculative: bool = False) -> None:
        self.speculative = speculative  # num_spec may be non-zero (else it is never read)
        self.num_computed = np.zeros(rows, np.int64)
        self.num_tokens = np.zeros(rows, np.int64)
        self.placeholders = np.zeros(rows, np.int64)
        self.num_spec = np.zeros(rows, np.int64)
        self.length_end = np.zeros(rows, np.int64)
        self.slot_end = np.zeros(rows, np.int64)
        self.publish_end = np.zeros(rows, np.int64)
        self.held = np.zeros(rows, np.int64)
        self.any_held = 0  # requests held: the pass reads the column only when some are

    # --- rare paths: one request at a time --------------------------------------------------

    def admit(self, request: Request, kv: KVCacheManager) -> None:
        """Fill the row of a request just given (or resumed with) its handle."""
        h = request.req_id
        if h >= len(self.num_tokens):
            self._grow(2 * h + 1)
        self.num_computed[h] = request.num_computed_tokens
        self.num_tokens[h] = request.num_tokens
        self.placeholders[h] = request.num_output_placeholders
        self.num_spec[h] = len(request.spec_token_ids)
        self.length_end[h] = request.length_end
        self.held[h] = request.mask_late
        self.sync_blocks(request, kv)

    def sync_blocks(self, request: Request, kv: KVCacheManager) -> None:
        h, request_id = request.req_id, request.request_id
        self.slot_end[h] = kv.num_slots(request_id)
        publish_end = kv.publish_end(request_id)
        self.publish_end[h] = _NEVER if publish_end is None else publish_end

    def preempt(self, request: Request, kv: KVCacheManager) -> None:
        """The request lost its blocks and its drafts and starts over (its tokens stay)."""
        h = request.req_id
        self.num_computed[h] = self.placeholders[h] = self.num_spec[h] = 0
        self.sync_blocks(request, kv)

    # --- one pass over all running requests -------------------------------------------------

    def schedule_pass(self, handles: np.ndarray, budget: int, max_model_len: int,
                      long_prefill_token_threshold: int, num_lookahead_tokens: int = 0,
                      ) -> tuple[np.ndarray, np.ndarray]:
        """What the running requests `handles` (in running order) take from `budget`, served
        in order: `take[i]` tokens for request i (0: not scheduled), and `needs_kv[i]`: its
        step needs the KV cache manager (a new block, or a newly full block to publish).

        A request is behind by `num_tokens + placeholders + num_spec - num_computed` tokens,
        capped by the long-prefill threshold, by `max_model_len - 1 - num_computed` (positions
        stay below max_model_len; a pooling prompt may fill it) and by what the requests
        before it left of the budget; it takes none if the tokens in flight already end it by
        length, or while it is held. Its KV slots must reach
        `num_lookahead_tokens` past its step (not past max_model_len)."""
        computed, tokens = self.num_computed[handles], self.num_tokens[handles]
        pending = self.placeholders[handles]
        n = tokens + pending - computed
        if self.speculative:
            n += self.num_spec[handles]
        if long_prefill_token_threshold > 0:
            np.minimum(n, long_prefill_token_threshold, out=n)
        # (A running generation request has fewer than max_model_len tokens, or it would have
        # finished by length; a pooling prompt may fill max_model_len, and all of it runs.)
        np.minimum(n, np.maximum(max_model_len - 1, tokens) - computed, out=n)
        n[(pending > 0) & (tokens + pending >= self.length_end[handles])] = 0
        if self.any_held:
            n[self.held[handles] > 0] = 0
        np.maximum(n, 0, out=n)
        # Request i gets what is left after requests 0..i-1 took theirs.
        left = np.maximum(budget - (np.cumsum(n) - n), 0)
        take = np.minimum(n, left)
        end = computed + take
        slots = end  # the slots it needs: with a draft model's lookahead, too
        if num_lookahead_tokens:
            slots = np.minimum(end + num_lookahead_tokens, max_model_len)
        needs_kv = (take > 0) & ((slots > self.slot_end[handles])
                                 | (end >= self.publish_end[handles]))
        return take, needs_kv

    def advance(self, handles: np.ndarray, counts: np.ndarray, placeholders: bool,
                ) -> tuple[list[int], list[int] | None]:
        """`num_computed += counts` (handles are distinct); with `placeholders`, a request
        that reaches its end expects one more sampled token. Returns both new values."""
        computed = self.num_computed[handles] + counts
        self.num_computed[handles] = computed
        if not placeholders:
            return computed.tolist(), None
        pending = self.placeholders[handles]
        pending += computed == self.num_tokens[handles] + pending
        self.placeholders[handles] = pending
        return computed.tolist(), pending.tolist()

    def record_sampled(self, rows: np.ndarray) -> None:
        """One token was appended to each request of `rows` (distinct handles), taking the
        place of a placeholder if it had one."""
        self.num_tokens[rows] += 1
        pending = self.placeholders[rows]
        if pending.any():
            self.placeholders[rows] = np.maximum(pending - 1, 0)

    def check(self, requests: list[Request], kv: KVCacheManager) -> list[str]:
        """Names of the requests whose row disagrees with the request and its blocks."""
        bad = []
        for request in requests:
            h, publish_end = request.req_id, kv.publish_end(request.request_id)
            expected = (request.num_computed_tokens, request.num_tokens,
                        request.num_output_placeholders, len(request.spec_token_ids),
                        request.length_end, kv.num_slots(request.request_id),
                        _NEVER if publish_end is None else publish_end, int(request.mask_late))
            found = tuple(getattr(self, name)[h] for name in self.COLUMNS)
            if tuple(int(x) for x in found) != expected:
                bad.append(f"{request.request_id}: {found} != {expected}")
        return bad

    def _grow(self, rows: int) -> None:
        for name in self.COLUMNS:
            old = getattr(self, name)
            grown = np.zeros(rows, np.int64)
            grown[:len(old)] = old
            setattr(self, name, grown)


def answer_rows(scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput,
                skip: list[int]) -> np.ndarray:
    """The handles of the answer's entries, without the entries at indices `skip`. Workers
    answer in the step's request order, whose handles the step message holds packed."""
    req_ids = model_runner_output.req_ids
    if req_ids == scheduler_output.scheduled_req_ids:
        column = scheduler_output.scheduled_cached_reqs.req_ids
        rows = np.frombuffer(column, column.typecode).astype(np.int64)
        if scheduler_output.scheduled_new_reqs:
            new = [r.req_id for r in scheduler_output.scheduled_new_reqs]
            rows = np.concatenate((np.array(new, np.int64), rows))
    else:
        rows = np.array(req_ids, np.int64)
    return np.delete(rows, skip) if skip else rows
