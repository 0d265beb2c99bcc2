"""The w8a8 products (`--quantization w8a8`; worker/kernels/w8a8.h): int8 weight rows times
activations quantized per token to int8 (vLLM's CPU dynamic per-token W8A8), int32 sums.

- the per-token quantization equals the torch reference bit for bit (ties, zero rows, -amax);
- every ISA variant this CPU has (vnni: vpdpbusd, x rows in lanes from 5 rows; avx2:
  vpmaddubsw with the sign trick; scalar) within the float path's bound of the float64
  reference (the integer sums are exact: what remains is the int->float conversion and two
  scalings), for 1, 2, 5, 64 and 300 rows and odd N; the variants agree bit for bit;
- team steps (num_threads = 0), 1 and 2 threads, accumulate; the matrix binding; K limits;
- the AVX2-only build (-march=x86-64-v3) and the baseline build; the torch fallback.
"""
from __future__ import annotations

import pytest
import torch
from a8_utils import (
    PORTABLE_BUILDS,
    activations,
    check_threads_agree,
    detected_isa,
    isas,
    load_ops,
    portable_ops,
)

from worker.layers.quantization.int8 import quantize_rows
from worker.layers.quantization.w8a8 import W8A8Matrix
from worker.native import gguf_ops, w8a8
from worker.native.gguf_matrix import GgufMatrix

pytestmark = pytest.mark.timeout(120)

U = 2.0 ** -24
ROWS = [1, 2, 5, 64, 300]
I8 = gguf_ops.W8A8_TYPE


@pytest.fixture(scope="module")
def ops() -> gguf_ops.GgufOps:
    ops = load_ops()
    yield ops
    detected_isa(ops)


def _weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return quantize_rows(torch.randn(n, k, generator=g) * 0.05)


def _product(ops, x, q, scale) -> torch.Tensor:
    n, k = q.shape
    return ops.matmul(x, q.view(torch.uint8), I8, n, k, a8=True).mul_(scale)


def assert_within_rounding(y: torch.Tensor, x: torch.Tensor, q: torch.Tensor,
                           scale: torch.Tensor) -> None:
    """|y - ref| <= 4 u |ref| + tiny: Σ is exact, float(Σ), × a_scale, × w_scale each round
    once (float32), the reference's float64 scalings add less than u."""
    ref = w8a8.matmul_reference(x, q, scale)
    worst = ((y.double() - ref).abs() - 4 * U * ref.abs() - 1e-30).max().item()
    assert worst <= 0.0, f"error exceeds the bound by {worst:g}"


def test_token_quantization_is_the_references_bit_for_bit(ops):
    x = activations(9, 96, seed=1)
    x[1] = 0.0                                            # all-zero row: scale 0, q 0
    x[2, :] = torch.arange(96) - 47.5                     # scale 1: every value a .5 tie
    x[2, 0] = 127.0
    x[3, 5] = -x[3].abs().max() * 2                       # -amax -> -127
    x[4] *= 1e-30                                         # tiny values
    q, scale = ops.quantize_w8a8(x)
    q_ref, scale_ref = w8a8.quantize_tokens_reference(x)
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)
    assert q[1].abs().sum() == 0 and scale[1] == 0
    assert q[3, 5] == -127 and q.min() >= -127 and q.max() <= 127
    ties = x[2] * (1 / scale[2])
    assert ((ties - ties.floor()) == 0.5).any()          # the row does exercise ties


@pytest.mark.parametrize("m", ROWS)
def test_products_match_the_reference_on_every_variant(ops, m):
    results = []
    for n, k in ((37, 96), (13, 576), (1, 32)):
        x = activations(m, k, seed=m + n)
        q, scale = _weights(n, k, seed=n)
        for isa in isas(ops):
            ops.set_a8_isa(isa)
            y = _product(ops, x, q, scale)
            assert_within_rounding(y, x, q, scale)
            results.append((isa, n, y))
    detected_isa(ops)
    # Exact integer sums, the same float steps: every variant gives the same bits.
    for isa, n, y in results:
        same = next(r for i, nn, r in results if nn == n)
        assert torch.equal(y, same), (isa, n)


