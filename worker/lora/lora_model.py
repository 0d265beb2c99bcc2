"""One adapter as this rank runs it: per wrapped layer, the two factors of its delta, cut for
tensor parallelism as the layer's own weight is cut.

For a layer holding parts p (q, k, v; gate, up; or one projection) an adapter targets with
A_p [r_p, in] and B_p [out_p, r_p] at scaling s_p, the rank keeps

    a = [A_p; ...]^T                    [in_per_rank, R]   (R = sum of r_p)
    b = block-diag(s_p * B_p rows)^T    [R, out_per_rank]

so `x @ a @ b` is every part's `s_p * (x A_p^T) B_p^T`, placed in its rows of the layer's
output. Column-parallel layers keep A whole and B's rows of their output shard (the base
weight's `output_shard`); row-parallel layers keep A's columns of their input shard and B
whole. Both factors are in the layer's compute dtype (float32 under quantized weights: the
adapter is never quantized).
"""
from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open

from protocol.lora import LoRARequest
from worker.lora.adapter_files import AdapterSpec, ModuleSpec
from worker.lora.targets import LoRATarget

Factors = tuple[torch.Tensor, torch.Tensor]  # (a [in_per_rank, R], b [R, out_per_rank])


@dataclass(slots=True)
class LoRAModel:
    lora_request: LoRARequest
    layers: list[Factors | None]  # by LoRATarget.index; None where it adapts nothing
    nbytes: int
    load_s: float
    native_table: Any = None  # its factors as the native kernel reads them (lora/native_delta.py)
    native_kept: Any = None  # the tensors that table points into
    loop_table: Any = None  # native_table by the native layer loop's slots (lora/native.py)

    @property
    def id(self) -> int:
        return self.lora_request.lora_int_id


def load_lora_model(lora_request: LoRARequest, spec: AdapterSpec,
                    targets: list[LoRATarget]) -> LoRAModel:
    """Read the adapter's tensors and cut them for `targets` (this rank's wrapped layers)."""
    started = time.perf_counter()
    by_layer: dict[tuple[int, str], ModuleSpec] = {(m.layer, m.target): m for m in spec.modules}
    layers: list[Factors | None] = []
    with _tensors(spec) as f:
        for target in targets:
            parts = [(by_layer[(target.layer_index, hf)], key) for hf, key in target.parts
                     if (target.layer_index, hf) in by_layer]
            layers.append(_factors(f, target, parts) if parts else None)
    nbytes = sum(t.numel() * t.element_size() for pair in layers if pair for t in pair)
    return LoRAModel(lora_request, layers, nbytes, time.perf_counter() - started)


def _tensors(spec: AdapterSpec) -> AbstractContextManager:
    """The adapter's tensors by name (`get_tensor`): safetensors, or a GGUF adapter's."""
    if spec.gguf is not None:
        return nullcontext(spec.gguf.read())
    return safe_open(spec.weights_file, framework="pt")


def _factors(f, target: LoRATarget, parts: list[tuple[ModuleSpec, object]]) -> Factors:
    layer, dtype = target.layer, target.layer.compute_dtype
    a_parts = [f.get_tensor(m.a_name).float() for m, _ in parts]
    if target.row_parallel:
        ((m, _),), (a,) = parts, a_parts
        a = a[:, layer.in_start:layer.in_start + layer.in_per_rank]
        b = f.get_tensor(m.b_name).float() * m.scale
        return _final(a.t(), b.t(), dtype)
    rank = sum(m.rank for m, _ in parts)
    b = torch.zeros(layer.out_per_rank, rank)
    column = 0
    for m, key in parts:
        offset, size, start = layer.output_shard(key)
        b_full = f.get_tensor(m.b_name).float()
        b[offset:offset + size, column:column + m.rank] = b_full[start:start + size] * m.scale
        column += m.rank
    return _final(torch.cat(a_parts).t(), b.t(), dtype)


def _final(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> Factors:
    return a.to(dtype).contiguous(), b.to(dtype).contiguous()
