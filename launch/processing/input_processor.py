"""Prompts and sampling parameters in, validated engine requests out: the front-end's one
input path, shared by `LLM` and `AsyncLLM`.

Everything the engine core would refuse is refused here first, as a ValueError naming the
field, so a bad request fails alone and never reaches the engine: the prompt check the engine
core applies (`check_prompt`), `SamplingParams`' own validation re-run (a params object may
have been changed after construction), the engine's caps, and finally a round trip through the
wire codec, so that what is sent is exactly what the engine core will decode. A structured-
output constraint is checked by the grammar engine the engine core compiles it with, with the
model's tokenizer and the engine's limits (`GrammarValidator`: a bounded pool with a deadline,
cached by key), so an invalid schema, regex or grammar is refused here too.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from engine_core.structured_output.grammar import check_grammar
from engine_core.structured_output.grammar_validator import GrammarValidator
from launch.processing.pooling import (
    GENERATE_ONLY,
    POOLING_ONLY,
    PooledInput,
    PoolingModelInfo,
    truncate,
)
from launch.processing.tokenizer import encode_many, max_token_chars
from protocol import (
    AddRequest,
    Channel,
    Codec,
    EngineReady,
    PoolingParams,
    ProtocolError,
    SamplingParams,
    StructuredOutputsError,
    StructuredOutputsParams,
    check_prompt,
)
from protocol.lora import LoRARequest

PromptType = str | dict[str, Any]
MAX_N = 128  # sequences per request, as OpenAI's API allows


@dataclass(frozen=True)
class ProcessedInput:
    """A validated prompt and its resolved parameters: what `AsyncLLM.add_request` submits.
    `unchecked` is a constraint still to be checked (`GrammarValidator.check_async`) before
    it may be submitted, `describe` how a refusal of it is reported (None: as it is)."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    unchecked: StructuredOutputsParams | None = None
    describe: Callable[[StructuredOutputsError], Exception] | None = None
    lora_request: LoRARequest | None = None  # a registered adapter (None: the base model)


