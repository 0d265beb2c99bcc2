"""The front-end's LoRA adapters: which names and ids are registered, each checked before the
engine hears of it.

Registering reads the adapter's config and its safetensors header (not its data) against the
base model, so a bad adapter is refused at once with its reason (a 400 through the server; a
missing one a 404), and hashes its files (the digest every request of it carries: journals
say which weights ran, and the prefix cache never mixes two versions of a path). Then
`AddLoRA` tells each engine core, whose workers load it in the background.

`check` (file reads) may run on any thread; `commit` (which sends) runs where the engine client
lives (the event loop, or `LLM`'s caller).
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from itertools import count
from typing import Any

import msgspec

from protocol import EngineConfig
from protocol.lora import AddLoRA, LoRARequest, RemoveLoRA
from worker.lora.adapter_files import inspect_adapter
from worker.lora.peft_config import LoRAAdapterError, LoRAAdapterNotFoundError
from worker.models.config import ModelConfig
from worker.models.registry import load_model_config

__all__ = ["LoRARegistry", "LoRAAdapterError", "LoRAAdapterNotFoundError"]


class LoRARegistry:
    def __init__(self, config: EngineConfig, send: Callable[[AddLoRA | RemoveLoRA], None]) -> None:
        self.config = config
        self.send = send
        self.by_name: dict[str, LoRARequest] = {}
        self.by_id: dict[int, LoRARequest] = {}
        self._ids = count(1)  # ids the server hands out
        self._model: ModelConfig | None = None
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.config.enable_lora

    def adapters(self) -> list[LoRARequest]:
        return list(self.by_name.values())

    def get(self, name: str) -> LoRARequest | None:
        return self.by_name.get(name)

    # --- registering ------------------------------------------------------------------------

    def check(self, lora_request: LoRARequest) -> LoRARequest:
        """The adapter validated against the base model, with its digest: LoRAAdapterError
        (LoRAAdapterNotFoundError without one) naming the reason. Reads files: off the event
        loop."""
        if not self.enabled:
            raise LoRAAdapterError(f"LoRA adapter {lora_request.lora_name!r}: LoRA is not "
                                   "enabled (start the engine with --enable-lora)")
        spec = inspect_adapter(lora_request.lora_name, lora_request.lora_path,
                               self._model_config(), self.config.max_lora_rank)
        return msgspec.structs.replace(lora_request, digest=spec.digest)

    def commit(self, lora_request: LoRARequest, replace: bool = False) -> LoRARequest:
        """Register a checked adapter and have the engine load it. An id or name already
        registered for other weights is a LoRAAdapterError, unless `replace` (vLLM's
        load_inplace: same name, new weights)."""
        name, lora_id = lora_request.lora_name, lora_request.lora_int_id
        old = self.by_name.get(name)
        if old is not None and old.same_adapter(lora_request):
            return old
        other = self.by_id.get(lora_id)
        if other is not None and other.lora_name != name:
            raise LoRAAdapterError(f"LoRA adapter id {lora_id} is already {other.lora_name!r} "
                                   f"({other.lora_path}): give {name!r} another id")
        if old is not None and not replace:
            raise LoRAAdapterError(f"LoRA adapter {name!r} is already loaded (from "
                                   f"{old.lora_path}); unload it first, or load it in place")
        if old is not None:
            self.by_id.pop(old.lora_int_id, None)
        self.by_name[name] = self.by_id[lora_id] = lora_request
        self.send(AddLoRA(lora_request))
        return lora_request

    def ensure(self, lora_request: LoRARequest) -> LoRARequest:
        """What an offline request names: the registered adapter of that name and id, else
        checked and registered now (blocking on its files)."""
        old = self.by_name.get(lora_request.lora_name)
        if old is not None and (old.lora_int_id, old.lora_path) == \
                (lora_request.lora_int_id, lora_request.lora_path):
            return old
        return self.commit(self.check(lora_request))

    def new_request(self, name: str, path: str, base_model_name: str | None = None,
                    replace: bool = False) -> LoRARequest:
        """A LoRARequest for the server's load route: a fresh id, or the registered one's
        when reloading `name` in place."""
        old = self.by_name.get(name)
        with self._lock:
            lora_id = old.lora_int_id if old is not None and replace else self._fresh_id()
        return LoRARequest(name, lora_id, path, base_model_name)

    def remove(self, name: str) -> LoRARequest:
        """Unregister (KeyError if unknown); requests already running finish with it."""
        lora_request = self.by_name.pop(name)
        self.by_id.pop(lora_request.lora_int_id, None)
        self.send(RemoveLoRA(lora_request.lora_int_id))
        return lora_request

    def _fresh_id(self) -> int:
        while True:
            lora_id = next(self._ids)
            if lora_id not in self.by_id:
                return lora_id

    def _model_config(self) -> ModelConfig:
        if self._model is None:
            self._model = load_model_config(self.config.model)
        return self._model


def per_prompt_lora(lora_request: Any, count_: int) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt: one LoRARequest (or None) applies to all."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count_
    if not isinstance(lora_request, Sequence) or isinstance(lora_request, (str, bytes)):
        raise ValueError(f"lora_request must be a LoRARequest or a list of them (None for the "
                         f"base model), got {type(lora_request).__name__}")
    loras = list(lora_request)
    if len(loras) != count_:
        raise ValueError(f"{len(loras)} LoRA requests for {count_} prompts")
    bad = next((x for x in loras if x is not None and not isinstance(x, LoRARequest)), None)
    if bad is not None:
        raise ValueError(f"lora_request entries must be LoRARequest or None, got "
                         f"{type(bad).__name__}")
    return loras
