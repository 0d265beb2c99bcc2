"""Adapters' factors in the native kernel's form, and the Python layer loop's LoRA delta of one
linear in one native call (`cpu_decoder_lora_delta`, the native layer loop's `lora_delta`).

In the Python layer loop the torch path costs 2-10 small ops per wrapped linear (index_select,
an mm pair per adapter, index_add_), ~120 linears a step, and each op big enough to go parallel
opens an OpenMP region of its own, whose teammates must be at its barriers (and are woken
there when their waits are throttled, see lora/manager.py: ~2 context switches per region and
thread, ~20 ms of a SmolLM2 one-stream step, measured). For float32
rows-contiguous CPU tensors one ctypes call applies every adapter's delta of the linear:
t = x_rows · aᵀ, then y_rows += t · b, rows by adapter, on the calling thread alone when the
linear's deltas are small (a decode stream's), in one region over torch's threads otherwise.

Layouts: a table is one adapter's `LoRAFactors` by LoRATarget.index (a as [rank, in]
float32, b [rank, out], spans [rank, 2] each b row's nonzero columns, so the expand skips a
merged layer's other parts; a null a where the adapter leaves the linear alone). A step's
`LoRAStep` lists its adapters' tables, their step rows adapter by adapter (`rows`,
`bounds`) and the scratch t [rows, max rank].
"""
from __future__ import annotations

import ctypes
import os

import numpy as np
import torch

from worker.lora.lora_model import LoRAModel
from worker.native import cpu_decoder
from worker.native.cpu_decoder import LoRAFactors, LoRAStep

# DELTASERVE_LORA_KERNEL=0: the Python layer loop adds deltas with torch ops (to compare).
ENABLED = os.environ.get("DELTASERVE_LORA_KERNEL", "1") != "0"


def factor_table(model: LoRAModel) -> ctypes.Array | None:
    """`model`'s factors by target index, made once per adapter; None unless float32."""
    if model.native_table is None:
        kept, table = [], (LoRAFactors * len(model.layers))()
        for index, factors in enumerate(model.layers):
            if factors is None:
                continue
            a, b = factors
            if a.dtype != torch.float32 or b.dtype != torch.float32 or a.device.type != "cpu":
                return None
            a_rows, spans = a.t().contiguous(), _spans(b)
            kept += [a_rows, b, spans]
            table[index] = LoRAFactors(a.shape[1], a_rows.data_ptr(), b.data_ptr(),
                                       spans.data_ptr())
        model.native_table, model.native_kept = table, kept
    return model.native_table


def _spans(b: torch.Tensor) -> torch.Tensor:
    """[rank, 2] int64: for each row of b [rank, out], the columns [lo, hi) outside which it is
    zero (a merged layer's part: its rank rows reach only that part's columns); (0, 0) for a
    zero row."""
    nonzero = b != 0
    any_ = nonzero.any(dim=1)
    columns = torch.arange(b.shape[1])
    lo = torch.where(nonzero, columns, b.shape[1]).amin(dim=1)
    hi = torch.where(nonzero, columns + 1, 0).amax(dim=1)
    return torch.stack([torch.where(any_, lo, 0), torch.where(any_, hi, 0)], 1).contiguous()


def build_step(segments: list[tuple[LoRAModel, int, int]], index: torch.Tensor | None,
               tables: list, scratch_rows: int | None = None) -> tuple[LoRAStep, tuple]:
    """The LoRAStep of a mapping's `segments`/`index` (LoRAMapping's) over `tables` (one per
    segment), and what it points into (keep it alive with the step). scratch_rows: the most
    adapter rows (all adapters') it will see (default: all the mapping's rows)."""
    if index is None:  # the segments are step rows themselves
        rows = np.concatenate([np.arange(s, e, dtype=np.int64) for _, s, e in segments])
    else:
        rows = index.cpu().numpy().astype(np.int64)
    bounds = np.zeros(len(tables) + 1, np.int64)
    bounds[1:] = np.cumsum([e - s for _, s, e in segments])
    ranks = max(f.rank for table in tables for f in table)
    scratch = torch.empty((scratch_rows or len(rows)) * max(ranks, 1))
    pointers = (ctypes.POINTER(LoRAFactors) * len(tables))(
        *[ctypes.cast(t, ctypes.POINTER(LoRAFactors)) for t in tables])
    step = LoRAStep(len(tables), ctypes.addressof(pointers), bounds.ctypes.data,
                    rows.ctypes.data, scratch.data_ptr())
    return step, (rows, bounds, scratch, pointers, tables)


class NativeDelta:
    """One mapping's native deltas: `apply` adds them to y, or returns False when the
    kernel cannot (another dtype or device, strided rows, no library): the caller uses
    torch."""

    __slots__ = ("step", "kept", "function")

    def __init__(self, segments: list[tuple[LoRAModel, int, int]],
                 index: torch.Tensor | None) -> None:
        self.step = self.kept = None
        self.function = cpu_decoder.lora_delta() if ENABLED else None
        if self.function is None:
            return
        tables = [factor_table(model) for model, _, _ in segments]
        if all(t is not None for t in tables):
            step, self.kept = build_step(segments, index, tables)
            self.step = ctypes.addressof(step)
            self.kept = (step, self.kept)

    def apply(self, y: torch.Tensor, x: torch.Tensor, target: int) -> bool:
        if (self.step is None or x.dtype != torch.float32 or y.dtype != torch.float32
                or x.device.type != "cpu" or y.device.type != "cpu"
                or x.stride(1) != 1 or y.stride(1) != 1):
            return False
        status = self.function(self.step, target, x.data_ptr(), x.stride(0), y.data_ptr(),
                               y.stride(0), x.shape[1], y.shape[1], torch.get_num_threads())
        if status:
            raise RuntimeError(f"cpu_decoder_lora_delta failed with status {status}")
        return True
