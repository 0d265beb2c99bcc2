"""Speculative decoding in the engine core: which drafts a step verifies, what came of them,
and the proposals for the next step."""
from __future__ import annotations

import numpy as np

from engine_core.request import Request, RequestStatus
from engine_core.sched.request_table import RequestTable
from engine_core.sched.step_plan import StepPlan
from engine_core.spec_decode.draft_state import DraftState
from engine_core.spec_decode.ngram_proposer import NgramProposer
from protocol.draft_tokens import DraftTokens
from protocol.engine_messages import SpecDecodingStats
from protocol.int_column import IntColumn
from protocol.model_runner_output import ModelRunnerOutput
from protocol.scheduler_output import SchedulerOutput
from protocol.speculative_config import SpeculativeConfig


class Speculator:
    """Proposals live for one step: `update` gives requests their `spec_token_ids` (n-gram
    lookup here, or the draft model's answer from the workers) and the next `schedule` either
    schedules them as extra tokens of their requests, inside the one token budget, or drops
    them. Verified drafts come back as 1 to d + 1 sampled tokens; `update` takes the rejected
    ones back from `num_computed_tokens` (only accepted tokens ever become known tokens, so
    only they reach prefix-cache blocks) and adapts each request's draft length.
    """

    def __init__(self, config: SpeculativeConfig, table: RequestTable,
                 requests_by_handle: dict[int, Request]) -> None:
        self.config = config
        self.table = table
        self.requests_by_handle = requests_by_handle
        self.ngram = (NgramProposer(config.lookup_min, config.lookup_max)
                      if config.method == "ngram" else None)
        # A draft model writes its KV this far past a step's tokens while it proposes.
        self.num_lookahead_tokens = 0 if self.ngram else config.num_speculative_tokens
        self.proposed: list[Request] = []  # requests given proposals by the last update
        self.counts = SpecDecodingStats()

    # --- schedule ---------------------------------------------------------------------------

    def schedule(self, plan: StepPlan) -> tuple[DraftTokens | None, IntColumn | None]:
        """The drafts `plan` verifies, in step order (each request's scheduled count past its
        known tokens, at most its proposals) and, with a draft model, how many tokens each
        scheduled request proposes after the step. Every proposal is consumed. Call before
        the plan advances `num_computed_tokens`."""
        drafts = self._scheduled_drafts(plan) if self.proposed else None
        propose = None if self.ngram else self._lengths_to_propose(plan)
        return drafts, propose

    def _scheduled_drafts(self, plan: StepPlan) -> DraftTokens | None:
        table, proposed = self.table, self.proposed
        self.proposed = []
        position = np.full(len(table.num_tokens), -1, np.int64)
        position[plan.req_ids] = np.arange(len(plan.req_ids))
        handles = np.array([r.req_id for r in proposed], np.int64)
        where = position[handles]
        behind = table.num_tokens[handles] - table.num_computed[handles]
        taken = np.where(where >= 0, plan.counts[where] - behind, 0)
        taken = np.clip(taken, 0, table.num_spec[handles]).tolist()
        table.num_spec[handles] = 0
        chosen = []
        for i in np.argsort(where, kind="stable").tolist():
            request, n = proposed[i], taken[i]
            if n > 0 and not request.is_finished():
                chosen.append((request.req_id, request.spec_token_ids[:n]))
            request.spec_token_ids = []
        if not chosen:
            return None
        req_ids, tokens = zip(*chosen)
        return DraftTokens.from_lists(list(req_ids), list(tokens))

    def _lengths_to_propose(self, plan: StepPlan) -> IntColumn | None:
        """Per scheduled request (new, then known): draft tokens the workers propose after
        the step, for those that reach their last known token in it (None: none)."""
        requests, _, counts = plan.scheduled()
        ends = [request.num_computed_tokens + n >= request.num_tokens
                for request, n in zip(requests, counts.tolist())]
        batch = sum(ends)
        lengths = [self._wanted(request, batch) if end else 0
                   for request, end in zip(requests, ends)]
        return IntColumn.narrowest(lengths) if any(lengths) else None

    # --- update -----------------------------------------------------------------------------

    def update(self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput) -> None:
        """After the step's tokens were appended (and finished requests freed): take back
        rejected drafts, count them, and give the running requests their next proposals."""
        verified = scheduler_output.scheduled_spec_decode_tokens
        if verified is not None:
            self._take_back_rejected(verified, output)
        if self.ngram is not None:
            self._propose_ngrams(output)
        elif output.draft_token_ids is not None:
            for handle, tokens in output.draft_token_ids.items():
                request = self.requests_by_handle.get(handle)
                if request is not None and request.status == RequestStatus.RUNNING:
                    self._give(request, tokens[:_room(request)])

    def _take_back_rejected(self, verified: DraftTokens, output: ModelRunnerOutput) -> None:
        index = {handle: i for i, handle in enumerate(output.req_ids)}
        counts, table = self.counts, self.table
        for handle, drafts in verified.items():
            i = index.get(handle)
            num_emitted = len(output.sampled_token_ids[i]) if i is not None else 0
            if not num_emitted:
                continue  # not answered (cannot happen for a step that verified it)
            accepted = num_emitted - 1
            counts.num_drafts += 1
            counts.num_draft_tokens += len(drafts)
            counts.num_accepted_tokens += accepted
            request = self.requests_by_handle.get(handle)
            if request is None or request.is_finished():
                continue
            _state(request, self.config).observe(len(drafts), accepted)
            rejected = len(drafts) - accepted
            request.num_computed_tokens -= rejected
            table.num_computed[handle] -= rejected

    def _propose_ngrams(self, output: ModelRunnerOutput) -> None:
        by_handle, ngram = self.requests_by_handle, self.ngram
        decoding = [request for handle, tokens in zip(output.req_ids, output.sampled_token_ids)
                    if tokens and (request := by_handle.get(handle)) is not None
                    and request.status == RequestStatus.RUNNING]
        for request in decoding:
            k = self._wanted(request, len(decoding))
            if k:
                state: DraftState = request.spec_state
                self._give(request, ngram.propose(state.synced_tokens(request.all_token_ids), k))

    def _wanted(self, request: Request, batch_size: int) -> int:
        """How many draft tokens the request proposes now, in a step of `batch_size` decoding
        requests: its adapted length, within what it may still emit."""
        room = _room(request)
        if room <= 0:
            return 0
        return min(_state(request, self.config).next_length(batch_size), room)

    def cut(self, request: Request, n: int) -> None:
        """Keep only the first n of the request's proposals (before the step is scheduled)."""
        request.spec_token_ids = request.spec_token_ids[:n]
        self.table.num_spec[request.req_id] = len(request.spec_token_ids)

    def _give(self, request: Request, tokens: list[int]) -> None:
        if tokens:
            request.spec_token_ids = tokens
            self.table.num_spec[request.req_id] = len(tokens)
            self.proposed.append(request)

    def stats(self) -> SpecDecodingStats:
        c = self.counts
        return SpecDecodingStats(c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens)


class NoSpeculation:
    """The speculator of an engine without speculative decoding: the scheduler's seams do
    nothing, and no request ever has proposals."""

    num_lookahead_tokens = 0

    def schedule(self, plan: StepPlan) -> tuple[None, None]:
        return None, None

    def update(self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput) -> None:
        pass

    def cut(self, request: Request, n: int) -> None:
        pass

    def stats(self) -> None:
        return None


def make_speculator(config: SpeculativeConfig | None, table: RequestTable,
                    requests_by_handle: dict[int, Request]) -> Speculator | NoSpeculation:
    if config is None:
        return NoSpeculation()
    return Speculator(config, table, requests_by_handle)


def _room(request: Request) -> int:
    """Draft tokens worth verifying: a step emits at most drafts + 1 tokens, and the request
    ends at `length_end` (within max_model_len)."""
    return request.length_end - request.num_tokens - 1


def _state(request: Request, config: SpeculativeConfig) -> DraftState:
    if request.spec_state is None:
        request.spec_state = DraftState(config.num_speculative_tokens)
    return request.spec_state
