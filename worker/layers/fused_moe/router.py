"""Top-k routing as Hugging Face's Qwen2-MoE, Qwen3-MoE and Mixtral routers compute it: a
softmax over all experts in float32, the k most probable, optionally renormalized to sum 1."""
from __future__ import annotations

import torch


def select_experts(router_logits: torch.Tensor, top_k: int,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights float32 [T, top_k], expert ids int32 [T, top_k]),
    most probable first."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)
