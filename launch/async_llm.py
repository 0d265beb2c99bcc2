"""The online API: `AsyncLLM`, the engine for many concurrent asyncio callers (the server).

    engine = AsyncLLM(model="launch/model_cache/default_model", max_num_seqs=64)
    async for out in engine.generate("def f(", SamplingParams(max_tokens=32), "req-1"):
        print(out.outputs[0].text)    # cumulative by default; output_kind=DELTA: new text only

Requests join the engine's running batch whenever they arrive. One asyncio task, the output
handler, reads the engine core's output socket and routes each output to its request's
`RequestStream` (launch/output_handler.py); it also notices the engine's death and then
fails every stream with `EngineDeadError` (and every later call raises it at once). Pooling
calls: launch/async_pooling.py.
"""
from __future__ import annotations

import asyncio
import atexit
import contextlib
import time
import weakref
from collections.abc import AsyncGenerator, Iterator
from typing import Any

from launch.async_pooling import AsyncPoolingMixin
from launch.client.startup import start_engine
from launch.errors import EngineDeadError
from launch.lora.registry import LoRARegistry
from launch.metrics.stats import IterationStats, StatLogger
from launch.output_handler import OutputHandlerMixin
from launch.outputs import RequestOutput, RequestOutputKind
from launch.processing.input_processor import ProcessedInput, PromptType
from launch.processing.output_processor import OutputProcessor
from launch.processing.request_state import RequestState
from launch.processing.request_stream import RequestStream
from protocol import SamplingParams
from protocol.lora import LoRARequest