class InputProcessor:
    def __init__(self, tokenizer: Any | None, stop_token_ids: list[int], ready: EngineReady,
                 model: str, max_logprobs: int = 20,
                 grammars: GrammarValidator | None = None,
                 sampling_defaults: dict[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop_token_ids = stop_token_ids  # [EOS, other end-of-generation ids...]
        self.eos_token_id = stop_token_ids[0] if stop_token_ids else None
        self.extra_stop_ids = stop_token_ids[1:]
        self.ready = ready
        self.model = model
        self.max_logprobs = max_logprobs
        # Checks constraints (None: llguidance without a tokenizer, on the calling thread).
        self.grammars = grammars
        # SamplingParams fields a request gets where it sets none (generation_config.json)
        self.sampling_defaults = dict(sampling_defaults or {})
        self._codec = Codec(Channel.FRONTEND_TO_CORE)
        # A text longer than this cannot tokenize into max_model_len tokens (unless the
        # tokenizer's normalizer drops characters): it is refused before tokenizing.
        self.max_prompt_chars = ready.max_model_len * max_token_chars(tokenizer)
        # What a pooling engine serves (set by start_engine); None: a generating engine.
        self.pooling: PoolingModelInfo | None = None

    def tokenize(self, prompt: PromptType, add_special_tokens: bool = True
                 ) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a string or `{"prompt_token_ids": [...]}` prompt."""
        return self.tokenize_many([prompt], add_special_tokens)[0]

    def tokenize_many(self, prompts: list[PromptType], add_special_tokens: bool = True
                      ) -> list[tuple[str | None, list[int]]]:
        """`tokenize` of each prompt, every one checked before the texts are tokenized
        together (one tokenizer call)."""
        given = [self._token_prompt(p) if isinstance(p, dict) else None for p in prompts]
        texts = [self._checked_text(p) for p, pair in zip(prompts, given) if pair is None]
        encoded = iter(encode_many(self.tokenizer, texts, add_special_tokens))
        texts_left = iter(texts)
        return [pair if pair is not None else (next(texts_left), next(encoded))
                for pair in given]

    @staticmethod
    def _token_prompt(prompt: dict) -> tuple[str | None, list[int]]:
        ids = prompt.get("prompt_token_ids")
        if not isinstance(ids, (list, tuple)):
            raise ValueError("a dict prompt needs 'prompt_token_ids', a list of ints")
        if not all(type(t) is int for t in ids):
            raise ValueError("prompt_token_ids must be ints")
        text = prompt.get("prompt")
        return (text if isinstance(text, str) else None), list(ids)

    def _checked_text(self, prompt: Any) -> str:
        """A text prompt this tokenizer may tokenize, or ValueError saying why not."""
        if not isinstance(prompt, str):
            raise ValueError(f"a prompt must be a string or a dict, got {type(prompt).__name__}")
        if self.tokenizer is None:
            raise ValueError(f"the model directory {self.model!r} has no tokenizer; "
                             "pass {'prompt_token_ids': [...]} instead of text")
        if len(prompt) > self.max_prompt_chars:
            raise ValueError(f"the prompt has {len(prompt)} characters, more than "
                             f"max_model_len={self.ready.max_model_len} tokens can hold "
                             f"({self.max_prompt_chars} characters: max_model_len x the "
                             "longest token)")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"the prompt is not valid Unicode text ({e.reason} at position "
                             f"{e.start})") from None
        return prompt

    def resolve(self, token_ids: list[int], params: Any, check_constraint: bool = True
                ) -> SamplingParams:
        """Check the prompt and parameters against the engine's limits; fill in defaults.
        A constraint is checked too (waiting for the grammar engine, up to its deadline),
        unless `check_constraint` is False (then see `constraint_known`)."""
        if self.pooling is not None:
            raise ValueError(POOLING_ONLY)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got "
                             f"{type(params).__name__}")
        params = msgspec.structs.replace(params)  # re-validates a possibly mutated object
        if params.structured_outputs is not None:  # likewise, then asks the grammar engine
            constraint = msgspec.structs.replace(params.structured_outputs)
            if check_constraint:
                self.check_constraint(constraint)
            params = msgspec.structs.replace(params, structured_outputs=constraint)
        ready = self.ready
        check_prompt(token_ids, ready.max_model_len, ready.num_blocks - 1, ready.block_size,
                     ready.vocab_size, ready.max_kv_tokens)
        if params.n > MAX_N:
            raise ValueError(f"n must be at most {MAX_N}, got {params.n}")
        if params.logprobs is not None and params.logprobs > self.max_logprobs:
            raise ValueError(f"logprobs must be at most {self.max_logprobs} (the engine's "
                             f"max_logprobs), got {params.logprobs}")
        updates: dict[str, Any] = {}
        if params.max_tokens is None:
            updates["max_tokens"] = ready.max_model_len - len(token_ids)
        if self.extra_stop_ids and not params.ignore_eos:
            have = params.stop_token_ids or []
            updates["stop_token_ids"] = have + [t for t in self.extra_stop_ids if t not in have]
        return msgspec.structs.replace(params, **updates) if updates else params

    def check_constraint(self, constraint: StructuredOutputsParams) -> None:
        """Block until the grammar engine has checked `constraint`: StructuredOutputsError
        if it is refused, GrammarBusyError if it could not be checked in time."""
        if self.grammars is None:
            check_grammar(constraint)
        else:
            self.grammars.check(constraint)

    def constraint_known(self, constraint: StructuredOutputsParams) -> bool:
        """True if `constraint` was checked before (raising if it was refused), so it needs
        no more grammar work; False if it still needs a check."""
        if self.grammars is None:
            check_grammar(constraint)
            return True
        return self.grammars.verdict(constraint)

    def process_pooling(self, prompt: PromptType, params: PoolingParams | None,
                        task: str | None = None, add_special_tokens: bool = True,
                        truncate_prompt_tokens: int | None = None,
                        truncation_side: str | None = None) -> PooledInput:
        """A pooling prompt tokenized, truncated as asked and checked, and its parameters
        resolved against the model (`task` None: the params' or the model's own)."""
        return self.process_pooling_many([prompt], [params], task, add_special_tokens,
                                         truncate_prompt_tokens, truncation_side)[0]

    def process_pooling_many(self, prompts: list[PromptType],
                             params: list[PoolingParams | None], task: str | None = None,
                             add_special_tokens: bool = True,
                             truncate_prompt_tokens: int | None = None,
                             truncation_side: str | None = None) -> list[PooledInput]:
        """`process_pooling` of each prompt (`params[i]` is prompt i's), the texts tokenized
        in one tokenizer call."""
        if self.pooling is None:
            raise ValueError(GENERATE_ONLY)
        side = truncation_side or getattr(self.tokenizer, "truncation_side", None) or "right"
        if side not in ("left", "right"):
            raise ValueError(f"truncation_side must be 'left' or 'right', got {side!r}")
        if truncate_prompt_tokens is not None:  # as vLLM: cut an over-long text first
            prompts = [_cut_text(p, self.max_prompt_chars, side) for p in prompts]
        ready = self.ready
        inputs = []
        for (text, ids), sp in zip(self.tokenize_many(prompts, add_special_tokens), params):
            ids = truncate(ids, truncate_prompt_tokens, ready.max_model_len, side)
            resolved = self.pooling.resolve(sp, task)
            check_prompt(ids, ready.max_model_len, ready.num_blocks - 1, ready.block_size,
                         ready.vocab_size, ready.max_kv_tokens, needs_output=False)
            inputs.append(PooledInput(text, ids, resolved))
        return inputs

    def make_request(self, request_id: str, token_ids: list[int], params: SamplingParams,
                     arrival_time: float, priority: Any = 0,
                     lora_request: LoRARequest | None = None,
                     pooling_params: PoolingParams | None = None) -> AddRequest:
        """The request exactly as the engine core will decode it."""
        if type(priority) is not int or not -(1 << 63) <= priority < 1 << 63:
            raise ValueError(f"priority must be a 64-bit int, got {priority!r}")
        if params.stop:  # matched here, in the front-end: the engine never needs them
            params = msgspec.structs.replace(params, stop=None)
        request = AddRequest(request_id, token_ids, params, arrival_time, priority,
                            self.eos_token_id, lora_request, pooling_params)
        try:
            frame = self._codec.encode(request)
            self._codec.decode(frame)
        except (ProtocolError, OverflowError, TypeError, ValueError) as e:
            raise ValueError(f"request {request_id!r} cannot be sent to the engine: {e}") from None
        return request


def _cut_text(prompt: PromptType, limit: int, side: str) -> PromptType:
    """A text prompt cut to `limit` characters from its `side` end; others as they are."""
    if not isinstance(prompt, str) or len(prompt) <= limit:
        return prompt
    return prompt[-limit:] if side == "left" else prompt[:limit]


def per_prompt(params: Any, count: int, defaults: dict[str, Any] | None = None) -> list[Any]:
    """One SamplingParams per prompt (a single one, or None for the model's `defaults`,
    applies to all)."""
    if params is None:
        return [SamplingParams(**(defaults or {}))] * count
    return one_per_prompt(params, count, "sampling_params", SamplingParams,
                          "sampling parameter sets")


def one_per_prompt(value: Any, count: int, field: str, kind: type, plural: str) -> list[Any]:
    """`value` for each of `count` prompts: one `kind` (or None) applies to all, a list gives
    one each; ValueError naming `field` for anything else or a list of another length."""
    if value is None or isinstance(value, kind):
        return [value] * count
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes, dict)):
        raise ValueError(f"{field} must be {kind.__name__} or a list of them, got "
                         f"{type(value).__name__}")
    values = list(value)
    if len(values) != count:
        raise ValueError(f"{len(values)} {plural} for {count} prompts")
    return values
