"""How many distinct LoRA adapters one step may hold (`--max-loras`): the scheduler's gate.

A waiting request of an adapter that no running request uses is admitted only while fewer
than `max_loras` adapters run; otherwise it keeps its place and the queue goes on (vLLM's
rule). Every step schedules running requests only, so no step names more adapters than that.
Base-model requests take no slot.
"""
from __future__ import annotations

from collections.abc import Iterable

from engine_core.request import Request


class LoRASlots:
    def __init__(self, max_loras: int | None) -> None:
        self.max_loras = max_loras  # None: LoRA is off, every request is admitted
        self.running: set[int] = set()

    def begin(self, running: Iterable[Request]) -> None:
        """The adapters of the running requests, before admitting waiting ones."""
        if self.max_loras is not None:
            self.running = {r.lora_id for r in running if r.lora_id}

    def admits(self, request: Request) -> bool:
        lora_id = request.lora_id
        return (self.max_loras is None or not lora_id or lora_id in self.running
                or len(self.running) < self.max_loras)

    def add(self, request: Request) -> None:
        if self.max_loras is not None and request.lora_id:
            self.running.add(request.lora_id)
