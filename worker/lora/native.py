"""A step's LoRA deltas in the native layer loop (worker/kernels/cpu_decoder.cpp): each
adapter's factors as a table by target (4 per decoder layer: qkv, o, gate_up, down) and the
step's adapter rows, so steps with adapter rows stay in the one native call.

Taken where the loop runs (float32, TP 1) and every decoder layer has its four wrapped
projections; otherwise the step runs the Python layer loop, which applies the same deltas.
"""
from __future__ import annotations

import ctypes
import os

from worker.lora.lora_model import LoRAModel
from worker.lora.mapping import LoRAMapping
from worker.lora.native_delta import build_step, factor_table
from worker.lora.targets import LoRATarget
from worker.native.cpu_decoder import MAX_ROWS, LoRAFactors

_KINDS = {"qkv_proj": 0, "o_proj": 1, "gate_up_proj": 2, "down_proj": 3}
# DELTASERVE_NATIVE_LORA=0: steps with adapter rows take the Python layer loop (to compare).
ENABLED = os.environ.get("DELTASERVE_NATIVE_LORA", "1") != "0"


class NativeLoRA:
    """Builds `LoRAStep`s for one model's wrapped layers."""

    def __init__(self, targets: list[LoRATarget]) -> None:
        layers = max((t.layer_index for t in targets), default=-1) + 1
        slots = [4 * t.layer_index + _KINDS[t.name] for t in targets]
        self.complete = ENABLED and sorted(slots) == list(range(4 * layers))
        self.slots = slots  # target index -> its place in a table
        self.size = 4 * layers

    def step(self, mapping: LoRAMapping) -> int | None:
        """The address of `mapping`'s LoRAStep, or None when the loop cannot take it."""
        if not self.complete:
            return None
        if mapping.native is None:
            tables = [self._table(model) for model, _, _ in mapping.segments]
            if any(t is None for t in tables):
                return None
            # (step, what it points into)
            mapping.native = build_step(mapping.segments, mapping.index, tables, MAX_ROWS)
        return ctypes.addressof(mapping.native[0])

    def _table(self, model: LoRAModel) -> ctypes.Array | None:
        """The adapter's factors by slot (factor_table's, reordered), made once per adapter."""
        if model.loop_table is None:
            table = factor_table(model)
            if table is None:
                return None
            loop = (LoRAFactors * self.size)()
            for index, slot in enumerate(self.slots):
                loop[slot] = table[index]
            model.loop_table = loop
        return model.loop_table
