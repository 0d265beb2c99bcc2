"""`AsyncLLM`'s pooling calls (vLLM's `AsyncLLM.encode`), for an engine started with
`--runner pooling`: a request's one pooled output arrives on its stream."""
from __future__ import annotations

from collections.abc import AsyncGenerator

from launch.outputs import RequestOutputKind
from launch.pooling_outputs import PoolingRequestOutput
from launch.processing.input_processor import PromptType
from launch.processing.pooling import PooledInput
from launch.processing.pooling_state import POOLING_SAMPLING, PoolingRequestState
from launch.processing.request_stream import RequestStream
from protocol import PoolingParams


class AsyncPoolingMixin:
    """Needs `inputs`, `engine`, `output_processor`, `streams`, `start`, `_check_alive` and
    `aborted_if_left`."""

    def process_pooling_inputs(self, prompt: PromptType, params: PoolingParams | None,
                               task: str | None = None, add_special_tokens: bool = True,
                               truncate_prompt_tokens: int | None = None,
                               truncation_side: str | None = None) -> PooledInput:
        """`process_inputs` for a pooling engine: ValueError naming the field, or the runner
        for a generating one."""
        return self.inputs.process_pooling(prompt, params, task, add_special_tokens,
                                           truncate_prompt_tokens, truncation_side)

    def add_pooling_request(self, request_id: str, inputs: PooledInput,
                            priority: int = 0) -> RequestStream:
        """Submit a processed pooling request now; its one output arrives on the stream."""
        self._check_alive()
        if request_id in self.streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.start()
        state = PoolingRequestState.of(request_id, inputs)
        self.engine.add_requests([self.inputs.make_request(
            request_id, inputs.prompt_token_ids, POOLING_SAMPLING, state.times.arrival,
            priority, pooling_params=inputs.params)])
        self.output_processor.add_request(state)
        stream = self.streams[request_id] = RequestStream(state, RequestOutputKind.FINAL_ONLY)
        return stream

    async def encode(self, prompt: PromptType, pooling_params: PoolingParams | None = None,
                     request_id: str | None = None, *, priority: int = 0,
                     pooling_task: str | None = None, truncate_prompt_tokens: int | None = None,
                     ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """Yield the request's pooled output once it is ready (vLLM's `AsyncLLM.encode`)."""
        request_id = request_id if request_id is not None else f"async-{id(object())}"
        inputs = self.process_pooling_inputs(prompt, pooling_params, pooling_task,
                                             truncate_prompt_tokens=truncate_prompt_tokens)
        stream = self.add_pooling_request(request_id, inputs, priority)
        with self.aborted_if_left(request_id, stream):
            async for out in stream:
                yield out
