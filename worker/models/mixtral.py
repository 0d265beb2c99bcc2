"""Mixtral: Mistral's attention with a sparse MoE feed-forward on every layer (top-k of
`num_local_experts`, always renormalized). Its checkpoints name the block `block_sparse_moe`
and the experts' projections w1 (gate), w3 (up) and w2 (down); they load under the common
MoE names (worker/models/moe.py)."""
from __future__ import annotations

from worker.models.llama import LlamaForCausalLM, MLPFactory
from worker.models.moe import moe_mlp


class MixtralForCausalLM(LlamaForCausalLM):
    checkpoint_renames = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.",
                          ".w3.": ".up_proj.", ".w2.": ".down_proj."}
    make_mlp: MLPFactory = staticmethod(moe_mlp)
