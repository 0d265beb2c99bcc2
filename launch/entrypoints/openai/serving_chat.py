"""`POST /v1/chat/completions`: messages (and tools) rendered with the chat template; the
answer split into reasoning, content and tool calls, whole or streamed. `prepare`, `answer`
and `answer_deltas` are what the Responses and Anthropic Messages routes run too."""
from __future__ import annotations

from collections.abc import AsyncIterator
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from launch.async_llm import AsyncLLM
from launch.entrypoints.openai.chat_answer import (
    AnswerDelta,
    ChatAnswerParser,
    ChatParsers,
    finish_reason,
)
from launch.entrypoints.openai.chat_messages import message_dicts, render
from launch.entrypoints.openai.chat_request import plan_chat
from launch.entrypoints.openai.errors import APIError
from launch.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
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
from launch.entrypoints.openai.structured_outputs import Constraint
from launch.entrypoints.openai.tool_parsers import ToolCallDelta
from launch.outputs import CompletionOutput, RequestOutput, RequestOutputKind
from launch.processing.chat_template import ChatTemplate
from launch.processing.input_processor import ProcessedInput
from launch.processing.request_stream import RequestStream


@dataclass(frozen=True, slots=True)
class ChatRun:
    """A chat request validated and tokenized, ready to submit."""

    body: ChatCompletionRequest
    inputs: ProcessedInput
    answers: ChatAnswerParser
    model: str  # what the response names: the served model, or the LoRA adapter asked for


class OpenAIServingChat(OpenAIServing):
    def __init__(self, engine: AsyncLLM, served_model_names: list[str],
                 input_executor: Executor, template: ChatTemplate | None,
                 parsers: ChatParsers = ChatParsers()) -> None:
        super().__init__(engine, served_model_names, input_executor)
        self.template = template
        self.parsers = parsers

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> str:
        """The prompt text of `messages` (for /tokenize)."""
        if self.template is None:
            raise APIError(400, "the model has no chat template", "messages")
        return render(self.template, message_dicts(messages), add_generation_prompt, None)

    async def prepare(self, body: ChatCompletionRequest) -> ChatRun:
        """Validate, render and tokenize a chat request (on the input thread), and bound
        what it may cost: the same for every chat-like route."""
        lora = self.check_model(body.model)
        self.check_alive()
        self.check_generates()
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        max_tokens = (body.max_completion_tokens if body.max_completion_tokens is not None
                      else body.max_tokens)

        answers: list[ChatAnswerParser] = []
        partial: list[Constraint] = []  # checked after the input thread, in the validator

        def prepare() -> ProcessedInput:  # on the input thread: template, tokenizer
            plan = plan_chat(body, self.template, self.parsers,
                             self.engine.inputs.max_prompt_chars, partial.append)
            params = sampling_params(
                body, {"max_tokens": max_tokens}, model_defaults=self.sampling_defaults,
                logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                structured_outputs=plan.constraint and plan.constraint.params)
            answers.append(plan.answers)
            return self.process(plan.prompt, params, add_special_tokens=False,
                                constraint=plan.constraint, lora_request=lora)
        inputs = await self.off_loop(prepare)  # returns the ProcessedInput, as off_loop expects
        await self.check_constraints(partial)
        self.check_budget([inputs])
        return ChatRun(body, inputs, answers[0], self.reported_model(lora))

    async def answer(self, raw: Request, run: ChatRun, rid: str) -> RequestOutput:
        """The whole output (`run.answers` splits each sequence's text)."""
        streams = self.submit(rid, [run.inputs], RequestOutputKind.FINAL_ONLY)
        (out,) = await until_disconnected(raw, self.collect(streams))
        return out

    async def answer_deltas(self, run: ChatRun, rid: str
                            ) -> AsyncIterator[tuple[RequestOutput, CompletionOutput,
                                                     AnswerDelta]]:
        """Each sequence's new output and its parsed parts, as they come (submitted on the
        first step; aborted when the consumer stops early)."""
        streams: list[RequestStream] = []
        parts = [run.answers.stream() for _ in range(run.inputs.params.n)]
        try:
            streams = self.submit(rid, [run.inputs], RequestOutputKind.DELTA)
            async for _, out in merge(streams):
                for seq in out.outputs:
                    delta = parts[seq.index].feed(seq.text)
                    if seq.finish_reason is not None:
                        delta.parts += parts[seq.index].finish().parts
                    yield out, seq, delta
        finally:
            self.abort(streams)

    async def create(self, raw: Request) -> Response:
        body = await read_body(raw, ChatCompletionRequest)
        run = await self.prepare(body)
        rid = request_id("chatcmpl")
        if body.stream:  # submitted once the response streams: a client gone before never is
            return StreamingResponse(self._stream(rid, run), media_type="text/event-stream")
        out = await self.answer(raw, run, rid)
        return await self.respond([run.inputs], lambda: self._response(rid, run, out))

    def _response(self, rid: str, run: ChatRun, out: RequestOutput) -> dict[str, Any]:
        body, choices = run.body, []
        for seq in out.outputs:
            answer = run.answers.parse(seq.text)
            choices.append({
                "index": seq.index, "message": answer.message(),
                "logprobs": chat_logprobs(seq, body.top_logprobs or 0) if body.logprobs else None,
                "finish_reason": finish_reason(seq.finish_reason, bool(answer.tool_calls)),
                "stop_reason": seq.stop_reason,
                **({"token_ids": seq.token_ids} if body.return_token_ids else {})})
        return {"id": rid, "object": "chat.completion", "created": now(),
                "model": run.model, "choices": choices,
                **({"prompt_token_ids": out.prompt_token_ids} if body.return_token_ids else {}),
                "usage": usage(len(out.prompt_token_ids),
                               sum(len(s.token_ids) for s in out.outputs))}

    async def _stream(self, rid: str, run: ChatRun) -> AsyncIterator[bytes]:
        body, created, generated = run.body, now(), 0
        called = [False] * run.inputs.params.n  # whether a sequence has streamed a tool call

        def chunk(index: int, delta: dict[str, Any], seq: CompletionOutput | None) -> bytes:
            finish = None if seq is None else finish_reason(seq.finish_reason, called[index])
            logprobs = (chat_logprobs(seq, body.top_logprobs or 0)
                        if body.logprobs and seq is not None else None)
            return sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                        "model": run.model,
                        "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                     "finish_reason": finish,
                                     "stop_reason": None if seq is None or finish is None
                                     else seq.stop_reason}]})
        try:
            for index in range(run.inputs.params.n):
                yield chunk(index, {"role": "assistant", "content": ""}, None)
            async for _, seq, answer in self.answer_deltas(run, rid):
                generated += len(seq.token_ids)
                delta = delta_fields(answer)
                called[seq.index] = called[seq.index] or "tool_calls" in delta
                if delta or seq.finish_reason or (seq.token_ids and body.logprobs):
                    yield chunk(seq.index, delta, seq)
            if body.stream_options is not None and body.stream_options.include_usage:
                yield sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                           "model": run.model, "choices": [],
                           "usage": usage(len(run.inputs.prompt_token_ids), generated)})
            yield SSE_DONE
        except Exception as e:  # every refusal or failure: an error event, then [DONE]
            yield stream_error(e)
            yield SSE_DONE