class AsyncLLM(AsyncPoolingMixin, OutputHandlerMixin):
    """Starts the engine (the engine options of `EngineConfig` as keyword arguments) and
    serves `generate` calls from any number of asyncio tasks of one event loop."""

    def __init__(self, model: str, stat_loggers: list[StatLogger] | None = None,
                 **engine_args: Any) -> None:
        self.engine, self.inputs = start_engine(model, engine_args)
        self.config = self.engine.config
        self.tokenizer = self.inputs.tokenizer
        self.max_model_len = self.inputs.ready.max_model_len
        self.stat_loggers = list(stat_loggers or [])
        self.output_processor = OutputProcessor(self.tokenizer)
        self.streams: dict[str, RequestStream] = {}  # request id -> stream, until finished
        self._handler: asyncio.Task | None = None
        self.dead: EngineDeadError | None = None
        self.lora = LoRARegistry(self.config, self.engine.send_lora)
        self._finalizer = weakref.finalize(self, self.engine.shutdown)
        atexit.register(self._finalizer)

    @classmethod
    def from_engine_args(cls, model: str, engine_args: dict[str, Any],
                         **kwargs: Any) -> AsyncLLM:
        return cls(model, **kwargs, **engine_args)

    @property
    def errored(self) -> bool:
        return self.dead is not None

    # --- requests -------------------------------------------------------------------------

    def process_inputs(self, prompt: PromptType, params: SamplingParams | None,
                       add_special_tokens: bool = True, check_constraint: bool = True,
                       lora_request: LoRARequest | None = None) -> ProcessedInput:
        """Tokenize and validate; ValueError naming the field for anything the engine would
        refuse (the checks and messages of `LLM.generate`). A rendered chat prompt already
        holds its special tokens: `add_special_tokens=False`. With `check_constraint=False`
        a constraint not checked before is left `unchecked`, for `check_constraint`.
        `lora_request`: a registered adapter (`add_lora`)."""
        text, ids = self.inputs.tokenize(prompt, add_special_tokens)
        resolved = self.inputs.resolve(
            ids, params or SamplingParams(**self.inputs.sampling_defaults), check_constraint)
        constraint = resolved.structured_outputs
        unchecked = (constraint if not check_constraint and constraint is not None
                     and not self.inputs.constraint_known(constraint) else None)
        return ProcessedInput(text, ids, resolved, unchecked, lora_request=lora_request)

    async def check_constraint(self, inputs: ProcessedInput) -> None:
        """Check an `unchecked` constraint without blocking the event loop (the grammar
        engine works on its own threads): StructuredOutputsError if it is refused,
        GrammarBusyError if it could not be checked in time."""
        constraint = inputs.unchecked
        if constraint is None:
            return
        if self.inputs.grammars is None:
            await asyncio.to_thread(self.inputs.check_constraint, constraint)
        else:
            await self.inputs.grammars.check_async(constraint)

    # --- LoRA adapters --------------------------------------------------------------------

    async def add_lora(self, lora_request: LoRARequest, replace: bool = False) -> LoRARequest:
        """Check an adapter (its files read off the event loop) and have the engine load it;
        the registered LoRARequest (with its digest). LoRAAdapterError (a ValueError) names
        why one cannot be served."""
        checked = await asyncio.to_thread(self.lora.check, lora_request)
        self._check_alive()
        return self.lora.commit(checked, replace)

    def remove_lora(self, name: str) -> LoRARequest:
        """Unregister an adapter (KeyError if unknown); running requests finish with it."""
        self._check_alive()
        return self.lora.remove(name)

    def list_loras(self) -> list[LoRARequest]:
        return self.lora.adapters()

    def add_request(self, request_id: str, inputs: ProcessedInput, priority: int = 0,
                    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
                    ) -> RequestStream:
        """Submit a processed request now; its outputs arrive on the returned stream."""
        self._check_alive()
        if request_id in self.streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.start()
        state = RequestState.create(request_id, inputs.prompt, inputs.prompt_token_ids,
                                    inputs.params, self.tokenizer,
                                    lora_request=inputs.lora_request)
        requests = [self.inputs.make_request(child_id, inputs.prompt_token_ids, seq.params,
                                             state.times.arrival, priority, inputs.lora_request)
                    for child_id, seq in zip(state.child_ids, state.sequences)]
        self.engine.add_requests(requests)
        self.output_processor.add_request(state)
        stream = self.streams[request_id] = RequestStream(state, output_kind)
        return stream

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, priority: int = 0,
                       output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
                       lora_request: LoRARequest | None = None,
                       ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's outputs as tokens arrive; the last has `finished` set. A
        consumer that stops early (or is cancelled) aborts the request in the engine.
        `lora_request`: its adapter, registered first if it is new."""
        request_id = request_id if request_id is not None else f"async-{id(object())}"
        if lora_request is not None:
            known = self.lora.get(lora_request.lora_name)
            lora_request = known if known is not None and known.lora_int_id == \
                lora_request.lora_int_id else await self.add_lora(lora_request)
        inputs = self.process_inputs(prompt, sampling_params, check_constraint=False,
                                     lora_request=lora_request)
        await self.check_constraint(inputs)
        stream = self.add_request(request_id, inputs, priority, output_kind)
        with self.aborted_if_left(request_id, stream):
            async for out in stream:
                yield out

    @contextlib.contextmanager
    def aborted_if_left(self, request_id: str, stream: RequestStream) -> Iterator[None]:
        """Around a caller's reading of `stream`: the request is aborted if the reading ends
        (the caller left, or an error) before its last output."""
        try:
            yield
        finally:
            if not stream.finished:
                self.abort_request(request_id)

    async def abort(self, request_id: str) -> None:
        """End the request: its stream gets a last output with finish_reason "abort"."""
        self.abort_request(request_id)

    def abort_request(self, request_id: str) -> None:
        """`abort`, callable outside a coroutine; unknown or finished ids are ignored."""
        stream = self.streams.pop(request_id, None)
        if stream is None:
            return
        stats = IterationStats(time.time(),
                               engine=self.engine.engine_of(stream.state.child_ids[0]))
        children = self.output_processor.abort_request(request_id, stats)
        stream.notify()
        for stat_logger in self.stat_loggers:
            stat_logger.record(stats)
        if self.dead is None:
            try:
                self.engine.abort_requests(children)
            except EngineDeadError:
                pass  # the output handler reports it to everyone

    # --- death and shutdown ---------------------------------------------------------------

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise self.dead

    def shutdown(self) -> None:
        """Fail pending streams, stop the output handler and every engine process."""
        self.fail_all(EngineDeadError("the engine was shut down", "front-end"))
        if self._handler is not None and not self._handler.done():
            self._handler.cancel()
        self._finalizer()
