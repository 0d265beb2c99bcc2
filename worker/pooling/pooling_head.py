"""A pooling model's end of a step: what the model runner calls with the step's hidden states
instead of sampling (its output seam), returning each request's pooled result."""
from __future__ import annotations

import torch

from protocol.model_runner_output import ModelRunnerOutput
from protocol.pooling_params import PoolingParams
from protocol.scheduler_output import SchedulerOutput
from worker.input_batch import InputBatch, StepProtocolError, as_array
from worker.pooling.pooler import Pooler, PoolerStateError
from worker.step_inputs import StepInputs


class PoolingHead:
    """Runs the pooler on the requests of a step (rank 0 only: the hidden states are the same
    on every rank, and only rank 0 answers). Nothing is sampled and no token is appended: a
    pooling request ends when its prompt has run."""

    def __init__(self, pooler: Pooler, batch: InputBatch, answers: bool,
                 selects_rows: bool = False) -> None:
        self.pooler = pooler
        self.batch = batch
        self.answers = answers
        # The model can return only the rows `rows_needed` names (every rank asks the same).
        self.selects_rows = selects_rows

    def rows_needed(self, so: SchedulerOutput, step: StepInputs) -> torch.Tensor | None:
        """The token rows the pooler reads this step, for the model to return only those
        (None: every row)."""
        if not self.selects_rows:
            return None
        rows = self.pooler.rows_needed(as_array(so.scheduled_token_counts), step.sampled,
                                       self._params(so, step))
        return None if rows is None else torch.from_numpy(rows).to(step.input_ids.device)

    def __call__(self, so: SchedulerOutput, step: StepInputs,
                 hidden: torch.Tensor) -> ModelRunnerOutput:
        self.pooler.forget(so.finished_req_ids)
        self.pooler.forget(so.preempted_req_ids)
        empty: list[list[int]] = [[] for _ in step.req_ids]
        if not self.answers:
            return ModelRunnerOutput(step.req_ids, empty, step=so.step)
        params = self._params(so, step)
        counts = as_array(so.scheduled_token_counts)
        selected = self.rows_needed(so, step) is not None
        try:
            results = self.pooler(hidden, step.req_ids, counts, step.computed,
                                  self.batch.num_prompt_tokens[step.rows], step.sampled, params,
                                  selected)
        except PoolerStateError as e:
            raise StepProtocolError(f"step {so.step}: {e}") from None
        pooled = results if any(r is not None for r in results) else None
        return ModelRunnerOutput(step.req_ids, empty, step=so.step, pooler_output=pooled)

    def _params(self, so: SchedulerOutput, step: StepInputs) -> list[PoolingParams]:
        params = [self.batch.pooling_params[row] for row in step.rows.tolist()]
        if any(p is None for p in params):
            raise StepProtocolError(f"step {so.step}: a request without pooling parameters "
                                    "reached a pooling model")
        return params
