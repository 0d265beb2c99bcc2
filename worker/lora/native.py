"""A step's LoRA deltas in the native layer loop (worker/kernels/cpu_decoder.cpp): each
adapter's factors as a table by target (4 per decoder layer: qkv, o, gate_up, down) and the
step's adapter rows, so steps with adapter rows stay in the one native call.

Taken where the loop runs (float32, TP 1) and every decoder layer has its four wrapped
projections; otherwise the step runs the Python layer loop, which applies the same deltas.
"""
from __future__ import annotations

import ctypes
import os

import numpy as np
import torch

from worker.lora.lora_model import LoRAModel
from worker.lora.mapping import LoRAMapping
from worker.lora.targets import LoRATarget
from worker.native.cpu_decoder import MAX_ROWS, LoRAFactors, LoRAStep

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
            mapping.native = self._build(mapping, tables)  # (step, what it points into)
        return ctypes.addressof(mapping.native[0])

    def _build(self, mapping: LoRAMapping, tables: list) -> tuple[LoRAStep, tuple]:
        if mapping.index is None:  # the segments are step rows themselves
            rows = np.concatenate([np.arange(s, e, dtype=np.int64)
                                   for _, s, e in mapping.segments])
        else:
            rows = mapping.index.cpu().numpy().astype(np.int64)
        bounds = np.zeros(len(tables) + 1, np.int64)
        bounds[1:] = np.cumsum([e - s for _, s, e in mapping.segments])
        ranks = max(f.rank for table in tables for f in table)
        scratch = torch.empty(MAX_ROWS * max(ranks, 1))  # t [rows <= MAX_ROWS, rank]
        pointers = (ctypes.POINTER(LoRAFactors) * len(tables))(
            *[ctypes.cast(t, ctypes.POINTER(LoRAFactors)) for t in tables])
        step = LoRAStep(len(tables), ctypes.addressof(pointers), bounds.ctypes.data,
                        rows.ctypes.data, scratch.data_ptr())
        return step, (rows, bounds, scratch, pointers, tables)

    def _table(self, model: LoRAModel) -> ctypes.Array | None:
        """The adapter's factors by slot (float32, a as [rank, in]), made once per adapter."""
        table = model.native_table
        if table is None:
            kept, table = [], (LoRAFactors * self.size)()
            for index, factors in enumerate(model.layers):
                if factors is None:
                    continue
                a, b = factors
                if a.dtype != torch.float32 or b.dtype != torch.float32:
                    return None
                a_rows = a.t().contiguous()
                kept += [a_rows, b]
                table[self.slots[index]] = LoRAFactors(a.shape[1], a_rows.data_ptr(),
                                                       b.data_ptr())
            model.native_table, model.native_kept = table, kept
        return table
