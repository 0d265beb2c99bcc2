"""One step's adapter rows and the batched LoRA delta (the punica/BGMV idea on a CPU).

Token rows are grouped by adapter and each adapter present costs one product pair per wrapped
layer, `(x_rows @ a) @ b`, over all its rows at once, whatever their requests; base-model rows
cost nothing. Weights are never merged into the base.

Float32 CPU rows take one native call per layer for all adapters (lora/native_delta.py);
other dtypes, or where the library cannot be built, the torch ops below, in two layouts:
- every adapter's rows are one contiguous run of the step (a lone adapter, or requests of each
  adapter next to each other): the products read and add to slices of x and y in place;
- otherwise the adapter rows are gathered once per layer in adapter order
  (`index`), multiplied per adapter into one buffer, and scattered back with one
  `index_add_`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from worker.lora.lora_model import LoRAModel
from worker.lora.native_delta import NativeDelta


@dataclass(slots=True)
class LoRAMapping:
    # (adapter, first row, end row): rows of the step (index None) or of the gathered rows
    segments: list[tuple[LoRAModel, int, int]]
    index: torch.Tensor | None  # [num_adapter_rows] int64 step rows, adapter by adapter
    native: Any = None  # the native layer loop's form of it, made on first use (lora/native.py)
    kernel: NativeDelta | None = None  # the Python loop's native delta, made on first use

    @staticmethod
    def build(request_ids: np.ndarray, counts: np.ndarray, models: dict[int, LoRAModel],
              device: torch.device) -> LoRAMapping | None:
        """request_ids: [num_reqs] each scheduled request's adapter id (0: the base model);
        counts: its tokens in this step. None when no row has an adapter."""
        token_ids = np.repeat(request_ids, counts)
        present = [int(i) for i in dict.fromkeys(request_ids.tolist()) if i]
        if not present:
            return None
        rows = [np.flatnonzero(token_ids == i) for i in present]
        if all(r[-1] - r[0] + 1 == len(r) for r in rows):
            return LoRAMapping([(models[i], int(r[0]), int(r[-1]) + 1)
                                for i, r in zip(present, rows)], None)
        segments, start = [], 0
        for i, r in zip(present, rows):
            segments.append((models[i], start, start + len(r)))
            start += len(r)
        return LoRAMapping(segments, torch.from_numpy(np.concatenate(rows)).to(device))

    def add_delta(self, y: torch.Tensor, x: torch.Tensor, target: int) -> None:
        """y [num_tokens, out] += each adapter's delta of wrapped layer `target` on its rows
        of x [num_tokens, in]."""
        if self.kernel is None:
            self.kernel = NativeDelta(self.segments, self.index)
        if self.kernel.apply(y, x, target):
            return
        if self.index is None:
            for model, start, end in self.segments:
                factors = model.layers[target]
                if factors is not None:
                    a, b = factors
                    y[start:end].addmm_(x[start:end].mm(a), b)
            return
        xs = x.index_select(0, self.index)
        out = torch.empty(len(self.index), y.shape[1], dtype=y.dtype, device=y.device)
        for model, start, end in self.segments:
            factors = model.layers[target]
            if factors is None:
                out[start:end].zero_()
            else:
                a, b = factors
                torch.mm(xs[start:end].mm(a), b, out=out[start:end])
        y.index_add_(0, self.index, out)

    @property
    def num_adapters(self) -> int:
        return len(self.segments)
