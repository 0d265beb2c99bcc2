"""The seam LoRA plugs into: a linear layer's weight method, wrapped (vLLM's `lora/layers`).

`LoRALinearMethod.apply` is the base method's product plus the step's LoRA deltas for the rows
of each adapter present (`LoRAContext.mapping`, set once per step by the worker's manager;
None in a step without adapter rows, which then costs one attribute read per layer). In a
row-parallel layer the delta of the rank's input shard joins the partial product before the
all-reduce, so the sum over ranks is the whole delta.
Which layers are wrapped: worker/lora/targets.py.
"""
from __future__ import annotations

import torch
from torch import nn

from worker.layers.linear import LinearBase
from worker.layers.quantization.base import LinearMethodBase, NativeWeights
from worker.lora.context import LoRAContext
from worker.lora.targets import MERGED, LoRATarget


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

    def cache_dtype(self, layer: nn.Module) -> torch.dtype:
        return self.base.cache_dtype(layer)

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
        if short not in MERGED or not isinstance(module, LinearBase):
            continue
        layer_index = int(name.split(".layers.")[1].split(".")[0])
        target = LoRATarget(len(targets), layer_index, short, module)
        module.quant_method = LoRALinearMethod(module.quant_method, context, target.index)
        targets.append(target)
    return targets
