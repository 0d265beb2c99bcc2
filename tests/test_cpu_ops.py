"""The fused native CPU ops (worker/kernels/cpu_ops.cpp) against their torch references:
RMSNorm with and without the fused residual add, silu_and_mul and rotary embedding, in
float32/bfloat16/float16, odd sizes and strided (fused-projection view) inputs.

Tolerances: RMSNorm and silu differ from torch only in the order of the mean's sum and in
the exponential, so outputs agree to a few float32 ulps before the one rounding to the
output dtype (then to 1 ulp of it); the residual add and rotary embedding are bit-exact.
"""
from __future__ import annotations

import logging

import pytest
import torch
from cpu_ops_utils import enabled_fixture, ops_fixture  # noqa: F401  (fixtures)
from model_utils import assert_greedy_matches, hf_greedy, model_dir_for

from engine_core import CacheConfig, Request, Scheduler, SchedulerConfig
from protocol import EngineConfig, SamplingParams
from worker.layers.activation import (
    gelu_tanh_and_mul,
    gelu_tanh_and_mul_torch,
    silu_and_mul,
    silu_and_mul_torch,
)
from worker.layers.layernorm import RMSNorm
from worker.layers.rotary_embedding import RotaryEmbedding
from worker.model_runner import ModelRunner
from worker.native import cpu_ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to ~1 ulp of the dtype (a few ulps of float32)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    eps = torch.finfo(actual.dtype).eps
    rtol = 4 * eps if actual.dtype == torch.float32 else eps
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=1e-6)


def _rows(n: int, width: int, dtype: torch.dtype, strided: bool, scale: float = 1.0):
    """[n, width] random rows; with `strided`, a column slice of a wider buffer."""
    if not strided:
        return (torch.randn(n, width) * scale).to(dtype)
    return (torch.randn(n, width + 13) * scale).to(dtype)[:, 5:5 + width]


def _norm(size: int) -> RMSNorm:
    norm = RMSNorm(size, 1e-5)
    norm.weight.data = torch.randn(size) * 0.5 + 1
    return norm


@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("n,size,strided", [(1, 256, False), (5, 257, True), (3, 1, False),
                                            (0, 64, False), (9, 1000, True)])
