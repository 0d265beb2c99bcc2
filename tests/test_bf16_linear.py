"""bf16 linears multiplied in float32 where this CPU's FMAs outrun its bf16 products
(worker/layers/bf16_linear.py): the route's switch, the products against a float64
reference, and a bf16 model on that route (float32 activations around its linears, bf16
weights and KV cache, greedy tokens that follow float32's up to bf16 near-ties)."""
from __future__ import annotations

import pytest
import torch
from model_utils import model_dir_for
from test_compute_dtype import check_bf16_greedy_follows_float32

from protocol import EngineConfig
from worker.device import ENV_OVERRIDE
from worker.layers import bf16_linear, onednn_linear
from worker.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(not onednn_linear.enabled(torch.device("cpu")),
                                reason="no oneDNN packing (torch without it, or DELTASERVE_ONEDNN=0): "
                                "bf16 products only")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return model_dir_for(tmp_path_factory, "llama", dtype=torch.bfloat16)


def test_switch_forces_either_route(monkeypatch):
    for forced in (bf16_linear.FLOAT32, bf16_linear.BFLOAT16):
        monkeypatch.setenv(bf16_linear.ENV_SWITCH, forced)
        assert bf16_linear.route() == forced
    monkeypatch.setenv(bf16_linear.ENV_SWITCH, "fp8")
    with pytest.raises(ValueError, match=bf16_linear.ENV_SWITCH):
        bf16_linear.route()
    monkeypatch.delenv(bf16_linear.ENV_SWITCH)
    assert bf16_linear.route() in (bf16_linear.FLOAT32, bf16_linear.BFLOAT16)


def test_float32_copy_only_for_bf16_on_the_float32_route(monkeypatch):
    w = torch.randn(64, 96).bfloat16()
    monkeypatch.setenv(bf16_linear.ENV_SWITCH, bf16_linear.BFLOAT16)
    assert bf16_linear.float32_copy(w) is None
    monkeypatch.setenv(bf16_linear.ENV_SWITCH, bf16_linear.FLOAT32)
    assert bf16_linear.float32_copy(w.float()) is None
    copy = bf16_linear.float32_copy(w)
    assert copy is not None and copy.is_mkldnn and copy.dtype == torch.float32


@pytest.mark.parametrize("rows", [1, 7, bf16_linear.FLOAT32_ROWS - 1, bf16_linear.FLOAT32_ROWS,
                                  77, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_products_match_reference(monkeypatch, rows, bias):
    """From FLOAT32_ROWS rows: x · W.float()ᵀ to float32 rounding (a float32 x used as it is);
    below: bf16 products of x rounded to bf16 (bf16-level error). float32 out either way."""
    monkeypatch.setenv(bf16_linear.ENV_SWITCH, bf16_linear.FLOAT32)
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(160, 256, generator=gen).bfloat16()
    b = torch.randn(160, generator=gen).bfloat16() if bias else None
    x = torch.randn(rows, 256, generator=gen)
    out = bf16_linear.linear(x, onednn_linear.pack(w), bf16_linear.float32_copy(w), b)
    assert out.dtype == torch.float32 and out.shape == (rows, 160)
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    err = (out.double() - ref).abs().max().item() / ref.abs().max().item()
    if rows >= bf16_linear.FLOAT32_ROWS:
        assert err < 1e-5
    else:
        assert err < 3e-2
        rounded = x.bfloat16().double() @ w.double().T + (0 if b is None else b.double())
        assert (out.double() - rounded).abs().max().item() / ref.abs().max().item() < 1e-2
    bf16_in = bf16_linear.linear(x.bfloat16(), onednn_linear.pack(w), bf16_linear.float32_copy(w), b)
    assert bf16_in.dtype == torch.float32


def _runner(model_dir: str) -> ModelRunner:
    return ModelRunner(EngineConfig(model=model_dir, dtype="bfloat16", num_gpu_blocks_override=8))


def test_float32_route_layout(model_dir, monkeypatch):
    """Layers take float32 activations; weights, KV cache and the tied table stay bf16."""
    monkeypatch.setenv(ENV_OVERRIDE, "1")
    monkeypatch.setenv(bf16_linear.ENV_SWITCH, bf16_linear.FLOAT32)
    runner = _runner(model_dir)
    assert runner.dtype == torch.bfloat16
    assert {t.dtype for kv in runner.kv_caches for t in kv} == {torch.bfloat16}
    for layer in runner.model.model.layers:
        assert layer.dtype == torch.float32
        qkv = layer.self_attn.qkv_proj
        assert qkv.cache_dtype == torch.bfloat16 and qkv.weight.dtype == torch.bfloat16
        assert qkv.weight_float32 is not None
    assert runner.model.lm_head.weight_float32 is not None
    monkeypatch.setenv(bf16_linear.ENV_SWITCH, bf16_linear.BFLOAT16)
    runner = _runner(model_dir)
    for layer in runner.model.model.layers:
        assert layer.dtype == torch.bfloat16 and layer.self_attn.qkv_proj.weight_float32 is None


@pytest.mark.parametrize("route", [bf16_linear.FLOAT32, bf16_linear.BFLOAT16])
def test_greedy_follows_float32(model_dir, monkeypatch, route):
    """Both routes: every divergence from float32 greedy happens at a bf16-level near-tie of
    float32's logits; most requests never diverge (prefill rows take the float32 copies,
    one-request decode rows the bf16 weights)."""
    monkeypatch.setenv(ENV_OVERRIDE, "1")
    monkeypatch.setenv(bf16_linear.ENV_SWITCH, route)
    check_bf16_greedy_follows_float32(model_dir)


def _route_rank(rank: int, init_method: str, out_dir: str) -> None:
    """Rank 0 forced to the float32 route, rank 1 to bf16 (as a rank on a loaded CPU could
    measure): after `agree` both take bf16, the route every rank can take."""
    import os

    from worker.distributed.tensor_parallel import TensorParallel
    os.environ[bf16_linear.ENV_SWITCH] = (bf16_linear.FLOAT32, bf16_linear.BFLOAT16)[rank]
    torch.set_num_threads(1)
    tp = TensorParallel.initialize(rank, 2, init_method, torch.device("cpu"))
    own = bf16_linear.route()
    bf16_linear.agree(tp)
    torch.save([own, bf16_linear.route()], os.path.join(out_dir, f"rank{rank}.pt"))
    tp.shutdown()


def test_tensor_parallel_ranks_agree_on_one_route(tmp_path):
    """A TP=2 group whose ranks measured differently once summed float32 activations with
    bf16 ones in gloo and aborted; `agree` gives every rank the same route."""
    from test_shm_all_reduce import _run_group
    per_rank = _run_group(tmp_path, _route_rank)
    assert [own for own, _ in per_rank] == [bf16_linear.FLOAT32, bf16_linear.BFLOAT16]
    assert [agreed for _, agreed in per_rank] == [bf16_linear.BFLOAT16] * 2
