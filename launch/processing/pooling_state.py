"""One pooling request in the front-end: the `RequestState` the output processor routes its
single, final engine output to, which it turns into a `PoolingRequestOutput`."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from launch.outputs import CompletionOutput, RequestOutputKind
from launch.pooling_outputs import PoolingOutput, PoolingRequestOutput
from launch.processing.pooling import PooledInput
from launch.processing.request_state import RequestState, RequestTimes, _Sequence
from protocol import EngineCoreOutput, SamplingParams

# What a pooling request carries where a generation request has its sampling parameters
# (the engine reads none of them).
POOLING_SAMPLING = SamplingParams(max_tokens=1)


@dataclass
class PoolingRequestState(RequestState):
    """One engine request (no `n`), no detokenizer; its result is the pooler's output."""

    pooled: np.ndarray | None = None
    per_token: bool = False

    @classmethod
    def of(cls, request_id: str, inputs: PooledInput,
           arrival: float | None = None) -> PoolingRequestState:
        state = cls(request_id, inputs.prompt, inputs.prompt_token_ids,
                    times=RequestTimes(time.time() if arrival is None else arrival),
                    per_token=inputs.params.per_token)
        state.sequences.append(_Sequence(CompletionOutput(0, "", []), POOLING_SAMPLING, None))
        state.child_ids.append(request_id)
        return state

    def update(self, index: int, out: EngineCoreOutput, tokenizer: object) -> bool:
        result = self.sequences[0].output
        if result.finished():
            return False
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if out.pooling_output is not None:
            data = np.frombuffer(out.pooling_output, "<f4").astype(np.float32)
            if self.per_token:
                data = data.reshape(len(self.prompt_token_ids), -1)
            self.pooled = data
        if out.finish_reason is not None:
            result.finish_reason = out.finish_reason
            result.stop_reason = out.error if out.error is not None else out.stop_reason
        return False

    def output(self, kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
               ) -> PoolingRequestOutput[PoolingOutput]:
        result = self.sequences[0].output
        error = None
        if self.finished and self.pooled is None:
            error = (result.stop_reason if isinstance(result.stop_reason, str)
                     else f"the request ended without a result ({result.finish_reason})")
        data = self.pooled if self.pooled is not None else np.zeros(0, np.float32)
        return PoolingRequestOutput(self.request_id, PoolingOutput(data),
                                    self.prompt_token_ids, self.finished,
                                    self.num_cached_tokens, self.prompt, error)
