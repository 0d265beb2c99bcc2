"""The seam LoRA plugs into: a linear layer's weight method, wrapped (vLLM's `lora/layers`).

`LoRALinearMethod.apply` is the base method's product plus the step's LoRA deltas for the rows
of each adapter present (`LoRAContext.mapping`, set once per step by the worker's manager;
None in a step without adapter rows, which then costs one attribute read per layer). In a
row-parallel layer the delta of the rank's input shard joins the partial product before the
all-reduce, so the sum over ranks is the whole delta.

Which layers are wrapped (`lora_targets`): every decoder layer's qkv_proj, o_proj,
gate_up_proj and down_proj, each with the checkpoint projections merged into it (q, k, v;
gate, up) in output order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from worker.layers.linear import LinearBase, RowParallelLinear
from worker.layers.quantization.base import LinearMethodBase, NativeWeights

if TYPE_CHECKING:
    from worker.lora.mapping import LoRAMapping
    from worker.lora.native import NativeLoRA

# wrapped layer -> the checkpoint projections it holds, with their part keys, in output order
_MERGED = {"qkv_proj": (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")),
           "o_proj": (("o_proj", None),),
           "gate_up_proj": (("gate_proj", 0), ("up_proj", 1)),
           "down_proj": (("down_proj", None),)}


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


@dataclass(frozen=True, slots=True)
class LoRATarget:
    """One wrapped layer: `index` is its place in every LoRAModel's `layers`."""

    index: int
    layer_index: int  # the decoder layer
    name: str  # qkv_proj, o_proj, gate_up_proj or down_proj
    layer: LinearBase

    @property
    def parts(self) -> tuple[tuple[str, object], ...]:
        return _MERGED[self.name]

    @property
    def row_parallel(self) -> bool:
        return isinstance(self.layer, RowParallelLinear)


class LoRALinearMethod(LinearMethodBase):
    """`base`'s weights and product, plus the LoRA delta of target `index`."""

    def __init__(self, base: LinearMethodBase, context: LoRAContext, index: int) -> None:
        self.base, self.context, self.index = base, context, index

    def create_weights(self, layer: nn.Module, in_per_rank: int, out_per_rank: int) -> None:
        self.base.create_weights(layer, in_per_rank, out_per_rank)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.base.process_weights_after_loading(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        y = self.base.apply(layer, x, bias)
        mapping = self.context.mapping
        if mapping is not None:
            mapping.add_delta(y, x, self.index)
        return y

    def compute_dtype(self, layer: nn.Module) -> torch.dtype:
        return self.base.compute_dtype(layer)

    def native_weights(self, layer: nn.Module) -> NativeWeights | None:
        """The base's: the native layer loop adds the deltas itself (`native_guard`'s
        `native_step`)."""
        return self.base.native_weights(layer)

    @property
    def native_guard(self) -> LoRAContext:
        return self.context


def wrap_lora_layers(model: nn.Module, context: LoRAContext) -> list[LoRATarget]:
    """Wrap the weight method of every layer an adapter may target; the targets in order."""
    targets: list[LoRATarget] = []
    for name, module in model.named_modules():
        short = name.rsplit(".", 1)[-1]
        if short not in _MERGED or not isinstance(module, LinearBase):
            continue
        layer_index = int(name.split(".layers.")[1].split(".")[0])
        target = LoRATarget(len(targets), layer_index, short, module)
        module.quant_method = LoRALinearMethod(module.quant_method, context, target.index)
        targets.append(target)
    return targets