def test_rms_norm(ops, in_dtype, out_dtype, n, size, strided):
    torch.manual_seed(n + size)
    norm, x = _norm(size), _rows(n, size, in_dtype, strided, scale=3.0)
    out = norm(x, out_dtype)
    _assert_close(out, norm.forward_torch(x, out_dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,size,strided", [(1, 256, False), (7, 255, True), (4, 3, False)])
def test_add_and_norm(ops, dtype, n, size, strided):
    """residual += x exactly as torch's float32 add; the norm of the updated stream."""
    torch.manual_seed(n * size)
    norm, x = _norm(size), _rows(n, size, dtype, strided)
    residual = _rows(n, size, torch.float32, strided, scale=10.0)
    residual_ref = residual.clone()
    out = norm.add_and_norm(x, residual, dtype)
    expected = norm.add_and_norm_torch(x, residual_ref, dtype)
    assert torch.equal(residual, residual_ref)
    _assert_close(out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,d,strided", [(1, 704, False), (6, 99, True), (2, 1, False),
                                         (0, 8, False)])
def test_silu_and_mul(ops, dtype, n, d, strided):
    torch.manual_seed(d)
    x = _rows(n, 2 * d, dtype, strided, scale=4.0)
    _assert_close(silu_and_mul(x), silu_and_mul_torch(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_extremes(ops, dtype):
    """Large |gate| (exp overflow/underflow territory in a naive 1 / (1 + exp(-x)))."""
    big = 60000.0 if dtype == torch.float16 else 1e6
    gate = torch.tensor([[0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 88.0, -88.0, 100.0, -100.0,
                          big, -big]])
    x = torch.cat([gate, torch.full_like(gate, 1.5)], dim=1).to(dtype)
    _assert_close(silu_and_mul(x), silu_and_mul_torch(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,d,strided", [(1, 2048, False), (6, 99, True)])
def test_gelu_tanh_and_mul(ops, dtype, n, d, strided):
    """Against torch's formula in float64 (in float32, torch's own 1 + tanh cancels for
    negative gates, where ours does not)."""
    torch.manual_seed(d)
    x = _rows(n, 2 * d, dtype, strided, scale=4.0)
    _assert_close(gelu_tanh_and_mul(x), gelu_tanh_and_mul_torch(x.double()).to(dtype))
    big = 60000.0 if dtype == torch.float16 else 1e6
    gate = torch.tensor([[0.0, -0.0, 1e-30, -1e-30, 5.0, -5.0, 20.0, -20.0, big, -big]])
    x = torch.cat([gate, torch.full_like(gate, 1.5)], dim=1).to(dtype)
    _assert_close(gelu_tanh_and_mul(x), gelu_tanh_and_mul_torch(x.double()).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_rms_norm_in_place(ops, dtype):
    """Gemma's and Qwen3's q/k norms: every head of a strided [tokens, heads, dim] view."""
    torch.manual_seed(0)
    qkv, q, k, _ = _qkv(5, 4, 2, 64, dtype)
    norm = _norm(64)
    expected = norm.forward_torch(q.clone())
    assert norm.heads_(q) is q
    _assert_close(q, expected)


def _qkv(n: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    """q, k, v as views of one fused projection output, as LlamaAttention splits it."""
    qkv = (torch.randn(n, (heads + 2 * kv_heads) * head_dim) * 2).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return qkv, q.view(n, heads, head_dim), k.view(n, kv_heads, head_dim), v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,heads,kv_heads,head_dim", [(1, 4, 2, 64), (7, 3, 1, 32),
                                                       (33, 8, 8, 128), (2, 2, 1, 2)])
def test_rotary_embedding_matches_torch_bit_for_bit(ops, dtype, n, heads, kv_heads, head_dim):
    torch.manual_seed(n * head_dim)
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, None)
    qkv, q, k, v = _qkv(n, heads, kv_heads, head_dim, dtype)
    v_before = v.clone()
    positions = torch.randint(0, 4096, (n,))
    q_ref, k_ref = rope.forward_torch(positions, q, k)
    q_out, k_out = rope(positions, q, k)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()  # in place
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    assert torch.equal(v, v_before)


def test_rotary_embedding_llama3_scaling_and_int32_positions(ops):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    rope = RotaryEmbedding(64, 512, 500000.0, scaling)
    _, q, k, _ = _qkv(5, 4, 2, 64, torch.bfloat16)
    positions = torch.tensor([0, 511, 3, 64, 200], dtype=torch.int32)
    q_ref, k_ref = rope.forward_torch(positions, q, k)
    rope(positions, q, k)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)


def test_rotary_embedding_rejects_positions_past_the_table(ops):
    rope = RotaryEmbedding(32, 16, 10000.0, None)
    _, q, k, _ = _qkv(2, 2, 1, 32, torch.float32)
    with pytest.raises(IndexError):
        rope(torch.tensor([3, 16]), q, k)


def test_parallel_path_matches_serial(ops):
    """Enough work to cross the kernel's parallel threshold, on two threads: same bits."""
    torch.manual_seed(0)
    n, hidden, heads, head_dim = 1100, 1024, 16, 64
    norm, x = _norm(hidden), _rows(n, hidden, torch.bfloat16, True)
    gate_up = _rows(n, 1024, torch.bfloat16, False)
    rope = RotaryEmbedding(head_dim, 2048, 10000.0, None)
    positions = torch.randint(0, 2048, (n,))
    qkv = _qkv(n, heads, heads, head_dim, torch.bfloat16)[0]

    def run(threads: int) -> list[torch.Tensor]:
        torch.set_num_threads(threads)
        residual, qkv_copy = torch.ones(n, hidden), qkv.clone()
        width = heads * head_dim
        q, k = (qkv_copy[:, i * width:(i + 1) * width].view(n, heads, head_dim)
                for i in range(2))
        rope(positions, q, k)
        return [norm(x, torch.bfloat16), norm.add_and_norm(x, residual), residual,
                silu_and_mul(gate_up), qkv_copy]

    threads = torch.get_num_threads()
    try:
        serial, parallel = run(1), run(2)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(serial, parallel):
        assert torch.equal(a, b)


def test_unsupported_layouts_fall_back_to_torch(ops):
    norm = _norm(16)
    x = torch.randn(3, 4, 16)  # not 2-D: torch path
    _assert_close(norm(x), norm.forward_torch(x))
    x = torch.randn(16, 3).t()  # columns not contiguous
    _assert_close(norm(x), norm.forward_torch(x))
    gate_up = torch.randn(8, 3).t()
    _assert_close(silu_and_mul(gate_up), silu_and_mul_torch(gate_up))
    rope = RotaryEmbedding(8, 16, 10000.0, None)
    q, k = torch.randn(8, 2, 3).transpose(0, 2), torch.randn(3, 1, 8)  # heads not contiguous
    q_ref, k_ref = rope.forward_torch(torch.tensor([1, 2, 3]), q, k)
    q_out, k_out = rope(torch.tensor([1, 2, 3]), q, k)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)


def test_without_a_compiler_falls_back_to_torch_with_one_warning(monkeypatch, caplog):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    cpu_ops._load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="deltaserve"):
            assert cpu_ops.native_ops() is None and cpu_ops.native_ops() is None
            norm, x = _norm(8), torch.randn(2, 8)
            assert torch.equal(norm(x), norm.forward_torch(x))
    finally:
        cpu_ops._load.cache_clear()
    warnings = [r for r in caplog.records if "fused cpu ops unavailable" in r.message]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0].message


def test_disabled_uses_torch(monkeypatch):
    monkeypatch.setattr(cpu_ops, "ENABLED", False)
    assert cpu_ops.native_ops() is None


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_model_greedy_matches_hf_on_either_attention_backend(ops, backend, tmp_path_factory):
    """Native ops rotate q/k in place inside the fused qkv output; both CPU attention backends
    take those strided views and the tokens still equal Hugging Face's."""
    path = model_dir_for(tmp_path_factory, "llama")
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6] * 7, [5]]
    runner = ModelRunner(EngineConfig(model=path, dtype="float32", attention_backend=backend,
                                      num_gpu_blocks_override=64, max_model_len=128))
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16,
                                          max_model_len=128),
                          CacheConfig(16, runner.num_blocks, False))
    params = SamplingParams(temperature=0.0, max_tokens=8)
    for i, prompt in enumerate(prompts):
        scheduler.add_request(Request(str(i), prompt, params, arrival_time=float(i)))
    tokens: dict[str, list[int]] = {}
    while scheduler.has_unfinished_requests():
        so = scheduler.schedule()
        for out in scheduler.update_from_output(so, runner.execute_model(so)):
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert runner.attention.name == backend
    assert_greedy_matches([tokens[str(i)] for i in range(len(prompts))],
                          hf_greedy(path, prompts, 8))
