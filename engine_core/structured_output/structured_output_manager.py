"""The engine core's side of structured outputs: grammars in, masks out, matchers advanced.

Life of a constrained request:
  `add_request`      its grammar starts compiling (or is found in the cache, compiled or
                     failed); the request waits (RequestStatus.WAITING_FOR_GRAMMAR) in its
                     place in the queue, until its deadline at most;
  `poll`             the engine loop turns what grammar work ended into a `GrammarsCompiled`
                     message, which it journals and then applies: compiles that ended
                     (`matcher_for` gives a ready request its matcher and first mask; a
                     failure finishes it with "error"), masks not ready in time (`late`: the
                     request sits out the steps until they are, `caught_up`), and masks the
                     grammar engine failed to compute (`failed`);
  `cut_drafts`       with speculation, each step, its proposals cut where its grammar
                     refuses one;
  `attach_bitmask`   each step, a mask row per constrained request that samples (and one
                     per draft it verifies);
  `accept_tokens`    each answer advances those requests' matchers by their tokens and
                     starts computing their next masks (MaskPipeline).
Whatever a grammar costs, the step loop waits for grammar work at most `mask_wait_s` per
step; every clock-dependent outcome is in `GrammarsCompiled`, so a replay decides alike.
A step without constrained requests does none of this work.
"""
from __future__ import annotations

import time
from typing import Protocol

from engine_core.request import Request
from engine_core.structured_output.bitmask_builder import BitmaskBuilder
from engine_core.structured_output.grammar_compiler import CompileTask, GrammarCompiler
from engine_core.structured_output.grammar_limits import GrammarLimits, explain
from engine_core.structured_output.mask_pipeline import MaskPipeline
from engine_core.structured_output.structured_output_request import StructuredOutputRequest
from protocol.engine_messages import GrammarError, GrammarsCompiled
from protocol.model_runner_output import ModelRunnerOutput
from protocol.scheduler_output import SchedulerOutput

DEFAULT_COMPILE_TIMEOUT_S = 10.0
DEFAULT_MASK_WAIT_S = 0.05


class DraftCutter(Protocol):
    """Keeps the first `n` of a request's proposals (the speculator's `cut`)."""

    def __call__(self, request: Request, n: int) -> None: ...


