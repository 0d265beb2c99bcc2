"""Taking a step's results, a part of `Scheduler`: sampled tokens appended, stop conditions
checked, pooling results and finished requests reported, and the request table following."""
from __future__ import annotations

import numpy as np

from engine_core.request import FINISH_REASONS, Request, RequestStatus
from engine_core.sched.request_queue import FCFSRequestQueue, PriorityRequestQueue
from engine_core.sched.request_table import RequestTable, answer_rows
from engine_core.sched.stop_check import append_tokens, check_stop
from engine_core.spec_decode.speculator import NoSpeculation, Speculator
from protocol.engine_messages import EngineCoreOutput
from protocol.model_runner_output import ModelRunnerOutput
from protocol.scheduler_output import SchedulerOutput


class OutputUpdate:
    """`update_from_output` (a `Scheduler` mixin: the state is the scheduler's)."""

    running: list[Request]
    waiting: FCFSRequestQueue | PriorityRequestQueue
    table: RequestTable
    requests_by_handle: dict[int, Request]
    speculator: Speculator | NoSpeculation
    max_seq_len: int
    _handles_of_running: np.ndarray | None

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, stop finished requests and report what changed."""
        outputs: list[EngineCoreOutput] = []
        logprobs = model_runner_output.logprobs
        by_handle = self.requests_by_handle
        irregular: list[int] = []  # entries that did not append exactly one token
        stopped: list[tuple[Request, bool]] = []  # (request, was waiting), in output order
        for i, (req_id, token_ids) in enumerate(zip(model_runner_output.req_ids,
                                                    model_runner_output.sampled_token_ids)):
            request = by_handle.get(req_id)
            if request is None or len(token_ids) != 1:
                irregular.append(i)
                if request is None or not token_ids:
                    continue  # aborted meanwhile, or a prefill chunk short of the prompt's end
            # A request preempted after this step was scheduled still takes its token: the
            # workers appended it too. One token (the hot path) is `append_tokens` inlined.
            if len(token_ids) == 1:
                token = token_ids[0]
                request.output_token_ids.append(token)
                request.all_token_ids.append(token)
                if request.num_output_placeholders:  # 0 if preempted since: the count restarted
                    request.num_output_placeholders -= 1
                reason = None
                if token in request.stop_tokens or len(request.all_token_ids) >= request.length_end:
                    reason = self._check_stop(request, token, stopped)
            else:
                token_ids, reason = self._append_tokens(request, token_ids, stopped)
            outputs.append(EngineCoreOutput(request.request_id, token_ids, reason,
                                            request.stop_reason,
                                            logprobs[i][:len(token_ids)]
                                            if logprobs and logprobs[i] else None,
                                            request.num_cached_tokens,
                                            scheduled_time=request.scheduled_time
                                            if request.num_output_tokens == len(token_ids) else None))
        self.table.record_sampled(answer_rows(scheduler_output, model_runner_output, irregular))
        if model_runner_output.pooler_output:
            outputs += self._finish_pooled(model_runner_output, stopped)
        if stopped:
            self._finish_stopped(stopped)
        self.speculator.update(scheduler_output, model_runner_output)
        return outputs

    def _check_stop(self, request: Request, token_id: int,
                    stopped: list[tuple[Request, bool]]) -> str | None:
        """After appending `token_id`: if it ends the request, list it in `stopped` (with
        whether it was waiting) and return the finish reason."""
        was_waiting = request.status == RequestStatus.PREEMPTED
        if not check_stop(request, token_id, self.max_seq_len):
            return None
        stopped.append((request, was_waiting))
        return FINISH_REASONS[request.status]

    def _append_tokens(self, request: Request, token_ids: list[int],
                       stopped: list[tuple[Request, bool]]) -> tuple[list[int], str | None]:
        """`append_tokens` (several tokens: the general path), with the table following."""
        was_waiting = request.status == RequestStatus.PREEMPTED
        token_ids = append_tokens(request, token_ids, self.max_seq_len)
        self.table.num_tokens[request.req_id] = request.num_tokens
        self.table.placeholders[request.req_id] = request.num_output_placeholders
        if not request.is_finished():
            return token_ids, None
        stopped.append((request, was_waiting))
        return token_ids, FINISH_REASONS[request.status]

    def _finish_pooled(self, model_runner_output: ModelRunnerOutput,
                       stopped: list[tuple[Request, bool]]) -> list[EngineCoreOutput]:
        """Pooling requests whose prompt has run: each finishes ("stop") with its result."""
        outputs = []
        for req_id, data in zip(model_runner_output.req_ids, model_runner_output.pooler_output):
            request = self.requests_by_handle.get(req_id)
            if data is None or request is None or request.pooling_params is None:
                continue
            request.status = RequestStatus.FINISHED_STOPPED
            stopped.append((request, False))
            outputs.append(EngineCoreOutput(request.request_id, [], "stop",
                                            num_cached_tokens=request.num_cached_tokens,
                                            scheduled_time=request.scheduled_time,
                                            pooling_output=data))
        return outputs

    def _finish_stopped(self, stopped: list[tuple[Request, bool]]) -> None:
        for request, was_waiting in stopped:
            if was_waiting:
                self.waiting.remove(request)
            self._free_request(request)
        self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
        self._handles_of_running = None
