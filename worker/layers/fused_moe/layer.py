"""The routed experts of one MoE layer as one module: weights from its quantization config's
MoE method, every product through the fused kernel (worker/native/fused_moe.py).

Tensor parallelism splits each expert's intermediate dimension, as vLLM's TP MoE does: rank r
holds rows [r * I_r, (r + 1) * I_r) of every expert's gate and up projections and the same
columns of its down projection (I_r = moe_intermediate_size / tp). Every rank routes every
token alike (the router is replicated) and returns its partial sum; the caller all-reduces
once per layer (after adding a shared expert's partial sum, if any).

Checkpoints name experts one by one (`experts.{e}.{gate,up,down}_proj.weight`, Hugging Face's
layout), stacked (`experts.{gate,up,down}_proj.weight` [E, out, in]: GGUF's `*_exps`), or
fused (`experts.gate_up_proj` [E, 2 * I, H] and `experts.down_proj` [E, H, I]: transformers
5's in-memory layout); `expert_weights` maps each to a parameter and a shard, and the loader
(worker/models/loader.py) passes `(expert or None for all, shard)` to `weight_loader`.
"""
from __future__ import annotations

import torch
from torch import nn

from worker.distributed.tensor_parallel import TensorParallel
from worker.layers.fused_moe.router import select_experts
from worker.layers.quantization.base import QuantizationConfig, ShardDims
from worker.layers.quantization.unquantized import UnquantizedConfig


class FusedMoE(nn.Module):
    # checkpoint projection -> (parameter, shard): w1 gate, w3 up, w13 both (gate rows
    # first), w2 down
    expert_weights = {"gate_proj": ("w13_weight", "w1"), "up_proj": ("w13_weight", "w3"),
                      "gate_up_proj": ("w13_weight", "w13"), "down_proj": ("w2_weight", "w2")}

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 tp: TensorParallel, renormalize: bool,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"{prefix}: top_k={top_k} of {num_experts} experts")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.tp = tp
        self.inter_per_rank = tp.shard(intermediate_size, "moe_intermediate_size")
        self.in_start = tp.rank * self.inter_per_rank  # down's first input feature here
        self.quant_method = (quant_config or UnquantizedConfig()).get_moe_method(self, prefix)
        self.quant_method.create_weights(self, num_experts, hidden_size, self.inter_per_rank)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.quant_method.compute_dtype(self)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      part: tuple[int | None, str]) -> None:
        """`loaded` is one expert's [out, in] matrix (part = (e, shard)) or all experts'
        stacked [E, out, in] (part = (None, shard))."""
        expert, shard = part
        if expert is None:
            if loaded.shape[0] != self.num_experts:
                raise ValueError(f"stacked experts hold {loaded.shape[0]} experts, the model "
                                 f"{self.num_experts}")
            for e in range(self.num_experts):
                self._load_expert(param.data[e], param.shard_dims, loaded[e], shard)
        elif not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} of a layer with {self.num_experts} experts")
        else:
            self._load_expert(param.data[expert], param.shard_dims, loaded, shard)

    def _load_expert(self, dst: torch.Tensor, dims: ShardDims, w: torch.Tensor,
                     shard: str) -> None:
        size, start = self.inter_per_rank, self.in_start
        if shard == "w2":
            dst.copy_(dims.input(w, start, size))
            return
        halves = {"w1": (w,), "w3": (w,), "w13": w.chunk(2)}[shard]
        offsets = (size,) if shard == "w3" else (0, size)
        for offset, rows in zip(offsets, halves):
            dims.output(dst, offset, size).copy_(dims.output(rows, start, size))

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] float32 (rows contiguous), router_logits [T, E] -> this rank's
        partial sum [T, hidden] float32 (not reduced)."""
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        return self.quant_method.apply(self, x, weights, ids)
