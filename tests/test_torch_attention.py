"""The torch attention backend against a dense float64 reference, on NaN-poisoned caches."""
from __future__ import annotations

import pytest
import torch
from attention_cases import make_case, reference

from worker.attention.torch_backend import TorchAttentionBackend

SPECS = {
    "decode": [(0, 1), (15, 1), (16, 1), (17, 1), (100, 1), (31, 1)],
    "prefill": [(0, 5), (0, 16), (0, 33)],
    "prefill_with_context": [(16, 5), (7, 9), (32, 32), (48, 1), (3, 40)],
    "mixed": [(40, 1), (0, 7), (23, 1), (16, 16), (1, 1), (64, 3)],
}
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def _run(case):
    backend = TorchAttentionBackend()
    backend.plan(case.metadata)
    return backend.forward(case.query, case.key, case.value, case.k_cache, case.v_cache,
                           case.metadata, case.scale)


@pytest.mark.parametrize("kind", sorted(SPECS))
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1)])  # GQA ratios 1, 4, 8
def test_matches_reference(kind, heads):
    case = make_case(SPECS[kind], num_heads=heads[0], num_kv_heads=heads[1], seed=len(kind))
    out = _run(case)
    n = case.query.shape[0] - case.num_padding
    torch.testing.assert_close(out[:n].double(), reference(case), atol=TOL[torch.float32],
                               rtol=TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 32)])
def test_low_precision_and_shapes(dtype, head_dim, block_size):
    case = make_case(SPECS["mixed"], num_heads=8, num_kv_heads=2, head_dim=head_dim,
                     block_size=block_size, dtype=dtype, seed=3)
    out = _run(case)
    torch.testing.assert_close(out.double(), reference(case), atol=TOL[dtype], rtol=TOL[dtype])


def test_writes_new_kv_into_slots_and_skips_padding():
    case = make_case([(5, 3), (0, 1)], num_padding=2, seed=4)
    cache_before = case.k_cache.clone()
    out = _run(case)
    flat = case.k_cache.view(-1, *case.k_cache.shape[2:])
    real = case.metadata.slot_mapping[:4]
    torch.testing.assert_close(flat[real], case.key[:4])
    changed = ~torch.isclose(case.k_cache, cache_before, equal_nan=True)
    assert int(changed[1:].any(-1).any(-1).sum()) == 4  # exactly the 4 real slots were written
    assert (case.k_cache[0, 0] == 0).all()  # decode padding reads the zeroed null slot
    assert torch.isfinite(out[:4]).all()


def test_decode_groups_bound_memory(monkeypatch):
    import worker.attention.torch_backend as ta
    monkeypatch.setattr(ta, "_DECODE_GATHER_ELEMENTS", 1)  # one request per group
    case = make_case(SPECS["decode"], seed=5)
    torch.testing.assert_close(_run(case).double(), reference(case), atol=1e-5, rtol=1e-5)
