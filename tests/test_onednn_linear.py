"""oneDNN-packed CPU linear layers (worker/layers/onednn_linear.py) against F.linear."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.distributed.tensor_parallel import TensorParallel
from worker.layers import onednn_linear
from worker.layers.linear import QKVParallelLinear, RowParallelLinear

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not onednn_linear.enabled(CPU),
                                reason="torch here has no oneDNN (mkldnn) linear")
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# oneDNN packs bfloat16 weights only where the CPU has avx512bw+vl or avx_ne_convert (AMD EPYC
# hosts with AVX2 alone have neither); `pack` then keeps the dense weight.
BF16_PACKS = torch.ops.mkldnn._is_mkldnn_bf16_supported()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_matches_dense(dtype, rows):
    if dtype == torch.bfloat16 and not BF16_PACKS:
        pytest.skip("this CPU has no oneDNN bfloat16 path (needs avx512bw/vl or avx_ne_convert)")
    torch.manual_seed(rows)
    weight, bias = torch.randn(96, 80).to(dtype), torch.randn(96).to(dtype)
    x = torch.randn(rows, 80).to(dtype)
    packed = onednn_linear.pack(weight)
    assert packed.is_mkldnn and packed.shape == weight.shape and packed.dtype == dtype
    got = onednn_linear.linear(x, packed, bias)
    want = F.linear(x.float(), weight.float(), bias.float())
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


def test_strided_and_batched_inputs():
    weight = torch.randn(48, 32)
    packed = onednn_linear.pack(weight)
    wide = torch.randn(10, 64)[:, 16:48]  # a column slice: row stride 64
    torch.testing.assert_close(onednn_linear.linear(wide, packed), F.linear(wide, weight))
    batched = torch.randn(3, 5, 32)
    torch.testing.assert_close(onednn_linear.linear(batched, packed), F.linear(batched, weight))


def test_float16_stays_dense():
    weight = torch.randn(8, 8).half()
    assert onednn_linear.pack(weight) is weight  # no packed float16 path is relied on


def test_unpackable_weight_stays_dense(monkeypatch):
    """Where oneDNN refuses a dtype on this CPU (bfloat16 on an AVX2-only host), the layer
    keeps its dense weight and F.linear."""
    def refuse(weight, batch_hint):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support")
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    weight, x = torch.randn(16, 8).bfloat16(), torch.randn(3, 8).bfloat16()
    assert onednn_linear.pack(weight) is weight
    torch.testing.assert_close(onednn_linear.linear(x, weight), F.linear(x, weight))


def test_switch_off(monkeypatch):
    monkeypatch.setenv(onednn_linear.ENV_SWITCH, "0")
    assert not onednn_linear.enabled(CPU)


def test_layers_pack_after_loading():
    """A tensor-parallel layer's forward is unchanged by packing (rank 0 of 1)."""
    torch.manual_seed(0)
    tp = TensorParallel()
    qkv, row = QKVParallelLinear(32, 8, 4, 2, tp, bias=True), RowParallelLinear(32, 16, tp)
    for layer in (qkv, row):
        layer.weight.data.normal_()
        if layer.bias is not None:
            layer.bias.data.normal_()
        x = torch.randn(5, 32)
        dense = layer(x)
        layer.quant_method.process_weights_after_loading(layer)
        assert layer.weight.is_mkldnn
        torch.testing.assert_close(layer(x), dense)