class StructuredOutputManager:
    def __init__(self, model_dir: str | None = None, vocab_size: int | None = None,
                 timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
                 limits: GrammarLimits | None = None,
                 mask_wait_s: float = DEFAULT_MASK_WAIT_S) -> None:
        self.compiler = GrammarCompiler(model_dir, vocab_size, timeout_s, limits)
        self.masks = MaskPipeline(self.compiler.num_words, self.compiler._wake)
        self.mask_wait_s = mask_wait_s
        self.builder = BitmaskBuilder(vocab_size) if vocab_size else None
        # Waiting for their grammars: (request, its compile, its deadline in monotonic time).
        self.pending: dict[str, tuple[Request, CompileTask, float]] = {}
        self.live: list[Request] = []  # with a matcher; finished ones dropped each poll
        # Per step in flight: the requests that sampled under a mask, in row order.
        self.masked: dict[int, list[tuple[Request, StructuredOutputRequest, list[int]]]] = {}

    @property
    def wakeup_fd(self) -> int:
        """Readable when a compile or a mask ended: what an idle engine loop waits on."""
        return self.compiler.wakeup_fd

    # --- grammars ---------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        params = request.sampling_params.structured_outputs
        if params is not None:
            task = self.compiler.compile(params, request.eos_token_id)
            deadline = time.monotonic() + self.compiler.timeout_s
            self.pending[request.request_id] = (request, task, deadline)

    def poll(self) -> GrammarsCompiled | None:
        """What grammar work ended since the last call, in arrival order (compiles) and in
        running order (masks); None if nothing did. Waits up to `mask_wait_s` for the masks
        of requests that sampled in the last step."""
        self.compiler.drain_wakeups()  # also those of requests aborted meanwhile
        self.compiler.lanes.check_overdue()
        ready, failed = self._poll_compiles(time.monotonic())
        late, caught_up = self._poll_masks(failed)
        if not (ready or failed or late or caught_up):
            return None
        return GrammarsCompiled(ready, failed, late, caught_up)

    def matcher_for(self, request: Request) -> StructuredOutputRequest:
        """The ready request's grammar state with its first mask (compiled now if it is not
        yet, as in a replay); raises ValueError (its error) if its grammar failed."""
        entry = self.pending.pop(request.request_id, None)
        params = request.sampling_params.structured_outputs
        task = entry[1] if entry is not None else self.compiler.compile(
            params, request.eos_token_id)
        try:
            compiled = self.compiler.compiled(task)
        finally:
            self.compiler.release(task)
        state = StructuredOutputRequest(compiled.matcher.deep_copy(), params.key, params.kind,
                                        compiled.first_row, cost=compiled.first_row.seconds)
        self.live.append(request)
        return state

    def fail(self, request: Request, error: str) -> None:
        """The request is failed with `error`: a request that was running its grammar marks
        that grammar failed for every later request with its key."""
        entry = self.pending.pop(request.request_id, None)
        if entry is not None:
            self.compiler.release(entry[1])
        state = request.structured_output
        if state is not None:
            self.masks.cancel(state)
            self.compiler.fail(state.key, error)

    def discard(self, request_id: str) -> None:
        entry = self.pending.pop(request_id, None)
        if entry is not None:
            self.compiler.release(entry[1])

    def _poll_compiles(self, now: float) -> tuple[list[str], list[GrammarError]]:
        ready: list[str] = []
        failed: list[GrammarError] = []
        for request_id, (request, task, deadline) in list(self.pending.items()):
            if request.is_finished():  # aborted while waiting: nothing to report
                self.discard(request_id)
                continue
            status = self.compiler.status(task)
            if status is None:
                if now <= deadline:
                    continue
                status = self.compiler.give_up(task)
            else:
                self.compiler.release(task)
            del self.pending[request_id]
            if status:
                failed.append(GrammarError(request_id, status))
            else:
                ready.append(request_id)
        return ready, failed

    def _poll_masks(self, failed: list[GrammarError]) -> tuple[list[str], list[str]]:
        """Requests whose next mask missed this step (`late`), those whose late mask is
        ready (`caught_up`); a mask the grammar engine failed to compute goes to `failed`."""
        self.live = live = [r for r in self.live if not r.is_finished()]
        fresh = [r.structured_output for r in live
                 if r.structured_output.job is not None and not r.mask_late]
        if fresh:
            self.masks.wait(fresh, time.monotonic() + self.mask_wait_s)
        late: list[str] = []
        caught_up: list[str] = []
        for request in live:
            state = request.structured_output
            if state.job is None and not request.mask_late:
                continue
            if not self.masks.settle(state, wait=False):
                if not request.mask_late:
                    late.append(request.request_id)
            elif state.row.error:
                failed.append(GrammarError(request.request_id, self._failure(
                    state, state.row.error)))
            elif request.mask_late:
                caught_up.append(request.request_id)
        return late, caught_up

    @staticmethod
    def _failure(state: StructuredOutputRequest, error: str) -> str:
        return f"structured_outputs.{state.kind} {explain(error, at_start=False)}"

    # --- steps ------------------------------------------------------------------------------

    def cut_drafts(self, cut: DraftCutter) -> None:
        """Before a step is scheduled: cut each constrained request's proposals before the
        first token its grammar refuses. The matchers hold exactly the known tokens here, so
        the drafts that remain are the ones the masks can verify."""
        for request in self.live:
            state, drafts = request.structured_output, request.spec_token_ids
            if drafts and not request.is_finished() and not request.mask_late:
                self.masks.settle(state, wait=True)
                valid = state.matcher.validate_tokens(drafts)
                if valid < len(drafts):
                    cut(request, valid)

    def attach_bitmask(self, so: SchedulerOutput, by_handle: dict[int, Request],
                       handle_bound: int) -> SchedulerOutput:
        """The step with masks for its constrained requests that sample (their scheduled
        tokens reach the end of what they hold); `so` itself when there are none."""
        if not self.live:
            return so
        drafts = (so.scheduled_spec_decode_tokens.as_dict()
                  if so.scheduled_spec_decode_tokens is not None else {})
        rows = []
        for handle in so.scheduled_req_ids:
            request = by_handle[handle]
            state = request.structured_output
            if state is not None and request.num_computed_tokens >= request.num_tokens:
                self.masks.settle(state, wait=True)  # ready already, unless in a replay
                rows.append((request, state, drafts.get(handle, [])))
        if not rows:
            return so
        if self.builder is None:  # the vocabulary was not known up front
            self.builder = BitmaskBuilder(self.compiler.tokenizer(None).vocab_size)
        self.masked[so.step] = rows
        return so.with_grammar_bitmask(self.builder.build(rows, handle_bound))

    def accept_tokens(self, so: SchedulerOutput, output: ModelRunnerOutput
                      ) -> list[tuple[Request, str]]:
        """Advance the matchers of the step's masked requests by their sampled tokens and
        start their next masks; the unfinished requests whose grammar refused a token (only
        when the grammar engine failed: masks allow only tokens it accepts) and why."""
        rows = self.masked.pop(so.step, None)
        refused = []
        if rows:
            sampled = dict(zip(output.req_ids, output.sampled_token_ids))
            for request, state, _ in rows:
                if not state.accept(sampled.get(request.req_id, ())):
                    if not request.is_finished():
                        refused.append((request, self._failure(
                            state, state.error() or "it refused a sampled token")))
                elif not request.is_finished():
                    self.masks.start(state)
        return refused

    def waits_for_tokens(self) -> bool:
        """A constrained request has a token in flight: its next mask needs that token, so
        the in-flight step must be collected before the next one is scheduled."""
        return any(r.num_output_placeholders and r.structured_output is not None
                   and not r.is_finished() for r in self.live)

    def shutdown(self) -> None:
        self.masks.shutdown()
        self.compiler.shutdown()
