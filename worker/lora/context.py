"""What the wrapped layers share in a step (vLLM's punica wrapper's role): the step's adapter
mapping, set once per step by the worker's manager."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker.lora.mapping import LoRAMapping
    from worker.lora.native import NativeLoRA


class LoRAContext:
    """What every wrapped layer reads in a step: the adapters' rows and weights (None: no
    adapter rows in this step). The native layer loop asks it for the step's deltas in its
    own form (`native_step`)."""

    def __init__(self) -> None:
        self.mapping: LoRAMapping | None = None
        self.native: NativeLoRA | None = None  # set once the layers are wrapped

    def native_step(self) -> int | None:
        """For the native layer loop: 0 in a step without adapter rows, else the address of
        its LoRAStep, or None when the loop cannot apply these deltas."""
        if self.mapping is None:
            return 0
        return None if self.native is None else self.native.step(self.mapping)
