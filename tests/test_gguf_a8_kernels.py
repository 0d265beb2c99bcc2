"""The 8-bit-activation GGUF kernels (worker/kernels/gguf_a8.h; `--quantization gguf_a8`)
against worker/native/gguf_a8.py's torch reference of the same arithmetic, and against the
exact float32 kernels within the error the activation rounding allows.

- Activation quantization: bit for bit the reference's (int8 quants, float32 d and s).
- Products: the kernels sum each block's integer products exactly, so y differs from the
  float64 product of the quantized-dequantized x̂ and the exact weights only by float32
  rounding: |y - ref| <= (K + 64) u Σ |x̂_k w_k| (u = 2^-24; Higham's γ_K for the sum, plus
  the per-block scaling's roundings).
- Against the exact path: |x_e - x̂_e| <= d_b / 2 per element of block b, so
  |y_a8 - y_exact| <= Σ_b d_b / 2 Σ_{e in b} |w_e| (+ both paths' float32 rounding).
Every ISA variant this build and CPU have (vnni, avx2, scalar), the true AVX2 build
(x86-64-v3) and the baseline build (x86-64, scalar only).
"""
from __future__ import annotations

import os
import subprocess
import sys

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

from worker.native import gguf_a8, gguf_ops
from worker.native.gguf_matrix import GgufMatrix

pytestmark = pytest.mark.timeout(120)

U = 2.0 ** -24
# (M, N, K in the type's blocks): one row (decode), a partial and a full tile, several tiles,
# a prefill-like block; N not a multiple of the 4-row tile. The K-quants' blocks are 256
# elements (8 blocks of 32 activations each).
SHAPES = [(1, 37, 3), (2, 5, 1), (4, 64, 2), (5, 33, 18), (9, 7, 4), (64, 19, 6), (300, 10, 2)]
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


@pytest.fixture(scope="module")
def ops() -> gguf_ops.GgufOps:
    ops = load_ops()
    yield ops
    detected_isa(ops)


def _weights(qtype: str, n: int, k: int, seed: int) -> torch.Tensor:
    return gguf_ops.random_blocks(qtype, n, k, torch.Generator().manual_seed(seed))


def _block(qtype: str) -> int:
    return gguf_ops.gguf_type(qtype).block_elems


def assert_within_rounding(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, qtype: str,
                           n: int, k: int) -> None:
    ref = gguf_a8.matmul_reference(x, w, qtype, n, k)
    xh = gguf_a8.quantize_dequantize(x).double()
    wd = gguf_ops.dequantize_reference(w, qtype, n, k).double()
    bound = (k + 64) * U * (xh.abs() @ wd.abs().T)
    worst = ((y.double() - ref).abs() - bound).max().item()
    assert worst <= 0.0, f"error exceeds the bound by {worst:g}"


def test_activation_quantization_is_the_references_bit_for_bit(ops):
    x = activations(6, 32 * 9, seed=1)
    x[0, :32] = 0.0                                  # a zero block: d = 0, q = 0
    x[1, :32] = torch.arange(32) - 15.5              # ties after scaling
    x[2, 32:64] = torch.full((32,), -3.0)            # every element at -amax
    x[3, 64:96] = torch.linspace(-1e-30, 1e-30, 32)  # tiny values
    got, want = ops.quantize_q8(x), gguf_a8.quantize_reference(x)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    q, d, s = got
    assert q.abs().max() <= 127 and (d[0, 0] == 0) and (q[0, :32] == 0).all()
    assert (q[2, 32:64] == -127).all()


@pytest.mark.parametrize("qtype", gguf_ops.A8_TYPES)
def test_products_match_the_reference_on_every_variant(ops, qtype):
    try:
        for isa in isas(ops):
            ops.set_a8_isa(isa)
            for i, (m, n, blocks) in enumerate(SHAPES):
                k = _block(qtype) * blocks
                x, w = activations(m, k, seed=i), _weights(qtype, n, k, seed=i)
                y = ops.matmul(x, w, qtype, n, k, a8=True)
                assert_within_rounding(y, x, w, qtype, n, k)
    finally:
        detected_isa(ops)


