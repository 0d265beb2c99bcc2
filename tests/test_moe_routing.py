"""MoE routing (worker/layers/fused_moe/router.py): the native top-k (moe_routing.h, the one
both layer loops route with) against torch's softmax and topk: the same experts in the same
order, weights within float32 rounding; equal probabilities go to the lower expert id; the
renormalized weights sum to 1."""
from __future__ import annotations

import pytest
import torch

from worker.layers.fused_moe.router import select_experts
from worker.native import cpu_decoder

pytestmark = pytest.mark.skipif(cpu_decoder.route() is None,
                                reason="the native decoder library cannot be built here")


def _torch(logits: torch.Tensor, k: int, renormalize: bool):
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


@pytest.mark.parametrize("experts,k", [(8, 3), (64, 8), (128, 8), (8, 8), (5, 1)])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_routing_matches_torch(experts, k, renormalize, dtype):
    gen = torch.Generator().manual_seed(experts * 10 + k)
    logits = (torch.randn(37, experts, generator=gen) * 3).to(dtype)
    weights, ids = select_experts(logits, k, renormalize)
    ref_w, ref_ids = _torch(logits, k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (37, k)
    if dtype == torch.float32:  # bf16 logits tie often: compare the chosen probabilities
        assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=2e-6, atol=1e-7)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(37))


def test_ties_go_to_the_lower_expert_and_rows_are_independent():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    weights, ids = select_experts(logits, 2, True)
    assert ids.tolist() == [[1, 2], [0, 1]]
    assert weights.tolist() == [[0.5, 0.5], [0.5, 0.5]]
    one, _ = select_experts(logits[1:], 2, True)
    assert torch.equal(one, weights[1:])


def test_bad_sizes_fall_back_to_torch():
    """k above the experts: torch's own error, as before."""
    with pytest.raises(RuntimeError):
        select_experts(torch.zeros(2, 4), 5, True)
