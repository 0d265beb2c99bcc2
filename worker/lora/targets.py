"""The layers an adapter may target: every decoder layer's qkv_proj, o_proj, gate_up_proj and
down_proj, each with the checkpoint projections merged into it (q, k, v; gate, up) in output
order."""
from __future__ import annotations

from dataclasses import dataclass

from worker.layers.linear import LinearBase, RowParallelLinear

# wrapped layer -> the checkpoint projections it holds, with their part keys, in output order
MERGED = {"qkv_proj": (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")),
          "o_proj": (("o_proj", None),),
          "gate_up_proj": (("gate_proj", 0), ("up_proj", 1)),
          "down_proj": (("down_proj", None),)}


@dataclass(frozen=True, slots=True)
class LoRATarget:
    """One wrapped layer: `index` is its place in every LoRAModel's `layers`."""

    index: int
    layer_index: int  # the decoder layer
    name: str  # qkv_proj, o_proj, gate_up_proj or down_proj
    layer: LinearBase

    @property
    def parts(self) -> tuple[tuple[str, object], ...]:
        return MERGED[self.name]

    @property
    def row_parallel(self) -> bool:
        return isinstance(self.layer, RowParallelLinear)
