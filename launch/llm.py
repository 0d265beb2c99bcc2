"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import atexit
import itertools
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from launch.client.startup import start_engine
from launch.errors import EngineDeadError
from launch.lora.registry import LoRARegistry, per_prompt_lora
from launch.metrics.stats import IterationStats
from launch.offline_chat import ChatOptions, attach_messages, constrained, plan_conversation
from launch.offline_pooling import PoolingMixin
from launch.outputs import RequestOutput
from launch.processing.chat_template import ChatTemplate
from launch.processing.input_processor import PromptType, per_prompt
from launch.processing.output_processor import OutputProcessor, ProcessedOutputs
from launch.processing.pooling import POOLING_ONLY
from launch.processing.request_state import RequestState
from protocol import SamplingParams
from protocol.lora import LoRARequest


class LLM(PoolingMixin):
    """Starts the engine and serves `generate` calls (and, with `runner="pooling"`, the
    pooling calls `embed`, `classify`, `score`, `encode`); takes the engine options of
    `EngineConfig` as keyword arguments. Tokenization and detokenization happen here, in the
    front-end. `shutdown()`, or leaving a `with LLM(...)` block, stops every process. Calls
    from several threads are served one at a time."""

    def __init__(self, model: str, **engine_args: Any) -> None:
        self.engine, self.inputs = start_engine(model, engine_args)
        self.config = self.engine.config
        self.tokenizer = self.inputs.tokenizer
        self.stop_token_ids = self.inputs.stop_token_ids
        self.max_model_len = self.inputs.ready.max_model_len
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._chat_template: ChatTemplate | None = None
        self.lora = LoRARegistry(self.config, self.engine.send_lora)
        # Stop the engine even if the caller forgets to: at exit, or when collected.
        self._finalizer = weakref.finalize(self, self.engine.shutdown)
        atexit.register(self._finalizer)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 ) -> list[RequestOutput]:
        """Run prompts to completion; results in prompt order. Every prompt and parameter is
        validated before anything is scheduled, so a bad one raises ValueError alone.
        `lora_request`: the LoRA adapter for every prompt, or one (or None) per prompt; an
        adapter not seen before is checked and loaded first."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params = per_prompt(sampling_params, len(prompts), self.inputs.sampling_defaults)
        loras = per_prompt_lora(lora_request, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"{len(priority)} priorities for {len(prompts)} prompts")
        inputs = [self.inputs.tokenize(p) for p in prompts]
        resolved = [self.inputs.resolve(ids, sp) for (_, ids), sp in zip(inputs, params)]
        with self._lock:
            registered = {_key(lr): self.lora.ensure(lr) for lr in loras if lr}
            loras = [registered[_key(lr)] if lr else None for lr in loras]
            progress = _Progress(len(prompts), use_tqdm)
            now, batch, states = time.time(), [], []
            for i, ((text, ids), sp) in enumerate(zip(inputs, resolved)):
                state = RequestState.create(str(next(self._ids)), text, ids, sp, self.tokenizer,
                                            now, loras[i])
                batch += [self.inputs.make_request(child_id, ids, seq.params, now,
                                                   priority[i] if priority else 0, loras[i])
                          for child_id, seq in zip(state.child_ids, state.sequences)]
                states.append(state)
            # Every request valid: now sent (a request's sequences to one replica), tracked.
            self.engine.add_requests(batch, [len(state.child_ids) for state in states])
            for state in states:
                self.output_processor.add_request(state)
            try:
                while self.output_processor.has_unfinished():
                    stats = IterationStats(time.time())
                    result = self.output_processor.process_outputs(self.engine.get_outputs(),
                                                                   stats)
                    self.engine.abort_requests(result.aborts)
                    progress.update(result, stats)
            except (KeyboardInterrupt, EngineDeadError):  # leave the engine clean for the
                # caller's next call (with data parallelism, a dead replica's peers serve on)
                self.engine.abort_requests(self.output_processor.abort_all())
                raise
            finally:
                progress.close()
        return [state.output() for state in states]

    def chat(self, messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, *, tools: list[dict[str, Any]] | None = None,
             tool_choice: Any = None, parallel_tool_calls: bool | None = None,
             response_format: dict[str, Any] | None = None,
             tool_call_parser: str | None = None, reasoning_parser: str | None = None,
             chat_template: str | None = None,
             add_generation_prompt: bool = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             ) -> list[RequestOutput]:
        """`generate` on conversations ([{"role": ..., "content": ...}, ...], or a list of
        them) in any shape the chat route accepts, rendered with the model's chat template
        (or `chat_template`, a template's text) and its generation prompt. `tools`,
        `tool_choice`, `parallel_tool_calls` and `response_format` mean what they mean to
        the chat route, and `tool_call_parser`/`reasoning_parser` what `serve`'s flags do;
        each sequence's parsed answer (content, reasoning, tool_calls) is its `message`."""
        if self.inputs.pooling is not None:
            raise ValueError(POOLING_ONLY)
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        params = per_prompt(sampling_params, len(conversations), self.inputs.sampling_defaults)
        if self.tokenizer is None:
            raise ValueError(f"the model directory {self.config.model!r} has no tokenizer")
        template = (ChatTemplate(chat_template) if chat_template is not None
                    else self._model_chat_template())
        options = ChatOptions(tools, tool_choice, parallel_tool_calls, response_format,
                              tool_call_parser, reasoning_parser, add_generation_prompt)
        plans = [plan_conversation(list(c), options, template, self.inputs.max_prompt_chars)
                 for c in conversations]
        prompts = [{"prompt": plan.prompt, "prompt_token_ids": self.tokenizer.encode(
            plan.prompt, add_special_tokens=False)} for plan in plans]
        outputs = self.generate(prompts, [constrained(p, plan) for p, plan in zip(params, plans)],
                                use_tqdm=use_tqdm, lora_request=lora_request)
        attach_messages(outputs, plans)
        return outputs

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check and load an adapter ahead of its requests (ValueError naming the reason)."""
        with self._lock:
            self.lora.ensure(lora_request)
        return True

    def remove_lora(self, name: str) -> bool:
        """Unregister an adapter by name; False if none has that name."""
        with self._lock:
            if self.lora.get(name) is None:
                return False
            self.lora.remove(name)
            return True

    def list_loras(self) -> list[LoRARequest]:
        return self.lora.adapters()

    def _model_chat_template(self) -> ChatTemplate:
        if self._chat_template is None:
            self._chat_template = ChatTemplate.from_model_dir(self.config.model)
        return self._chat_template

    def shutdown(self) -> None:
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _key(lora: LoRARequest) -> tuple[str, int, str]:
    """What tells two LoRARequests apart (they compare equal by name alone, as vLLM's)."""
    return lora.lora_name, lora.lora_int_id, lora.lora_path


class _Progress:
    """A progress bar over one `generate` call: finished prompts and output tokens/s."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = tqdm(total=total, desc="Processed prompts", unit="req", disable=not enabled,
                        dynamic_ncols=True)
        self.generated = 0

    def update(self, result: ProcessedOutputs, stats: IterationStats) -> None:
        self.generated += stats.num_generation_tokens
        if result.finished and not self.bar.disable:
            self.bar.update(len(result.finished))
            elapsed = max(self.bar.format_dict["elapsed"], 1e-9)
            self.bar.set_postfix_str(f"{self.generated / elapsed:.0f} output toks/s",
                                     refresh=False)

    def close(self) -> None:
        self.bar.close()
