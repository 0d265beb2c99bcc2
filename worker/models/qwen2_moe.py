"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases) with sparse MoE
feed-forwards whose routed experts (top-k, renormalized when `norm_topk_prob`) are joined by a
shared expert of `shared_expert_intermediate_size`, scaled per token by
sigmoid(shared_expert_gate(x))."""
from __future__ import annotations

from worker.models.llama import LlamaForCausalLM, MLPFactory
from worker.models.moe import moe_mlp


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    make_mlp: MLPFactory = staticmethod(moe_mlp)
