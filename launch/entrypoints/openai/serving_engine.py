"""What the completion and chat routes share: the engine, model names, preparing and bounding a
request's prompts, submitting them, collecting their outputs (streaming.py has what
responses are made of: merged streams, disconnects, server-sent events).

Work that grows with a request's size runs off the event loop, so one large request never
stalls the other streams: tokenizing and chat-template rendering on one input thread (in
arrival order), checking a constraint the grammar engine has not seen in its own bounded pool
with a deadline (`GrammarValidator`: a constrained request never holds up the input thread,
so a plain request never waits for grammar work), building and encoding a large response on
the loop's default executor. What a request may cost is bounded before any of it starts
(`check_budget`)."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

from fastapi import Response

from engine_core.structured_output.grammar_validator import GrammarBusyError
from launch.async_llm import AsyncLLM
from launch.entrypoints.openai.errors import APIError
from launch.entrypoints.openai.streaming import json_response
from launch.entrypoints.openai.structured_outputs import Constraint
from launch.errors import EngineDeadError
from launch.outputs import RequestOutput, RequestOutputKind
from launch.processing.input_processor import ProcessedInput
from launch.processing.pooling import POOLING_ONLY
from launch.processing.request_stream import RequestStream
from protocol import StructuredOutputsError
from protocol.lora import LoRARequest

logger = logging.getLogger("deltaserve")
T = TypeVar("T")
# Per request (all prompts x n): the most output tokens it may ask for, and the most logprob
# entries (tokens x (1 + logprobs)) its response may carry (~28 bytes of JSON each).
MAX_RESPONSE_TOKENS = 1 << 22
MAX_LOGPROB_ENTRIES = 1 << 20
# A response expected to carry more entries than this is built off the event loop.
LARGE_RESPONSE_ENTRIES = 1 << 14
MAX_LISTED_ADAPTERS = 16  # adapter names a 404 lists


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, served_model_names: list[str],
                 input_executor: Executor) -> None:
        self.engine = engine
        self.model_names = served_model_names
        self.model_name = served_model_names[0]  # the name responses report
        self.input_executor = input_executor  # one thread: tokenizing and templates
        # what a body leaves unset gets (the model's generation_config.json)
        self.sampling_defaults = engine.inputs.sampling_defaults

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter `model` names, None for the base model (or no name); 404 in
        OpenAI's model-not-found shape for any other name."""
        if model is None or model in self.model_names:
            return None
        lora = self.engine.lora.get(model)
        if lora is not None:
            return lora
        adapters = [a.lora_name for a in self.engine.lora.adapters()[:MAX_LISTED_ADAPTERS]]
        raise APIError(404, f"the model {model!r} does not exist; this server serves "
                       f"{' or '.join(map(repr, self.model_names + adapters))}", "model",
                       "model_not_found")

    def reported_model(self, lora: LoRARequest | None) -> str:
        """The `model` a response names: the adapter's name, else the served model's."""
        return self.model_name if lora is None else lora.lora_name

    def check_generates(self) -> None:
        """400 naming the runner when the engine is a pooling model (it generates no text)."""
        if self.engine.inputs.pooling is not None:
            raise APIError(400, POOLING_ONLY)

    def check_alive(self) -> None:
        if self.engine.dead is not None:
            raise APIError(503, f"the engine is not available: {self.engine.dead}")

    def process(self, prompt: Any, params: Any, add_special_tokens: bool = True,
                constraint: Constraint | None = None,
                lora_request: LoRARequest | None = None) -> ProcessedInput:
        """Tokenize and validate (`constraint` says which body field the constraint came
        from, for the 400's wording). A constraint the grammar engine has not checked before
        is left `unchecked`: `off_loop` checks it, off the input thread. `lora_request`: the
        adapter `check_model` found."""
        def describe(e: StructuredOutputsError) -> APIError:
            return constraint.describe(e) if constraint else APIError.bad_request(e)
        try:
            processed = self.engine.process_inputs(prompt, params, add_special_tokens,
                                                   check_constraint=False,
                                                   lora_request=lora_request)
        except StructuredOutputsError as e:
            raise describe(e) from None
        except ValueError as e:
            raise APIError.bad_request(e) from None
        return dataclasses.replace(processed, describe=describe) if processed.unchecked \
            else processed

    async def check_constraints(self, constraints: list[Constraint]) -> None:
        """Ask the grammar engine about constraints that are only part of what the engine
        enforces (a schema beside tools, an answer after reasoning), each on its own: a 400
        naming its body field, a 503 when it could not be checked in time. The checks run in
        the grammar validator's lanes, never on the event loop or the input thread."""
        inputs = self.engine.inputs

        async def check(constraint: Constraint) -> None:
            try:
                if inputs.grammars is None:
                    await asyncio.to_thread(inputs.check_constraint, constraint.params)
                else:
                    await inputs.grammars.check_async(constraint.params)
            except StructuredOutputsError as e:
                raise constraint.describe(e) from None
            except GrammarBusyError as e:
                raise APIError(503, str(e), constraint.param) from None
        for constraint in constraints:  # in body order: the first refusal is the answer
            await check(constraint)

    async def off_loop(self, work: Callable[[], T]) -> T:
        """`work()` on the input thread (tokenizing, rendering: proportional to the input);
        then, if it made ProcessedInputs (one or a list) with unchecked constraints, their
        checks in the grammar engine's pool: a 400 for a refusal, a 503 when the server could
        not check one in time."""
        result = await asyncio.get_running_loop().run_in_executor(self.input_executor, work)
        inputs = result if isinstance(result, list) else [result]
        await self.check_unchecked([p for p in inputs if isinstance(p, ProcessedInput)])
        return result

    async def check_unchecked(self, inputs: list[ProcessedInput]) -> None:
        """Check each distinct unchecked constraint of `inputs` (concurrently)."""
        pending: dict[tuple, ProcessedInput] = {}
        for processed in inputs:
            if processed.unchecked is not None:
                pending.setdefault(processed.unchecked.key, processed)

        async def check(processed: ProcessedInput) -> None:
            try:
                await self.engine.check_constraint(processed)
            except StructuredOutputsError as e:
                raise (processed.describe(e) if processed.describe
                       else APIError.bad_request(e)) from None
            except GrammarBusyError as e:
                raise APIError(503, str(e), _constraint_param(processed)) from None
        await asyncio.gather(*(check(p) for p in pending.values()))

    def check_budget(self, inputs: list[ProcessedInput]) -> None:
        """400 for a request whose output could not fit the model or whose response would be
        larger than the server builds (vLLM's rule for max_tokens)."""
        limit = self.engine.max_model_len
        tokens = entries = 0
        for p in inputs:
            prompt_len, wanted = len(p.prompt_token_ids), p.params.max_tokens
            if prompt_len + wanted > limit:
                raise APIError(400, f"max_tokens is too large: {wanted}. This model's maximum "
                               f"context length is {limit} tokens and your request has "
                               f"{prompt_len} input tokens ({wanted} > {limit} - "
                               f"{prompt_len})", "max_tokens")
            tokens += wanted * p.params.n
            entries += wanted * p.params.n * (1 + (p.params.logprobs or 0)
                                              if p.params.logprobs is not None else 0)
        if tokens > MAX_RESPONSE_TOKENS:
            raise APIError(400, f"the request asks for up to {tokens} output tokens (prompts x "
                           f"n x max_tokens); this server answers at most "
                           f"{MAX_RESPONSE_TOKENS}", "max_tokens")
        if entries > MAX_LOGPROB_ENTRIES:
            raise APIError(400, f"the request asks for up to {entries} logprob entries "
                           f"(prompts x n x max_tokens x (1 + logprobs)); this server answers "
                           f"at most {MAX_LOGPROB_ENTRIES}", "logprobs")

    async def respond(self, inputs: list[ProcessedInput], build: Callable[[], Any]
                      ) -> Response:
        """The JSON response `build()` makes; built and encoded off the event loop when it
        may be large."""
        def run() -> Response:
            return json_response(build())
        if _expected_entries(inputs) <= LARGE_RESPONSE_ENTRIES:
            return run()
        return await asyncio.to_thread(run)

    def submit(self, request_id: str, inputs: list[ProcessedInput],
               kind: RequestOutputKind) -> list[RequestStream]:
        """Submit every (already validated) prompt; on failure abort the ones submitted."""
        self.check_alive()
        streams: list[RequestStream] = []
        try:
            for i, processed in enumerate(inputs):
                streams.append(self.engine.add_request(f"{request_id}-{i}", processed,
                                                       output_kind=kind))
        except EngineDeadError as e:
            self.abort(streams)
            raise APIError(503, f"the engine is not available: {e}") from None
        return streams

    def abort(self, streams: list[RequestStream]) -> None:
        for stream in streams:
            if not stream.finished:
                self.engine.abort_request(stream.request_id)

    async def collect(self, streams: list[RequestStream]) -> list[RequestOutput]:
        """The final output of each stream (FINAL_ONLY streams yield just that)."""
        async def last(stream: RequestStream) -> RequestOutput:
            out = None
            async for out in stream:
                pass
            assert out is not None
            return out
        try:
            return list(await asyncio.gather(*(last(s) for s in streams)))
        except EngineDeadError as e:
            raise APIError(503, f"the engine is not available: {e}") from None
        finally:
            self.abort(streams)  # cancelled (a disconnect) or failed: free the engine's work


def _constraint_param(processed: ProcessedInput) -> str | None:
    """The body field a 503 about a constraint names (as its 400 would)."""
    if processed.describe is None or processed.unchecked is None:
        return None
    refusal = processed.describe(StructuredOutputsError(processed.unchecked.kind, ""))
    return getattr(refusal, "param", None)


def _expected_entries(inputs: list[ProcessedInput]) -> int:
    return sum(p.params.max_tokens * p.params.n * (2 + (p.params.logprobs or 0))
               for p in inputs)