def test_extreme_values_do_not_saturate(ops):
    """All weights ±127 against activations at ±127 (the sign trick's int16 pairs: 2·127·127
    fits; VNNI's a + 128 with -128 Σw correction): the integer sums stay exact."""
    k, n = 4096, 9
    for m in (1, 20):
        x = torch.full((m, k), 3.0)
        x[:, 1::2] = -3.0
        q = torch.full((n, k), 127, dtype=torch.int8)
        q[:, 1::2] = -127
        q[1::2] *= -1
        scale = torch.ones(n)
        for isa in isas(ops):
            ops.set_a8_isa(isa)
            y = _product(ops, x, q, scale)
            expected = torch.tensor([1.0, -1.0] * 5)[:n] * (127 * 127 * k) * (3.0 / 127)
            assert torch.allclose(y, expected.expand(m, n), rtol=4 * U, atol=0), isa
    detected_isa(ops)


def test_team_steps_threads_and_accumulate(ops):
    n, k = 70, 576
    q, scale = _weights(n, k, seed=4)
    w = q.view(torch.uint8)
    check_threads_agree(ops, w, I8, n, k)


def test_matrix_binding_and_limits(ops):
    q, scale = _weights(8, 64, seed=5)
    x = activations(3, 64, seed=5)
    matrix = W8A8Matrix(q, scale)
    (segment, start, stop), = matrix.native_weights().segments
    assert segment.code == gguf_ops.gguf_type(I8).code | gguf_ops.A8_FLAG and (start, stop) == (0, 8)
    assert torch.equal(matrix(x), _product(ops, x, q, scale))
    assert GgufMatrix(q.view(torch.uint8), I8, 8, 64, a8=True).code == segment.code
    q48, s48 = _weights(8, 48, seed=5)  # K not whole blocks of 32: the reference
    odd = W8A8Matrix(q48, s48)
    assert odd.native_weights() is None
    x48 = activations(3, 48, seed=5)
    assert torch.equal(odd(x48), w8a8.matmul_reference(x48, q48, s48).float())
    big = torch.zeros(1, 131072 + 32, dtype=torch.uint8)  # int32 sums could overflow
    with pytest.raises(RuntimeError, match="status 1"):
        ops.matmul(torch.zeros(1, big.shape[1]), big, I8, 1, big.shape[1], a8=True)


def test_fallback_without_the_library_is_the_reference(monkeypatch):
    monkeypatch.setattr(gguf_ops, "native", lambda: None)
    x = activations(3, 96, seed=6)
    q, scale = _weights(5, 96, seed=6)
    ref = w8a8.matmul_reference(x, q, scale)
    for y in (w8a8.matmul(x, q, scale), W8A8Matrix(q, scale)(x),
              gguf_ops.matmul(x, q.view(torch.uint8), I8, 5, 96, a8=True) * scale):
        assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("march,variants", PORTABLE_BUILDS)
def test_portable_builds(march, variants):
    """The AVX2-only build (what an AVX2 host without VNNI compiles) and the baseline one."""
    ops = portable_ops(march, variants)
    for isa in variants:
        ops.set_a8_isa(isa)
        for m in ROWS:
            x = activations(m, 192, seed=7 + m)
            q, scale = _weights(9, 192, seed=7)
            assert_within_rounding(_product(ops, x, q, scale), x, q, scale)
        qt, st = ops.quantize_w8a8(activations(4, 192, seed=8))
        qr, sr = w8a8.quantize_tokens_reference(activations(4, 192, seed=8))
        assert torch.equal(qt, qr) and torch.equal(st, sr)
    ops.set_a8_isa(variants[0])
