"""A worker's adapters: which are loaded, loading them off the step path, and each step's
mapping for the wrapped layers.

Adapters reach a worker by path, never as tensors over the wire: `LoadLoRA` (sent when the
front-end registers one) starts a load on a background thread while steps go on; a step that
names an adapter (each new request carries its `LoRARequest`) uses the loaded one, waits for
one still loading, or reads one it never saw or evicted (a replayed journal, an adapter
evicted from the cache) in the step itself. At most `max_cpu_loras` adapters stay loaded, least
recently used out first, but never one that a request this worker holds still uses.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future

import numpy as np
from torch import nn

from protocol.engine_config import EngineConfig
from protocol.lora import LoRARequest
from protocol.scheduler_output import SchedulerOutput
from worker.input_batch import InputBatch, StepProtocolError
from worker.lora.adapter_files import inspect_adapter
from worker.lora.context import LoRAContext
from worker.lora.layers import wrap_lora_layers
from worker.lora.lora_model import LoRAModel, load_lora_model
from worker.lora.mapping import LoRAMapping
from worker.lora.native import NativeLoRA
from worker.models.config import ModelConfig
from worker.step_inputs import StepInputs

logger = logging.getLogger("deltaserve")


class NoLoRA:
    """The manager of an engine without --enable-lora: steps name no adapters."""

    def begin_step(self, so: SchedulerOutput, step: StepInputs) -> None:
        if step.lora_ids.any():
            raise StepProtocolError(f"step {so.step}: a request names a LoRA adapter, but LoRA "
                                    "is not enabled")

    def preload(self, lora_request: LoRARequest) -> None:
        logger.warning("LoRA is not enabled: ignored adapter %r", lora_request.lora_name)

    def unload(self, lora_int_id: int) -> None:
        pass


class LoRAManager:
    def __init__(self, model: nn.Module, model_config: ModelConfig, config: EngineConfig,
                 batch: InputBatch) -> None:
        self.context = LoRAContext()
        self.batch = batch
        self.targets = wrap_lora_layers(model, self.context)
        self.context.native = NativeLoRA(self.targets)
        self.model_config, self.device = model_config, batch.device
        self.max_loras, self.max_rank = config.max_loras, config.max_lora_rank
        self.capacity = config.lora_cache_size
        self.known: dict[int, LoRARequest] = {}  # by id: every adapter named to us
        self.loaded: OrderedDict[int, LoRAModel | Future] = OrderedDict()  # LRU order
        self.removed: set[int] = set()  # unregistered: dropped once no request uses them
        self.reading = threading.Lock()  # one background read at a time

    # --- control messages -------------------------------------------------------------------

    def preload(self, lora_request: LoRARequest) -> None:
        """Start loading in the background (a newer version of a known id replaces it)."""
        self._know(lora_request)
        self.removed.discard(lora_request.lora_int_id)
        if lora_request.lora_int_id not in self.loaded:
            self.loaded[lora_request.lora_int_id] = self._read_in_background(lora_request)
            self._evict()

    def unload(self, lora_int_id: int) -> None:
        self.removed.add(lora_int_id)

    def _read_in_background(self, lora_request: LoRARequest) -> Future:
        """_load on a thread of its own that ends with it. A thread that ran torch ops keeps an
        OpenMP team while it lives, and while libgomp manages more threads than there are CPUs
        it barely spins at barriers: every team's threads, the steps' included, sleep and are
        woken at each region's end (a kept loader thread made base-model steps 1.1-1.3x slower)."""
        future: Future = Future()

        def read() -> None:
            with self.reading:
                try:
                    future.set_result(self._load(lora_request))
                except BaseException as e:  # noqa: BLE001 - handed to whoever waits for it
                    future.set_exception(e)

        threading.Thread(target=read, name="deltaserve-lora", daemon=True).start()
        return future

    # --- steps ------------------------------------------------------------------------------

    def begin_step(self, so: SchedulerOutput, step: StepInputs) -> None:
        """Learn the new requests' adapters and set the step's mapping for the layers."""
        for new in so.scheduled_new_reqs:
            if new.lora_request is not None:
                self._know(new.lora_request)
        present = [int(i) for i in np.unique(step.lora_ids) if i]
        if len(present) > self.max_loras:
            raise StepProtocolError(f"step {so.step} names {len(present)} LoRA adapters, more "
                                    f"than max_loras {self.max_loras}")
        models = {i: self._get(i) for i in present}
        self.context.mapping = LoRAMapping.build(step.lora_ids, step.counts, models,
                                                 self.device) if present else None
        if present and (len(self.loaded) > self.capacity or self.removed):
            self._evict()

    def _know(self, lora_request: LoRARequest) -> None:
        old = self.known.get(lora_request.lora_int_id)
        if old is not None and not old.same_adapter(lora_request):
            self.loaded.pop(lora_request.lora_int_id, None)  # reloaded in place: new weights
        self.known[lora_request.lora_int_id] = lora_request

    def _get(self, lora_id: int) -> LoRAModel:
        entry = self.loaded.get(lora_id)
        if entry is None:
            lora_request = self.known.get(lora_id)
            if lora_request is None:
                raise StepProtocolError(f"LoRA adapter id {lora_id} was never named to this "
                                        "worker")
            entry = self._load(lora_request)
            logger.info("LoRA adapter %r read in the step (%.0f ms): not preloaded, or evicted "
                        "(--max-cpu-loras %d)", lora_request.lora_name, entry.load_s * 1e3,
                        self.capacity)
        elif isinstance(entry, Future):
            entry = entry.result()
        self.loaded[lora_id] = entry
        self.loaded.move_to_end(lora_id)
        return entry

    def _load(self, lora_request: LoRARequest) -> LoRAModel:
        name = lora_request.lora_name
        try:
            spec = inspect_adapter(name, lora_request.lora_path, self.model_config,
                                   self.max_rank)
            model = load_lora_model(lora_request, spec, self.targets)
        except Exception as e:
            raise RuntimeError(f"LoRA adapter {name!r} ({lora_request.lora_path}) could not be "
                               f"loaded: {e}") from None
        if lora_request.digest and spec.digest != lora_request.digest:
            logger.warning("LoRA adapter %r changed on disk since it was registered (digest "
                           "%s, now %s): serving what %s holds now", name, lora_request.digest,
                           spec.digest, lora_request.lora_path)
        logger.info("LoRA adapter %r loaded: rank %d, %d layers, %.1f MiB in %.0f ms", name,
                    spec.rank, sum(f is not None for f in model.layers), model.nbytes / 2**20,
                    model.load_s * 1e3)
        return model

    def _evict(self) -> None:
        """Drop unregistered adapters, then the least recently used beyond the capacity,
        except those a live request uses (and any still loading)."""
        live = {int(i) for i in self.batch.lora_ids[self.batch.live_rows()]}
        for lora_id in [i for i in self.removed if i not in live]:
            self.loaded.pop(lora_id, None)
            self.known.pop(lora_id, None)
            self.removed.discard(lora_id)
        for lora_id in list(self.loaded):
            if len(self.loaded) <= self.capacity:
                break
            entry = self.loaded[lora_id]
            if lora_id not in live and not (isinstance(entry, Future) and not entry.done()):
                del self.loaded[lora_id]


def make_lora_manager(model: nn.Module, model_config: ModelConfig, config: EngineConfig,
                      batch: InputBatch) -> LoRAManager | NoLoRA:
    return LoRAManager(model, model_config, config, batch) if config.enable_lora else NoLoRA()
