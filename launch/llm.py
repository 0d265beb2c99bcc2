"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import atexit
import itertools
import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

from launch.client.engine_client import EngineClient
from launch.model_cache.cache import resolve_model
from launch.outputs import RequestOutput
from launch.processing.chat_template import ChatTemplate
from launch.processing.input_processor import InputProcessor, PromptType, per_prompt
from launch.processing.output_processor import RequestTracker
from launch.processing.tokenizer import load_tokenizer, stop_token_ids_of
from protocol import EngineConfig, SamplingParams


def start_engine(model: str, engine_args: dict[str, Any]) -> tuple[EngineClient, InputProcessor]:
    """Start the engine-core process (which starts the workers) for `model` and the engine
    options in `engine_args` (the fields of `EngineConfig`), load the tokenizer meanwhile, and
    wait until the engine is ready."""
    model = resolve_model(model)  # a known name (e.g. "smollm2"): its cached directory
    if not os.path.isdir(model):
        raise ValueError(f"model must be a Hugging Face style directory, got {model!r} "
                         "(nothing is downloaded from a model hub)")
    config = EngineConfig.create(model=os.path.abspath(model), **engine_args)
    engine = EngineClient(config)  # the processes start while we load the tokenizer
    try:
        tokenizer = load_tokenizer(config.model)
        stop_token_ids = stop_token_ids_of(config.model, tokenizer)
        ready = engine.wait_ready()
    except BaseException:
        engine.shutdown()
        raise
    return engine, InputProcessor(tokenizer, stop_token_ids, ready, config.model,
                                  config.max_logprobs)


class LLM:
    """Starts the engine and serves `generate` calls; takes the engine options of
    `EngineConfig` as keyword arguments. Tokenization and detokenization happen here, in the
    front-end. `shutdown()`, or leaving a `with LLM(...)` block, stops every process. Calls
    from several threads are served one at a time."""

    def __init__(self, model: str, **engine_args: Any) -> None:
        self.engine, self.inputs = start_engine(model, engine_args)
        self.config = self.engine.config
        self.tokenizer = self.inputs.tokenizer
        self.stop_token_ids = self.inputs.stop_token_ids
        self.max_model_len = self.inputs.ready.max_model_len
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._chat_template: ChatTemplate | None = None
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
        params = per_prompt(sampling_params, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"{len(priority)} priorities for {len(prompts)} prompts")
        inputs = [self.inputs.tokenize(p) for p in prompts]
        resolved = [self.inputs.resolve(ids, sp) for (_, ids), sp in zip(inputs, params)]
        with self._lock:
            tracker = RequestTracker(self.tokenizer, use_tqdm=use_tqdm)
            now, batch = time.time(), []
            for i, ((text, ids), sp) in enumerate(zip(inputs, resolved)):
                for child_id, child in tracker.add(str(next(self._ids)), text, ids, sp):
                    batch.append(self.inputs.make_request(child_id, ids, child, now,
                                                          priority[i] if priority else 0))
            self.engine.add_requests(batch)
            try:
                while not tracker.done:
                    self.engine.abort_requests(tracker.process(self.engine.get_outputs()))
            except KeyboardInterrupt:  # leave the engine clean for the caller's next call
                self.engine.abort_requests(tracker.unfinished_ids())
                raise
        return tracker.results()

    def chat(self, messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """`generate` on conversations ([{"role": ..., "content": ...}, ...], or a list of
        them) rendered with the model's chat template and its generation prompt."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if self._chat_template is None:
            self._chat_template = ChatTemplate.from_model_dir(self.config.model)
        prompts = [self._chat_template.render(list(c)) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def shutdown(self) -> None:
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
