"""Top-k routing as Hugging Face's Qwen2-MoE, Qwen3-MoE and Mixtral routers compute it: a
softmax over all experts in float32, the k most probable, optionally renormalized to sum 1.

On the CPU it runs natively (worker/kernels/moe_routing.h through cpu_decoder.route()): the
function the native layer loop routes with, so both loops route alike to the bit; equal
probabilities go to the lower expert id first. Elsewhere (or without the library) torch's
softmax and topk, equal up to rounding."""
from __future__ import annotations

import torch

from worker.native import cpu_decoder


def select_experts(router_logits: torch.Tensor, top_k: int,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights float32 [T, top_k], expert ids int32 [T, top_k]),
    most probable first."""
    native = cpu_decoder.route() if router_logits.is_cpu and router_logits.dim() == 2 else None
    if native is not None:
        logits = router_logits.to(torch.float32).contiguous()
        tokens, experts = logits.shape
        weights = torch.empty(tokens, top_k, dtype=torch.float32)
        ids = torch.empty(tokens, top_k, dtype=torch.int32)
        if native(logits.data_ptr(), tokens, experts, top_k, int(renormalize),
                  ids.data_ptr(), weights.data_ptr()) == 0:
            return weights, ids
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)
