"""The pooling routes: `POST /v1/embeddings` (OpenAI's), `/pooling` and `/classify` (vLLM's),
and what /score and /rerank share with them: preparing inputs off the event loop, running
them as one batch, encoding results.

Every input goes through the front door the generating routes use: the body and prompt-count
bounds, the prompt checks (a pooling prompt may fill max_model_len), the API key, metrics; a
pooling route to a generating model is a 400 naming the runner."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

import numpy as np
from fastapi import Request, Response

from launch.async_llm import AsyncLLM
from launch.entrypoints.openai.chat_messages import message_dicts, prompt_chars, render
from launch.entrypoints.openai.errors import APIError
from launch.entrypoints.openai.pooling_protocol import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
    _Chat,
    _PoolingFields,
)
from launch.entrypoints.openai.protocol import completion_prompts, read_body
from launch.entrypoints.openai.serving_chat import OpenAIServingChat
from launch.entrypoints.openai.serving_engine import OpenAIServing
from launch.entrypoints.openai.streaming import json_response, now, request_id, until_disconnected
from launch.errors import EngineDeadError
from launch.pooling_outputs import PoolingOutput, PoolingRequestOutput
from launch.processing.pooling import PooledInput
from launch.processing.request_stream import RequestStream
from protocol import PoolingParams

# Result floats above which a response is built and encoded off the event loop.
LARGE_RESPONSE_FLOATS = 1 << 16


class OpenAIServingPooling(OpenAIServing):
    def __init__(self, engine: AsyncLLM, served_model_names: list[str],
                 input_executor: Executor, chat: OpenAIServingChat) -> None:
        super().__init__(engine, served_model_names, input_executor)
        self.chat = chat  # renders chat-style inputs with the served chat template

    async def embeddings(self, raw: Request) -> Response:
        body = await read_body(raw, EmbeddingRequest)
        body.check_encoding()
        inputs = await self.prepare_chat(body, body.pooling_params("embed", body.dimensions))
        rid = request_id("embd")
        outputs = await self.run(raw, rid, inputs, body.priority)

        def build() -> dict[str, Any]:
            return self.listing(rid, inputs, [{"index": i, "object": "embedding",
                                               "embedding": body.encode(out.outputs.data)}
                                              for i, out in enumerate(outputs)])
        return await self.respond_pooled(outputs, build)

    async def pooling(self, raw: Request) -> Response:
        body = await read_body(raw, PoolingRequest)
        body.check_encoding()
        inputs = await self.prepare_chat(body, body.pooling_params(body.task, body.dimensions))
        rid = request_id("pool")
        outputs = await self.run(raw, rid, inputs, body.priority)

        def build() -> dict[str, Any]:
            return self.listing(rid, inputs, [{"index": i, "object": "pooling",
                                               "data": body.encode(out.outputs.data)}
                                              for i, out in enumerate(outputs)])
        return await self.respond_pooled(outputs, build)

    async def classify(self, raw: Request) -> Response:
        body = await read_body(raw, ClassificationRequest)
        try:
            prompts = completion_prompts(body.input)
        except APIError as e:
            raise APIError(400, e.message.replace("prompt", "input"), "input") from None
        inputs = await self.prepare(body, prompts, body.pooling_params("classify"),
                                    body.add_special_tokens)
        rid = request_id("classify")
        outputs = await self.run(raw, rid, inputs, body.priority)
        labels = self.engine.inputs.pooling.labels
        data = []
        for i, out in enumerate(outputs):
            probs = out.outputs.data.tolist()
            best = int(np.argmax(out.outputs.data))
            data.append({"index": i, "label": labels[best] if best < len(labels) else None,
                         "probs": probs, "num_classes": len(probs)})
        return json_response(self.listing(rid, inputs, data))

    # --- shared by the pooling and scoring routes ---------------------------------------

    async def prepare(self, body: _PoolingFields, prompts: list[Any], params: PoolingParams,
                      add_special_tokens: bool = True) -> list[PooledInput]:
        """Tokenize and check every prompt on the input thread (400 naming the field; the
        runner for a generating model)."""
        self.check_model(body.model)
        self.check_alive()

        def work() -> list[PooledInput]:
            try:
                return [self.engine.process_pooling_inputs(
                    p, params, params.task, add_special_tokens, body.truncate_prompt_tokens,
                    body.truncation_side) for p in prompts]
            except ValueError as e:
                raise APIError.bad_request(e) from None
        return await self.off_loop(work)

    async def prepare_chat(self, body: _Chat, params: PoolingParams) -> list[PooledInput]:
        """`prepare` for a body with `input` or chat `messages` (one rendered prompt)."""
        body.check_input()
        if body.messages is None:
            return await self.prepare(body, body.prompts(), params, body.add_special_tokens)
        self.check_model(body.model)
        if self.chat.template is None:
            raise APIError(400, "the model has no chat template (start the server with "
                           "--chat-template FILE)", "messages")
        messages = message_dicts(body.messages)
        chars, limit = prompt_chars(messages, None), self.engine.inputs.max_prompt_chars
        if chars > limit:  # bounded before the template runs, as the chat route does
            raise APIError(400, f"the messages hold {chars} characters, more than a prompt "
                           f"of the model's max_model_len tokens can ({limit})", "messages")
        text = await self.off_loop(lambda: render(self.chat.template, messages,
                                                  body.add_generation_prompt, None))
        return await self.prepare(body, [text], params, add_special_tokens=False)

    async def run(self, raw: Request, rid: str, inputs: list[PooledInput], priority: int = 0,
                  ) -> list[PoolingRequestOutput[PoolingOutput]]:
        """Submit every input and wait for all results (a disconnect aborts them)."""
        streams = self.submit_pooling(rid, inputs, priority)
        outputs = await until_disconnected(raw, self.collect(streams))
        failed = next((out for out in outputs if out.error is not None), None)
        if failed is not None:
            raise APIError(500, f"a request failed in the engine: {failed.error}")
        return outputs

    def submit_pooling(self, rid: str, inputs: list[PooledInput],
                       priority: int = 0) -> list[RequestStream]:
        self.check_alive()
        streams: list[RequestStream] = []
        try:
            for i, processed in enumerate(inputs):
                streams.append(self.engine.add_pooling_request(f"{rid}-{i}", processed,
                                                               priority))
        except EngineDeadError as e:
            self.abort(streams)
            raise APIError(503, f"the engine is not available: {e}") from None
        except ValueError as e:
            self.abort(streams)
            raise APIError.bad_request(e) from None
        return streams

    def listing(self, rid: str, inputs: list[PooledInput], data: list[dict[str, Any]],
                ) -> dict[str, Any]:
        tokens = sum(len(p.prompt_token_ids) for p in inputs)
        return {"id": rid, "object": "list", "created": now(), "model": self.model_name,
                "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens,
                                        "completion_tokens": 0}}

    async def respond_pooled(self, outputs: list[PoolingRequestOutput],
                             build: Callable[[], Any]) -> Response:
        """The JSON response `build()` makes, built off the event loop when large."""
        if sum(out.outputs.data.size for out in outputs) <= LARGE_RESPONSE_FLOATS:
            return json_response(build())
        return await asyncio.to_thread(lambda: json_response(build()))
