"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import atexit
import itertools
import os
import time
import weakref
from collections.abc import Sequence
from typing import Any

import msgspec

from launch.engine_client import EngineClient
from launch.model_cache import resolve_model
from launch.outputs import RequestOutput
from launch.request_tracker import RequestTracker
from launch.tokenizer import load_tokenizer, stop_token_ids_of
from protocol import AddRequest, EngineConfig, SamplingParams

PromptType = str | dict[str, Any]


class LLM:
    """Starts the engine-core process (which starts one worker per tensor-parallel rank) and
    serves `generate` calls. Tokenization and detokenization happen here, in the front-end.
    `shutdown()`, or leaving a `with LLM(...)` block, stops every process."""

    def __init__(self, model: str, tensor_parallel_size: int = 1, device: str = "auto",
                 dtype: str = "auto", max_model_len: int | None = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None, block_size: int = 16,
                 enable_prefix_caching: bool = True, num_gpu_blocks_override: int | None = None,
                 kv_cache_memory_bytes: int | None = None, seed: int = 0,
                 **engine_args: Any) -> None:
        model = resolve_model(model)  # a known name (e.g. "smollm2"): its cached directory
        if not os.path.isdir(model):
            raise ValueError(f"model must be a Hugging Face style directory, got {model!r} "
                             "(nothing is downloaded from a model hub)")
        self.config = EngineConfig(
            model=os.path.abspath(model), tensor_parallel_size=tensor_parallel_size,
            device=device, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            num_gpu_blocks_override=num_gpu_blocks_override,
            kv_cache_memory_bytes=kv_cache_memory_bytes, seed=seed, **engine_args)
        self.engine = EngineClient(self.config)  # the processes start while we load the tokenizer
        try:
            self.tokenizer = load_tokenizer(self.config.model)
            self.stop_token_ids = stop_token_ids_of(self.config.model, self.tokenizer)
        except BaseException:
            self.engine.shutdown()
            raise
        self.max_model_len = self.engine.wait_ready().max_model_len
        self._ids = itertools.count()
        # Stop the engine even if the caller forgets to: at exit, or when collected.
        self._finalizer = weakref.finalize(self, EngineClient.shutdown, self.engine)
        atexit.register(self._finalizer)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 ) -> list[RequestOutput]:
        """Run prompts to completion; results in prompt order. Every prompt and parameter is
        validated before anything is scheduled, so a bad one raises ValueError alone."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params = _per_prompt(sampling_params, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"{len(priority)} priorities for {len(prompts)} prompts")
        inputs = [self._tokenize(p) for p in prompts]
        requests = [self._resolve(text, ids, sp) for (text, ids), sp in zip(inputs, params)]
        tracker = RequestTracker(self.tokenizer, use_tqdm=use_tqdm)
        now, eos = time.time(), self.stop_token_ids[0] if self.stop_token_ids else None
        batch = []
        for i, ((text, ids), sp) in enumerate(zip(inputs, requests)):
            for child_id, child_params in tracker.add(str(next(self._ids)), text, ids, sp):
                batch.append(AddRequest(child_id, ids, child_params, now,
                                        priority[i] if priority else 0, eos))
        self.engine.add_requests(batch)
        try:
            while not tracker.done:
                self.engine.abort_requests(tracker.process(self.engine.get_outputs()))
        except KeyboardInterrupt:  # leave the engine clean for the caller's next call
            self.engine.abort_requests(tracker.unfinished_ids())
            raise
        return tracker.results()

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError("a dict prompt needs 'prompt_token_ids'")
            ids = list(prompt["prompt_token_ids"])
            if not all(isinstance(t, int) and t >= 0 for t in ids):
                raise ValueError("prompt_token_ids must be non-negative ints")
            return prompt.get("prompt"), ids
        if not isinstance(prompt, str):
            raise ValueError(f"a prompt must be a string or a dict, got {type(prompt).__name__}")
        if self.tokenizer is None:
            raise ValueError(f"the model directory {self.config.model!r} has no tokenizer; "
                             "pass {'prompt_token_ids': [...]} instead of text")
        return prompt, self.tokenizer.encode(prompt)

    def _resolve(self, text: str | None, ids: list[int],
                 params: SamplingParams) -> SamplingParams:
        """Check the prompt against the engine's limits and fill in defaults."""
        n, limit = len(ids), self.max_model_len
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= limit:
            raise ValueError(f"the prompt has {n} tokens, which leaves no room for output "
                             f"within max_model_len={limit}")
        ready = self.engine.ready
        if -(-n // ready.block_size) > ready.num_blocks - 1:
            raise ValueError(f"the prompt has {n} tokens, more than the whole KV cache holds "
                             f"({(ready.num_blocks - 1) * ready.block_size} tokens)")
        if ready.vocab_size and max(ids) >= ready.vocab_size:
            raise ValueError(f"prompt token id {max(ids)} is outside the vocabulary "
                             f"(size {ready.vocab_size})")
        updates: dict[str, Any] = {}
        if params.max_tokens is None:
            updates["max_tokens"] = limit - n
        if self.stop_token_ids[1:] and not params.ignore_eos:
            extra = [t for t in self.stop_token_ids[1:] if t not in (params.stop_token_ids or [])]
            updates["stop_token_ids"] = list(params.stop_token_ids or []) + extra
        return msgspec.structs.replace(params, **updates) if updates else params

    def shutdown(self) -> None:
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None,
                count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"{len(params)} sampling parameter sets for {count} prompts")
    return params
