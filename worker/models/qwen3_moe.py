"""Qwen3-MoE (Qwen3-30B-A3B and its kin): Qwen3's attention (per-head q/k RMSNorm, no biases)
with sparse MoE feed-forwards (top-k of `num_experts`, renormalized when `norm_topk_prob`), and
dense ones on `mlp_only_layers` and off the `decoder_sparse_step`."""
from __future__ import annotations

from worker.models.llama import LlamaForCausalLM, MLPFactory
from worker.models.moe import moe_mlp


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    make_mlp: MLPFactory = staticmethod(moe_mlp)
