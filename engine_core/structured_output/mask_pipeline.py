"""Masks computed ahead: each constrained request's next mask starts the moment its last
token is accepted, on background threads, so a step takes the rows that are ready and never
waits for one it cannot afford.

Two lanes, each with a thread per core the engine core may use (masks are filled in
parallel): `fast`, at the step loop's priority, and `slow`, niced, for requests whose last mask
took more than SLOW_MASK_S (their work yields the cores to the steps of the others). A request's first mask comes with its compiled grammar, so
even its first step is routed by what that mask cost.
"""
from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from common.work_lanes import Job, WorkLanes
from engine_core.structured_output.mask_row import MaskRow, fill_row
from engine_core.structured_output.structured_output_request import StructuredOutputRequest

SLOW_MASK_S = 0.005  # a request whose last mask took longer computes its next in `slow`
SLOW_NICE = 10


class MaskPipeline:
    def __init__(self, num_words: Callable[[], int], wake: Callable[[Job], None]) -> None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
        threads = min(4, cores)
        self.lanes = WorkLanes({"fast": (threads, 0), "slow": (threads, SLOW_NICE)},
                               "deltaserve-masks")
        self._num_words = num_words
        self._wake = wake

    def start(self, state: StructuredOutputRequest) -> None:
        """Compute the mask after the request's accepted tokens (its previous row is stale)."""
        matcher, words = state.matcher, self._num_words()
        state.row = None
        state.job = self.lanes.submit("slow" if state.cost > SLOW_MASK_S else "fast",
                                      lambda: fill_row(matcher, words), self._wake)

    def wait(self, states: list[StructuredOutputRequest], deadline: float) -> None:
        """Wait until these requests' masks are done or time.monotonic() passes `deadline`."""
        self.lanes.wait([s.job for s in states if s.job is not None], deadline)

    def settle(self, state: StructuredOutputRequest, wait: bool) -> bool:
        """Take a finished job's row into `state.row` (waiting for it if `wait`); False if it
        is still running. Afterwards the matcher is the caller's again."""
        job = state.job
        if job is None:
            return True
        if not job.done:
            if not wait:
                return False
            self.lanes.wait([job])
        state.job = None
        if job.error is not None:  # never expected: llguidance reports errors in the matcher
            state.row = MaskRow(np.zeros(self._num_words(), np.uint32), False, True,
                                f"{type(job.error).__name__}: {job.error}", 0.0)
        else:
            state.row = job.result
            state.cost = state.row.seconds
        return True

    def cancel(self, state: StructuredOutputRequest) -> None:
        if state.job is not None:
            self.lanes.cancel(state.job)

    def shutdown(self) -> None:
        self.lanes.shutdown()
