"""`POST /v1/completions`: OpenAI's legacy completions, whole or streamed."""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from launch.entrypoints.openai.errors import APIError
from launch.entrypoints.openai.protocol import (
    MAX_SEQUENCES,
    CompletionRequest,
    completion_prompts,
    read_body,
    sampling_params,
)
from launch.entrypoints.openai.serving_engine import OpenAIServing
from launch.entrypoints.openai.streaming import (
    SSE_DONE,
    merge,
    now,
    request_id,
    sse,
    stream_error,
    until_disconnected,
    usage,
)
from launch.entrypoints.openai.structured_outputs import constraint_of
from launch.outputs import CompletionOutput, RequestOutput, RequestOutputKind
from launch.processing.input_processor import ProcessedInput
from launch.processing.request_stream import RequestStream


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, raw: Request) -> Response:
        body = await read_body(raw, CompletionRequest)
        lora = self.check_model(body.model)
        self.check_alive()
        self.check_generates()
        if body.echo and body.logprobs is not None:
            raise APIError(400, "echo with logprobs is not supported (no prompt logprobs)",
                           "echo")
        constraint = constraint_of(body)
        params = sampling_params(body, model_defaults=self.sampling_defaults,
                                 logprobs=body.logprobs,
                                 structured_outputs=constraint and constraint.params)
        prompts = completion_prompts(body.prompt)
        if len(prompts) * params.n > MAX_SEQUENCES:
            raise APIError(400, f"at most {MAX_SEQUENCES} sequences (prompts x n) per request, "
                           f"got {len(prompts) * params.n}", "n")
        inputs = await self.off_loop(lambda: [self.process(p, params, constraint=constraint,
                                                           lora_request=lora)
                                              for p in prompts])
        self.check_budget(inputs)
        rid = request_id("cmpl")
        if body.stream:  # submitted once the response streams: a client gone before never is
            return StreamingResponse(self._stream(rid, body, inputs),
                                     media_type="text/event-stream")
        streams = self.submit(rid, inputs, RequestOutputKind.FINAL_ONLY)
        outputs = await until_disconnected(raw, self.collect(streams))
        return await self.respond(inputs, lambda: self._response(rid, body, inputs, outputs))

    def _response(self, rid: str, body: CompletionRequest, inputs: list[ProcessedInput],
                  outputs: list[RequestOutput]) -> dict[str, Any]:
        choices, generated, n = [], 0, inputs[0].params.n
        for i, out in enumerate(outputs):
            echo = self._prompt_text(inputs[i]) if body.echo else ""
            for seq in out.outputs:
                generated += len(seq.token_ids)
                choice = self._choice(i * n + seq.index, echo + seq.text, seq, body.logprobs,
                                      len(echo))
                if body.return_token_ids:
                    choice.update(token_ids=seq.token_ids,
                                  prompt_token_ids=inputs[i].prompt_token_ids)
                choices.append(choice)
        return {"id": rid, "object": "text_completion", "created": now(),
                "model": self.reported_model(inputs[0].lora_request), "choices": choices,
                "usage": usage(sum(len(p.prompt_token_ids) for p in inputs), generated)}

    async def _stream(self, rid: str, body: CompletionRequest, inputs: list[ProcessedInput]
                      ) -> AsyncIterator[bytes]:
        n, model = inputs[0].params.n, self.reported_model(inputs[0].lora_request)
        created, generated = now(), 0
        offsets = [0] * (n * len(inputs))

        def chunk(index: int, text: str, seq: CompletionOutput | None) -> bytes:
            choice = self._choice(index, text, seq, body.logprobs, offsets[index])
            offsets[index] += len(text)
            if body.return_token_ids and seq is not None:
                choice["token_ids"] = seq.token_ids
            return sse({"id": rid, "object": "text_completion", "created": created,
                        "model": model, "choices": [choice]})
        streams: list[RequestStream] = []
        try:
            streams = self.submit(rid, inputs, RequestOutputKind.DELTA)
            if body.echo:
                for i, processed in enumerate(inputs):
                    for j in range(n):
                        yield chunk(i * n + j, self._prompt_text(processed), None)
            async for i, out in merge(streams):
                for seq in out.outputs:
                    generated += len(seq.token_ids)
                    if seq.text or seq.finish_reason or (seq.token_ids and body.logprobs):
                        yield chunk(i * n + seq.index, seq.text, seq)
            if body.stream_options is not None and body.stream_options.include_usage:
                yield sse({"id": rid, "object": "text_completion", "created": created,
                           "model": model, "choices": [],
                           "usage": usage(sum(len(p.prompt_token_ids) for p in inputs),
                                          generated)})
            yield SSE_DONE
        except Exception as e:  # every refusal or failure: an error event, then [DONE]
            yield stream_error(e)
            yield SSE_DONE
        finally:
            self.abort(streams)

    def _prompt_text(self, processed: ProcessedInput) -> str:
        if processed.prompt is not None:
            return processed.prompt
        tokenizer = self.engine.tokenizer
        return "" if tokenizer is None else tokenizer.decode(processed.prompt_token_ids)

    @staticmethod
    def _choice(index: int, text: str, seq: CompletionOutput | None, logprobs: int | None,
                offset: int) -> dict[str, Any]:
        finish = None if seq is None else seq.finish_reason
        return {"index": index, "text": text,
                "logprobs": None if logprobs is None or seq is None
                else legacy_logprobs(seq, offset),
                "finish_reason": finish,
                "stop_reason": None if seq is None or finish is None else seq.stop_reason}


def legacy_logprobs(seq: CompletionOutput, offset: int) -> dict[str, list]:
    """OpenAI's legacy shape: per token its text, logprob, top alternatives and offset."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, step in zip(seq.token_ids, seq.logprobs or ()):
        sampled = step[token_id]
        text = sampled.decoded_token or ""
        tokens.append(text)
        token_logprobs.append(sampled.logprob)
        top.append({(lp.decoded_token or ""): lp.logprob for lp in step.values()})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": offsets}