def delta_fields(delta: AnswerDelta) -> dict[str, Any]:
    """The OpenAI delta fields of an answer's new parts: reasoning under both its names
    (see `ChatAnswer.message`), content, and per call at most one entry per chunk (the
    first carrying index, id, type, name and the first arguments; later ones index and
    arguments only)."""
    fields: dict[str, Any] = {}
    if reasoning := delta.reasoning:
        fields["reasoning"] = fields["reasoning_content"] = reasoning
    if content := delta.content:
        fields["content"] = content
    if calls := delta.tool_calls:
        fields["tool_calls"] = [call.to_openai() for call in merge_call_deltas(calls)]
    return fields


def merge_call_deltas(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Consecutive deltas of one call as one (a call's deltas are consecutive)."""
    merged: list[ToolCallDelta] = []
    for d in deltas:
        if merged and merged[-1].index == d.index:
            last = merged[-1]
            merged[-1] = ToolCallDelta(last.index, last.id, last.name,
                                       last.arguments + d.arguments)
        else:
            merged.append(d)
    return merged


def chat_logprobs(seq: CompletionOutput, top: int) -> dict[str, list]:
    """The chat shape: per token its text, logprob, UTF-8 bytes and the `top` best."""
    content = []
    for token_id, step in zip(seq.token_ids, seq.logprobs or ()):
        sampled = step[token_id]
        best = sorted((lp for lp in step.values() if lp.rank is not None),
                      key=lambda lp: lp.rank)[:top]
        content.append({**_entry(sampled), "top_logprobs": [_entry(lp) for lp in best]})
    return {"content": content}


def _entry(lp: Any) -> dict[str, Any]:
    text = lp.decoded_token or ""
    return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}
