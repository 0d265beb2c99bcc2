"""16-bit dense linear layers (UnquantizedLinearMethod) through gguf_matmul's dense driver on
the plain weight rows: up to gguf_ops.DENSE_ROWS rows where oneDNN does not pack the weight,
every row count (and no packed bf16 copy) where this CPU's bf16 products are slow, the float32
copy from bf16_linear.dense_float32_rows() rows on the float32 route. Each product equals the
float32 product of the 16-bit values up to summation order, rounded to the compute dtype. Both kinds of host are
laid out here whatever this one is, by setting what the start-up probe would have found."""
from __future__ import annotations

import pytest
import torch
from a8_utils import load_ops

from worker.distributed.tensor_parallel import TensorParallel
from worker.layers import bf16_linear, onednn_linear
from worker.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from worker.native import gguf_ops

U = 2.0 ** -24  # float32 unit roundoff


@pytest.fixture(scope="module")
def ops() -> gguf_ops.GgufOps:
    return load_ops()


@pytest.fixture
def host(monkeypatch):
    """host(slow, route): lay layers out as where the probe found this CPU's bf16 products
    slow or not, on the given route (bfloat16: 16-bit outputs)."""
    def set_host(slow: bool, route: str = bf16_linear.BFLOAT16) -> None:
        monkeypatch.setenv(bf16_linear.ENV_SWITCH, route)
        monkeypatch.setattr(bf16_linear, "products_slow",
                            lambda dtype: slow and dtype == torch.bfloat16)
    return set_host


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _layers(dtype: torch.dtype) -> list[torch.nn.Module]:
    """A biased QKV projection (Qwen2's), an o projection and a router, K = 256 / 384 / 256
    (several 32-element blocks), N = 384 / 256 / 72 (not a multiple of the 4-row groups for
    the router); all past the library's threading threshold at one row but the router."""
    tp = TensorParallel()
    layers = [QKVParallelLinear(256, 32, 8, 2, tp, bias=True), RowParallelLinear(384, 256, tp),
              ReplicatedLinear(256, 72, tp)]
    gen = torch.Generator().manual_seed(0)
    for layer in layers:
        layer.weight.data = (torch.randn(layer.weight.shape, generator=gen) * 0.1).to(dtype)
        if layer.bias is not None:
            layer.bias.data = torch.randn(layer.bias.shape, generator=gen).to(dtype)
        layer.quant_method.process_weights_after_loading(layer)
    return layers


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
           dtype: torch.dtype) -> None:
    """y (dtype) = round(x · wᵀ + bias) up to float32 summation and one rounding."""
    assert y.dtype == dtype and y.shape == (x.shape[0], w.shape[0])
    x64, w64 = x.double(), w.double()
    want = x64 @ w64.T + (0 if bias is None else bias.double())
    bound = x.shape[1] * U * (x64.abs() @ w64.abs().T) + 2.0 ** -8 * want.abs()
    worst = ((y.double() - want).abs() - bound).max().item()
    assert worst <= 0.0, f"error exceeds the bound by {worst:g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_few_rows_read_the_plain_weight(ops, host, threads, dtype, num_threads):
    """1..DENSE_ROWS rows: the dense driver on the kept plain rows, exact up to summation
    order, and the same bits with 1 and 2 threads (each output summed by one thread)."""
    host(slow=True)
    threads(num_threads)
    for layer in _layers(dtype):
        assert layer.dense_ops is not None and layer.weight_rows.dtype == dtype
        w, bias = layer.weight_rows, layer.bias
        for rows in range(1, gguf_ops.DENSE_ROWS + 1):
            x = torch.randn(rows, w.shape[1]).to(dtype)
            y = layer(x)
            _check(y, x.float(), w.float(), bias, dtype)
            threads(3 - num_threads)
            assert torch.equal(layer(x), y)
            threads(num_threads)


def test_slow_bf16_products_keep_one_copy_for_every_row_count(ops, host, threads):
    """Where bf16 products are slow, a bf16 layer holds its plain rows only and the dense
    driver takes every row count (bf16 out on the bfloat16 route)."""
    host(slow=True)
    threads(2)
    for layer in _layers(torch.bfloat16):
        assert not layer.weight.is_mkldnn and layer.weight.data_ptr() == layer.weight_rows.data_ptr()
        for rows in (gguf_ops.DENSE_ROWS + 5, 40, 300):
            x = torch.randn(rows, layer.weight_rows.shape[1]).bfloat16()
            _check(layer(x), x.float(), layer.weight_rows.float(), layer.bias, torch.bfloat16)


def test_float32_route_dense_below_the_copy(ops, host, threads):
    """On the float32 route with slow bf16 products: below dense_float32_rows() the dense
    driver on the bf16 rows (bf16_panels from 9 rows), from it the packed float32 copy;
    float32 out, x · W.float()ᵀ to float32 sums."""
    if not onednn_linear.enabled(torch.device("cpu")):
        pytest.skip("no oneDNN packing (DELTASERVE_ONEDNN=0 or torch without it): no float32 copy")
    host(slow=True, route=bf16_linear.FLOAT32)
    threads(2)
    for layer in _layers(torch.bfloat16):
        assert layer.weight_float32 is not None and not layer.weight.is_mkldnn
        bound = bf16_linear.dense_float32_rows()
        for rows in (1, 31, 32, bound - 1, bound, 100):
            x = torch.randn(rows, layer.weight_rows.shape[1])
            y = layer(x)
            assert y.dtype == torch.float32
            _check(y.float(), x, layer.weight_rows.float(), layer.bias, torch.float32)


def test_fast_bf16_products_keep_onednn_only(ops, host, threads):
    """Where bf16 products are not slow and oneDNN packs bf16, the packed copy is the only one
    and serves every row count; without packing the plain rows serve (dense up to DENSE_ROWS)."""
    host(slow=False)
    threads(2)
    for layer in _layers(torch.bfloat16):
        packed = layer.weight.is_mkldnn
        assert (layer.dense_ops is None) == packed
        w = onednn_linear.linear(torch.eye(layer.weight.shape[1]).bfloat16(), layer.weight).T \
            if packed else layer.weight.data
        for rows in (1, gguf_ops.DENSE_ROWS + 5):
            x = torch.randn(rows, w.shape[1]).bfloat16()
            _check(layer(x), x.float(), w.float(), layer.bias, torch.bfloat16)


def test_float32_and_odd_widths_stay_off_the_dense_path(ops, host):
    host(slow=True)
    tp = TensorParallel()
    f32, odd = RowParallelLinear(64, 16, tp), RowParallelLinear(40, 16, tp)
    odd.weight.data = odd.weight.data.bfloat16()
    for layer in (f32, odd):
        layer.weight.data.normal_()
        layer.quant_method.process_weights_after_loading(layer)
        assert layer.dense_ops is None and layer.weight_rows is None
        x = torch.randn(2, layer.weight.shape[1]).to(layer.weight.dtype)
        assert layer(x).shape == (2, 16)
