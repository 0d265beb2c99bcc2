"""The sparse MoE feed-forward shared by the mixture-of-experts architectures (qwen3_moe.py,
mixtral.py, qwen2_moe.py): a replicated router, the routed experts (FusedMoE) and, for
Qwen2-MoE, a shared expert scaled by sigmoid(shared_expert_gate(x)). Which layers are sparse
is the config's (`decoder_sparse_step`, `mlp_only_layers`); the others keep a dense MLP of
`intermediate_size`.

Under tensor parallelism the routed experts and the shared expert each return this rank's
partial sum; the block adds them and all-reduces once.
"""
from __future__ import annotations

import torch
from torch import nn

from worker.distributed.tensor_parallel import TensorParallel
from worker.layers.fused_moe.layer import FusedMoE
from worker.layers.linear import ReplicatedLinear
from worker.layers.quantization.base import QuantizationConfig
from worker.models.config import ModelConfig
from worker.models.llama import LlamaMLP
from worker.models.native_layer_table import NativeMoe


class SparseMoeBlock(nn.Module):
    """x [T, hidden] in the compute dtype (the experts' weight method's) -> [T, hidden]
    float32, reduced across ranks. The router runs in its weights' dtype (its logits as
    Hugging Face computes them), the experts in float32 whatever their weights' dtype."""

    def __init__(self, config: ModelConfig, tp: TensorParallel,
                 quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        moe, hidden = config.moe, config.hidden_size
        self.tp = tp
        self.gate = ReplicatedLinear(hidden, moe.num_experts, tp, quant_config=quant_config,
                                     prefix=f"{prefix}.gate")
        self.experts = FusedMoE(moe.num_experts, moe.top_k, hidden, moe.intermediate_size, tp,
                                moe.norm_topk_prob, quant_config, f"{prefix}.experts")
        if moe.shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(config, tp, quant_config, f"{prefix}.shared_expert",
                                          moe.shared_expert_intermediate_size,
                                          reduce_results=False)
            self.shared_expert_gate = ReplicatedLinear(hidden, 1, tp, quant_config=quant_config,
                                                       prefix=f"{prefix}.shared_expert_gate")

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.experts.compute_dtype

    def native_moe(self) -> NativeMoe | None:
        """The block as the native layer loop runs it (router, bound experts, routing), or
        None: a shared expert, or experts the fused kernel does not take."""
        fused = getattr(self.experts, "fused_experts", None)
        if hasattr(self, "shared_expert") or fused is None or fused.native_layer is None:
            return None
        return NativeMoe(self.gate, fused, self.experts.top_k, self.experts.renormalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x.float(), self.gate(x.to(self.gate.compute_dtype)))
        if hasattr(self, "shared_expert"):
            shared = self.shared_expert(x.to(self.shared_expert.compute_dtype)).float()
            gate = self.shared_expert_gate(x.to(self.shared_expert_gate.compute_dtype))
            out.add_(shared.mul_(torch.sigmoid(gate.float())))
        return self.tp.all_reduce(out)


def moe_mlp(config: ModelConfig, tp: TensorParallel, quant_config: QuantizationConfig | None,
            index: int, prefix: str) -> nn.Module:
    """Layer `index`'s MLP: sparse where the config says, else dense of intermediate_size."""
    if config.moe is not None and config.moe.is_sparse(index):
        return SparseMoeBlock(config, tp, quant_config, prefix)
    return LlamaMLP(config, tp, quant_config, prefix)