@pytest.mark.parametrize("qtype", gguf_ops.A8_TYPES)
def test_within_the_activation_rounding_of_the_exact_path(ops, qtype):
    m, n, k = 12, 40, 256 * 2
    x, w = activations(m, k, seed=3), _weights(qtype, n, k, seed=3)
    exact = ops.matmul(x, w, qtype, n, k).double()
    y = ops.matmul(x, w, qtype, n, k, a8=True).double()
    _, d, _ = gguf_a8.quantize_reference(x)
    wd = gguf_ops.dequantize_reference(w, qtype, n, k).double()
    w_abs_blocks = wd.abs().reshape(n, k // 32, 32).sum(-1)          # [N, blocks]
    rounding = (d.double() / 2) @ w_abs_blocks.T                      # [M, N]
    float_slop = 2 * (k + 64) * U * (x.double().abs() @ wd.abs().T)
    assert ((y - exact).abs() <= rounding + float_slop).all()
    # And the rounding is real, not zero: the modes differ.
    assert not torch.equal(y, exact)


def test_team_steps_threads_and_accumulate(ops):
    """num_threads = 0 (the native layer loop's calls) gives the bits of a call of its own;
    2 threads give the bits of 1 (each output is one tile's); accumulate adds."""
    n, k = 70, 576
    w = _weights("Q4_1", n, k, seed=4)
    check_threads_agree(ops, w, "Q4_1", n, k)
    for qtype in K_QUANTS:  # super-blocks; Q6_K's two scales per block of 32
        check_threads_agree(ops, _weights(qtype, n, 512, seed=4), qtype, n, 512)


def test_matrix_binds_the_a8_code_and_the_library_refuses_what_it_lacks(ops):
    w = _weights("Q8_0", 8, 64, seed=5)
    x = activations(3, 64, seed=5)
    matrix = GgufMatrix(w, "Q8_0", 8, 64, a8=True)
    assert matrix.code == 8 | gguf_ops.A8_FLAG
    assert torch.equal(matrix(x), ops.matmul(x, w, "Q8_0", 8, 64, a8=True))
    # Every block type with an exact kernel has an 8-bit one now; the library still refuses a
    # code it has no kernel for (GGML's Q2_K, 10) with status 2, and K that is not whole
    # super-blocks with status 1.
    x = activations(1, 256, seed=5)
    w = _weights("Q4_K", 8, 256, seed=5)
    y = torch.empty(1, 8)
    assert ops._matmul(10 | gguf_ops.A8_FLAG, w.data_ptr(), w.stride(0), x.data_ptr(), 256,
                       y.data_ptr(), 8, 1, 8, 256, 0, 1) == 2
    assert ops._matmul(12 | gguf_ops.A8_FLAG, w.data_ptr(), w.stride(0), x.data_ptr(), 256,
                       y.data_ptr(), 8, 1, 8, 224, 0, 1) == 1
    assert GgufMatrix(w, "Q4_K", 8, 256, a8=True).code == 12 | gguf_ops.A8_FLAG
    assert all(gguf_a8.supported(t) for t in ("Q4_1", "Q8_0", *K_QUANTS))
    assert not gguf_a8.supported("I8")  # w8a8's per-token product, not per block


def test_fallback_without_the_library_is_the_reference(monkeypatch):
    monkeypatch.setattr(gguf_ops, "native", lambda: None)
    x, w = activations(3, 96, seed=6), _weights("Q4_0", 5, 96, seed=6)
    y = gguf_ops.matmul(x, w, "Q4_0", 5, 96, a8=True)
    ref = gguf_a8.matmul_reference(x, w, "Q4_0", 5, 96)
    assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("march,variants", PORTABLE_BUILDS)
def test_portable_builds(march, variants):
    """The AVX2-only build (what an AVX2 host without VNNI compiles) and the baseline one."""
    ops = portable_ops(march, variants)
    with pytest.raises(ValueError):
        ops.set_a8_isa("vnni")
    for isa in variants:
        ops.set_a8_isa(isa)
        for qtype in gguf_ops.A8_TYPES:
            k = _block(qtype) * 6
            for m in (1, 5, 20):  # the decode tile, and many rows (8-row tiles on AVX2)
                x, w = activations(m, k, seed=7), _weights(qtype, 9, k, seed=7)
                assert_within_rounding(ops.matmul(x, w, qtype, 9, k, a8=True), x, w, qtype, 9,
                                       k)
    ops.set_a8_isa(variants[0])


def test_environment_lowers_the_variant():
    """DELTASERVE_GGUF_A8_ISA=avx2 selects the AVX2 path on a VNNI host (how an AVX2-only
    host's arithmetic is checked here); scalar the portable one."""
    code = ("from worker.native import gguf_ops; print(gguf_ops.load().a8_isa)")
    for wanted in ("avx2", "scalar"):
        env = {**os.environ, "DELTASERVE_GGUF_A8_ISA": wanted}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True, timeout=100).stdout.split()[-1]
        assert out == wanted or (wanted == "avx2" and out == "scalar")
