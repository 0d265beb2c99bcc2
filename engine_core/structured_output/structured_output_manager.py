"""The engine core's side of structured outputs: grammars in, masks out, matchers advanced.

Life of a constrained request:
  `add_request`      its grammar starts compiling (or is found in the cache); the request
                     waits (RequestStatus.WAITING_FOR_GRAMMAR) in its place in the queue;
  `poll`             the engine loop turns compiles that ended into a `GrammarsCompiled`
                     message, which it journals and then applies (`matcher_for` gives a
                     ready request its matcher; a failure finishes it with "error");
  `cut_drafts`       with speculation, each step, its proposals cut where its grammar
                     refuses one;
  `attach_bitmask`   each step, a mask row per constrained request that samples (and one
                     per draft it verifies);
  `accept_tokens`    each answer advances those requests' matchers by their tokens.
A step without constrained requests does none of this work.
"""
from __future__ import annotations

import time
from typing import Protocol

from engine_core.request import Request
from engine_core.structured_output.bitmask_builder import BitmaskBuilder
from engine_core.structured_output.grammar_compiler import CompileTask, GrammarCompiler
from engine_core.structured_output.structured_output_request import StructuredOutputRequest
from protocol.engine_messages import GrammarError, GrammarsCompiled
from protocol.model_runner_output import ModelRunnerOutput
from protocol.scheduler_output import SchedulerOutput

DEFAULT_COMPILE_TIMEOUT_S = 10.0


class DraftCutter(Protocol):
    """Keeps the first `n` of a request's proposals (the speculator's `cut`)."""

    def __call__(self, request: Request, n: int) -> None: ...


class StructuredOutputManager:
    def __init__(self, model_dir: str | None = None, vocab_size: int | None = None,
                 timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S) -> None:
        self.compiler = GrammarCompiler(model_dir, vocab_size, timeout_s)
        self.builder = BitmaskBuilder(vocab_size) if vocab_size else None
        self.pending: dict[str, tuple[Request, CompileTask]] = {}  # waiting for grammars
        self.live: list[Request] = []  # with a matcher; finished ones dropped each step
        # Per step in flight: the requests that sampled under a mask, in row order.
        self.masked: dict[int, list[tuple[Request, StructuredOutputRequest, list[int]]]] = {}

    @property
    def wakeup_fd(self) -> int:
        """Readable when a compile ended: what an idle engine loop waits on."""
        return self.compiler.wakeup_fd

    # --- grammars ---------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        params = request.sampling_params.structured_outputs
        if params is not None:
            self.pending[request.request_id] = (
                request, self.compiler.compile(params, request.eos_token_id))

    def poll(self) -> GrammarsCompiled | None:
        """The waiting requests whose compiles ended (or ran out of time) since the last
        call, in arrival order; None if there are none."""
        self.compiler.drain_wakeups()  # also those of requests aborted meanwhile
        if not self.pending:
            return None
        now, ready, failed = time.monotonic(), [], []
        for request_id, (request, task) in list(self.pending.items()):
            if request.is_finished():  # aborted while waiting: nothing to report
                del self.pending[request_id]
                continue
            status = self.compiler.status(task, now)
            if status is None:
                continue
            if status:
                failed.append(GrammarError(request_id, status))
            else:
                ready.append(request_id)
            del self.pending[request_id]
        return GrammarsCompiled(ready, failed) if ready or failed else None

    def matcher_for(self, request: Request) -> StructuredOutputRequest:
        """The ready request's grammar state (compiled now if it is not yet, as in a
        replay); raises StructuredOutputsError if its grammar fails."""
        entry = self.pending.pop(request.request_id, None)
        task = entry[1] if entry is not None else self.compiler.compile(
            request.sampling_params.structured_outputs, request.eos_token_id)
        state = StructuredOutputRequest(self.compiler.matcher(task))
        self.live.append(request)
        return state

    def discard(self, request_id: str) -> None:
        self.pending.pop(request_id, None)

    # --- steps ------------------------------------------------------------------------------

    def cut_drafts(self, cut: DraftCutter) -> None:
        """Before a step is scheduled: cut each constrained request's proposals before the
        first token its grammar refuses. The matchers hold exactly the known tokens here, so
        the drafts that remain are the ones the masks can verify."""
        for request in self.live:
            state, drafts = request.structured_output, request.spec_token_ids
            if drafts and not request.is_finished():
                valid = state.matcher.validate_tokens(drafts)
                if valid < len(drafts):
                    cut(request, valid)

    def attach_bitmask(self, so: SchedulerOutput, by_handle: dict[int, Request],
                       handle_bound: int) -> SchedulerOutput:
        """The step with masks for its constrained requests that sample (their scheduled
        tokens reach the end of what they hold); `so` itself when there are none."""
        if not self.live:
            return so
        self.live = [r for r in self.live if not r.is_finished()]
        drafts = (so.scheduled_spec_decode_tokens.as_dict()
                  if so.scheduled_spec_decode_tokens is not None else {})
        rows = []
        for handle in so.scheduled_req_ids:
            request = by_handle[handle]
            state = request.structured_output
            if state is not None and request.num_computed_tokens >= request.num_tokens:
                rows.append((request, state, drafts.get(handle, [])))
        if not rows:
            return so
        if self.builder is None:  # the vocabulary was not known up front
            self.builder = BitmaskBuilder(self.compiler.tokenizer(None).vocab_size)
        self.masked[so.step] = rows
        return so.with_grammar_bitmask(self.builder.build(rows, handle_bound))

    def accept_tokens(self, so: SchedulerOutput, output: ModelRunnerOutput) -> list[Request]:
        """Advance the matchers of the step's masked requests by their sampled tokens; the
        unfinished requests whose grammar refused a token (never, when masks were applied)."""
        rows = self.masked.pop(so.step, None)
        refused = []
        if rows:
            sampled = dict(zip(output.req_ids, output.sampled_token_ids))
            for request, state, _ in rows:
                if not state.accept(sampled.get(request.req_id, ())) and \
                        not request.is_finished():
                    refused.append(request)
        return refused

    def waits_for_tokens(self) -> bool:
        """A constrained request has a token in flight: its next mask needs that token, so
        the in-flight step must be collected before the next one is scheduled."""
        return any(r.num_output_placeholders and r.structured_output is not None
                   and not r.is_finished() for r in self.live)

    def shutdown(self) -> None:
        self.compiler.shutdown()
