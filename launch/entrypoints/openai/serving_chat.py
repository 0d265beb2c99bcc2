"""`POST /v1/chat/completions`: messages (and tools) rendered with the chat template; the
answer split into reasoning, content and tool calls, whole or streamed."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from typing import Any

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from launch.async_llm import AsyncLLM
from launch.entrypoints.openai.chat_answer import (
    AnswerDelta,
    AnswerStream,
    ChatAnswerParser,
    ChatParsers,
    finish_reason,
)
from launch.entrypoints.openai.chat_constraint import after_reasoning, chat_constraint
from launch.entrypoints.openai.errors import APIError
from launch.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    message_dicts,
    read_body,
    sampling_params,
)
from launch.entrypoints.openai.serving_engine import (
    SSE_DONE,
    OpenAIServing,
    merge,
    now,
    request_id,
    sse,
    stream_error,
    until_disconnected,
    usage,
)
from launch.entrypoints.openai.tool_choice import parse_tool_choice
from launch.outputs import CompletionOutput, RequestOutput, RequestOutputKind
from launch.processing.chat_template import ChatTemplate, ChatTemplateError
from launch.processing.input_processor import ProcessedInput
from launch.processing.request_stream import RequestStream


class OpenAIServingChat(OpenAIServing):
    def __init__(self, engine: AsyncLLM, served_model_names: list[str],
                 input_executor: Executor, template: ChatTemplate | None,
                 parsers: ChatParsers = ChatParsers()) -> None:
        super().__init__(engine, served_model_names, input_executor)
        self.template = template
        self.parsers = parsers

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None) -> str:
        if self.template is None:
            raise APIError(400, "the model has no chat template (no chat_template in its "
                           "tokenizer_config.json, no chat_template.jinja); start the server "
                           "with --chat-template FILE", "messages")
        if not messages:
            raise APIError(400, "messages must not be empty", "messages")
        dicts = message_dicts(messages)
        chars = sum(len(m["content"] or "") for m in dicts) + len(json.dumps(tools or []))
        if chars > self.engine.inputs.max_prompt_chars:
            raise APIError(400, f"the messages hold {chars} characters, more than a prompt of "
                           f"max_model_len={self.engine.max_model_len} tokens can "
                           f"({self.engine.inputs.max_prompt_chars})", "messages")
        try:
            return self.template.render(dicts, add_generation_prompt, tools=tools)
        except ChatTemplateError as e:
            raise APIError(400, str(e), "messages") from None

    async def create(self, raw: Request) -> Response:
        body = await read_body(raw, ChatCompletionRequest)
        self.check_model(body.model)
        self.check_alive()
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        max_tokens = (body.max_completion_tokens if body.max_completion_tokens is not None
                      else body.max_tokens)
        answers = self.answer_parser(body)
        constraint = chat_constraint(body, answers.tools)

        def prepare() -> list[ProcessedInput]:  # on the input thread: grammar checks, template
            answer_constraint = after_reasoning(constraint, self.parsers.reasoning)
            params = sampling_params(
                body, {"max_tokens": max_tokens}, model_defaults=self.sampling_defaults,
                logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                structured_outputs=answer_constraint and answer_constraint.params)
            return [self.process(self.render(body.messages, body.add_generation_prompt,
                                             body.tools),
                                 params, add_special_tokens=False, constraint=answer_constraint)]
        inputs = await self.off_loop(prepare)
        self.check_budget(inputs)
        rid = request_id("chatcmpl")
        if body.stream:  # submitted once the response streams: a client gone before never is
            return StreamingResponse(self._stream(rid, body, inputs[0], answers),
                                     media_type="text/event-stream")
        streams = self.submit(rid, inputs, RequestOutputKind.FINAL_ONLY)
        (out,) = await until_disconnected(raw, self.collect(streams))
        return await self.respond(inputs, lambda: self._response(rid, body, out, answers))

    def answer_parser(self, body: ChatCompletionRequest) -> ChatAnswerParser:
        """How this request's answers split: its tool mode (400 for a malformed one, or for
        "auto" on a server started without --enable-auto-tool-choice, as vLLM answers)."""
        tools = parse_tool_choice(body.tools, body.tool_choice, body.parallel_tool_calls)
        if tools.mode == "auto" and self.parsers.tool_parser is None:
            raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and '
                           "--tool-call-parser to be set", "tool_choice")
        return ChatAnswerParser(tools, self.parsers.tool_parser, self.parsers.reasoning)

    def _response(self, rid: str, body: ChatCompletionRequest, out: RequestOutput,
                  answers: ChatAnswerParser) -> dict[str, Any]:
        choices = []
        for seq in out.outputs:
            answer = answers.parse(seq.text, seq.finish_reason == "stop")
            choices.append({
                "index": seq.index, "message": answer.message(),
                "logprobs": chat_logprobs(seq, body.top_logprobs or 0) if body.logprobs else None,
                "finish_reason": finish_reason(seq.finish_reason, bool(answer.tool_calls)),
                "stop_reason": seq.stop_reason,
                **({"token_ids": seq.token_ids} if body.return_token_ids else {})})
        return {"id": rid, "object": "chat.completion", "created": now(),
                "model": self.model_name, "choices": choices,
                **({"prompt_token_ids": out.prompt_token_ids} if body.return_token_ids else {}),
                "usage": usage(len(out.prompt_token_ids),
                               sum(len(s.token_ids) for s in out.outputs))}

    async def _stream(self, rid: str, body: ChatCompletionRequest, inputs: ProcessedInput,
                      answers: ChatAnswerParser) -> AsyncIterator[bytes]:
        created, generated = now(), 0
        streams: list[RequestStream] = []
        parts = [answers.stream() for _ in range(inputs.params.n)]
        called = [False] * inputs.params.n  # whether a sequence has streamed a tool call

        def chunk(index: int, delta: dict[str, Any], seq: CompletionOutput | None) -> bytes:
            finish = None if seq is None else finish_reason(seq.finish_reason, called[index])
            logprobs = (chat_logprobs(seq, body.top_logprobs or 0)
                        if body.logprobs and seq is not None else None)
            return sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                        "model": self.model_name,
                        "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                     "finish_reason": finish,
                                     "stop_reason": None if seq is None or finish is None
                                     else seq.stop_reason}]})
        try:
            streams = self.submit(rid, [inputs], RequestOutputKind.DELTA)
            for index in range(inputs.params.n):
                yield chunk(index, {"role": "assistant", "content": ""}, None)
            async for _, out in merge(streams):
                for seq in out.outputs:
                    generated += len(seq.token_ids)
                    delta = _delta_fields(parts[seq.index], seq)
                    called[seq.index] = called[seq.index] or "tool_calls" in delta
                    if delta or seq.finish_reason or (seq.token_ids and body.logprobs):
                        yield chunk(seq.index, delta, seq)
            if body.stream_options is not None and body.stream_options.include_usage:
                yield sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                           "model": self.model_name, "choices": [],
                           "usage": usage(len(inputs.prompt_token_ids), generated)})
            yield SSE_DONE
        except Exception as e:  # every refusal or failure: an error event, then [DONE]
            yield stream_error(e)
            yield SSE_DONE
        finally:
            self.abort(streams)


def _delta_fields(stream: AnswerStream, seq: CompletionOutput) -> dict[str, Any]:
    """The OpenAI delta fields of one sequence's new text (and its end, if it ended)."""
    delta = stream.feed(seq.text)
    if seq.finish_reason is not None:
        end = stream.finish(seq.finish_reason == "stop")
        delta = AnswerDelta(delta.reasoning + end.reasoning, delta.content + end.content,
                            delta.tool_calls + end.tool_calls)
    fields: dict[str, Any] = {}
    if delta.reasoning:
        fields["reasoning_content"] = delta.reasoning
    if delta.content:
        fields["content"] = delta.content
    if delta.tool_calls:
        fields["tool_calls"] = [call.to_openai() for call in delta.tool_calls]
    return fields


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
