"""bf16_panels (worker/kernels/bf16_panels.h): gguf_matmul's dense driver for bf16 rows at a
decode batch's row count (9 rows up to x of PANEL_X_BYTES), in the native, AVX2 and baseline
builds: x · W.float()ᵀ within float32 summation error of a float64 reference, the same bits
with 1 and 2 threads, `accumulate` adding to y; and the bound from which a bf16 layer on the
float32 route takes oneDNN's float32 copy instead (bf16_linear.dense_float32_rows)."""
from __future__ import annotations

import pytest
import torch
from a8_utils import load_ops

from worker.layers import bf16_linear
from worker.native import build as native_build
from worker.native import gguf_ops

U = 2.0 ** -24  # float32 unit roundoff
PANEL_X_BYTES = 1 << 20  # bf16_panels.h's


def _assert_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y = x · wᵀ up to float32 summation over K (and the inputs' exactness in float32)."""
    x64, w64 = x.double(), w.double()
    want = x64 @ w64.T
    bound = (x.shape[1] + 2) * U * (x64.abs() @ w64.abs().T)
    worst = ((y.double() - want).abs() - bound).max().item()
    assert worst <= 0.0, f"error exceeds the bound by {worst:g}"


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


# (rows, N, K): row counts around the 16- and 32-row tiles, N not a multiple of the 12- or
# 24-row panels, K of one 64-element block up to x at PANEL_X_BYTES (128 x 2048 floats); from
# GUIDED_PANELS (1024) panels the threads take guided chunks (an LM head's shape)
CASES = [(m, 77, 64) for m in (9, 15, 16, 17, 31, 32, 33, 47, 64, 65, 100, 128)] + [
    (32, 1000, 1024), (64, 300, 2048), (128, 131, 2048), (40, 2500, 256), (32, 12300, 64),
    (16, 24600, 64), (48, 12290, 64)]


@pytest.mark.parametrize("m,n,k", CASES)
def test_panels_equal_the_float64_product(threads, m, n, k):
    ops = load_ops()
    gen = torch.Generator().manual_seed(m * 7919 + n + k)
    w = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(m, k, generator=gen)
    threads(1)
    one = ops.dense_matmul(x, w)
    threads(2)
    two = ops.dense_matmul(x, w)
    _assert_close(one, x, w.float())
    assert torch.equal(one, two)  # each output is one thread's sum over K, in a fixed order


def test_panels_accumulate_and_strided_rows(threads):
    """gguf_matmul's entry point on a row slice of a bigger weight (row stride past K), x rows
    with a stride, y rows with a stride, added to with accumulate."""
    ops = load_ops()
    gen = torch.Generator().manual_seed(3)
    big = torch.randn(90, 320, generator=gen).bfloat16()
    w = big[5:80, :256]  # 75 rows of 256, row stride 320 elements
    x = torch.randn(40, 300, generator=gen)[:, :256]
    y0 = torch.randn(40, 100, generator=gen)
    y = y0.clone()
    threads(2)
    status = ops._matmul(gguf_ops.DENSE_CODES[torch.bfloat16], w.data_ptr(), 320 * 2,
                         x.data_ptr(), 300, y.data_ptr(), 100, 40, 75, 256, 1, 2)
    assert status == 0
    _assert_close(y[:, :75] - y0[:, :75], x, w.float())
    assert torch.equal(y[:, 75:], y0[:, 75:])
    assert torch.equal(y[:, :75], y0[:, :75] + ops.dense_matmul(x, w.contiguous()))


@pytest.mark.parametrize("march,width", [("x86-64-v3", 8), ("x86-64", 4)])
def test_portable_builds(threads, march, width):
    """The AVX2 (8-lane panels: 6 rows x 16, 12 x 8) and baseline builds of the same kernel."""
    try:
        ops = gguf_ops.load(march)
    except native_build.CompilerUnavailable as e:
        pytest.skip(f"no C++ compiler: {e}")
    assert ops.simd_width == width
    gen = torch.Generator().manual_seed(width)
    for m, n, k in [(9, 29, 64), (16, 50, 128), (33, 29, 96), (64, 131, 512), (33, 6200, 64)]:
        w = torch.randn(n, k, generator=gen).bfloat16()
        x = torch.randn(m, k, generator=gen)
        threads(1)
        one = ops.dense_matmul(x, w)
        threads(2)
        _assert_close(one, x, w.float())
        assert torch.equal(ops.dense_matmul(x, w), one)


def test_past_the_panels_the_strips_driver(threads):
    """x past PANEL_X_BYTES (and rows up to DENSE_ROWS) keep the other drivers: still within
    summation error."""
    ops = load_ops()
    gen = torch.Generator().manual_seed(5)
    k = 512
    w = torch.randn(70, k, generator=gen).bfloat16()
    threads(2)
    for m in (gguf_ops.DENSE_ROWS, PANEL_X_BYTES // (4 * k) + 1):
        x = torch.randn(m, k, generator=gen)
        _assert_close(ops.dense_matmul(x, w), x, w.float())


def test_the_float32_copy_bound(monkeypatch):
    """From PANEL_FLOAT32_ROWS rows with AVX-512 panels (measured), FLOAT32_ROWS with others;
    DELTASERVE_BF16_COPY_ROWS forces it, a bad value is an error."""
    ops = gguf_ops.native()
    expected = (bf16_linear.PANEL_FLOAT32_ROWS if ops is not None and ops.simd_width == 16
                else bf16_linear.FLOAT32_ROWS)
    bf16_linear.dense_float32_rows.cache_clear()
    try:
        monkeypatch.delenv(bf16_linear.COPY_ROWS_SWITCH, raising=False)
        assert bf16_linear.dense_float32_rows() == expected
        bf16_linear.dense_float32_rows.cache_clear()
        monkeypatch.setenv(bf16_linear.COPY_ROWS_SWITCH, "32")
        assert bf16_linear.dense_float32_rows() == 32
        bf16_linear.dense_float32_rows.cache_clear()
        monkeypatch.setenv(bf16_linear.COPY_ROWS_SWITCH, "many")
        with pytest.raises(ValueError, match="positive row count"):
            bf16_linear.dense_float32_rows()
    finally:
        bf16_linear.dense_float32_rows.cache_clear()
