"""The fused CPU ops of worker/kernels/cpu_ops.cpp (RMSNorm with an optional residual add,
silu_and_mul, rotary embedding, the sampler's greedy argmax), called through ctypes with raw pointers so a call costs a
few microseconds instead of a handful of torch ops.

`native_ops()` is the loaded library, or None when it is disabled (DELTASERVE_CPU_OPS=0, or
`ENABLED = False`) or cannot be built here (then one warning per process). Each op accepts
only the layouts the kernel handles (`*_supported`); callers fall back to their torch
implementation, which is also the tests' reference, for anything else.
"""
from __future__ import annotations

import functools
import logging
import os

import torch

from worker.native.library import (
    DTYPE_CODES,
    F32,
    I32,
    I64,
    PTR,
    UNAVAILABLE,
    NativeLibrary,
    entry_point,
)

logger = logging.getLogger("deltaserve")

ENABLED = os.environ.get("DELTASERVE_CPU_OPS", "1") != "0"
# No FMA contraction (round like the torch reference); no trapping math (lets floor in the
# exponential vectorize).
LIBRARY = NativeLibrary("cpu-ops", "cpu_ops.cpp", ("-ffp-contract=off", "-fno-trapping-math"))

# in_dtype, out_dtype, out, out_stride, x, x_stride, residual, residual_stride, weight,
# num_tokens, hidden, eps, num_threads
_NORM_ARGS = [I32, I32, PTR, I64, PTR, I64, PTR, I64, PTR, I64, I64, F32, I32]
# dtype, out, out_stride, x, x_stride, num_tokens, d, num_threads
_SILU_ARGS = [I32, PTR, I64, PTR, I64, I64, I64, I32]
# dtype, x, x_stride, heads, head_dim, weight, num_tokens, eps, num_threads
_HEAD_NORM_ARGS = [I32, PTR, I64, I32, I64, PTR, I64, F32, I32]
# dtype, positions, q, q_stride, num_heads, k, k_stride, num_kv_heads, num_tokens, head_dim,
# cos, sin, max_position, num_threads
_ROPE_ARGS = [I32, PTR, PTR, I64, I32, PTR, I64, I32, I64, I32, PTR, PTR, I64, I32]
# x, x_stride, rows, cols, out, num_threads
_ARGMAX_ARGS = [PTR, I64, I64, I64, PTR, I32]


def _rows(t: torch.Tensor) -> bool:
    """A 2-D tensor of token rows, each contiguous (any row stride)."""
    return t.dim() == 2 and t.stride(1) == 1 and t.dtype in DTYPE_CODES


def _heads(t: torch.Tensor) -> bool:
    """[tokens, heads, head_dim] with each token's heads contiguous (any token stride)."""
    return (t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]
            and t.dtype in DTYPE_CODES)


class CpuOps:
    """Bound entry points of the compiled library; every tensor must be on the CPU."""

    def __init__(self) -> None:
        library = LIBRARY.path()
        self._norm = entry_point(library, "cpu_rms_norm", _NORM_ARGS)
        self._silu = entry_point(library, "cpu_silu_and_mul", _SILU_ARGS)
        self._gelu = entry_point(library, "cpu_gelu_tanh_and_mul", _SILU_ARGS)
        self._head_norm = entry_point(library, "cpu_head_rms_norm", _HEAD_NORM_ARGS)
        self._rope = entry_point(library, "cpu_rotary_embedding", _ROPE_ARGS)
        self._argmax = entry_point(library, "cpu_argmax", _ARGMAX_ARGS)

    @staticmethod
    def rms_norm_supported(x: torch.Tensor, weight: torch.Tensor,
                           out_dtype: torch.dtype) -> bool:
        return (_rows(x) and out_dtype in DTYPE_CODES and weight.dtype == torch.float32
                and weight.is_contiguous() and weight.shape == x.shape[1:])

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype, residual: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm of x [tokens, hidden] (float32 weight) -> a new [tokens, hidden] tensor in
        `out_dtype`. With `residual` (float32 [tokens, hidden], rows contiguous): residual
        += x in place first, and the normalized rows are the updated residual's."""
        n, hidden = x.shape
        out = torch.empty((n, hidden), dtype=out_dtype)
        res_ptr, res_stride = (None, 0) if residual is None else (residual.data_ptr(),
                                                                   residual.stride(0))
        status = self._norm(DTYPE_CODES[x.dtype], DTYPE_CODES[out_dtype], out.data_ptr(),
                            hidden, x.data_ptr(), x.stride(0), res_ptr, res_stride,
                            weight.data_ptr(), n, hidden, eps, torch.get_num_threads())
        _check(status, "cpu_rms_norm")
        return out

    @staticmethod
    def residual_supported(x: torch.Tensor, residual: torch.Tensor) -> bool:
        return (residual.dtype == torch.float32 and _rows(residual)
                and residual.shape == x.shape)

    @staticmethod
    def silu_and_mul_supported(x: torch.Tensor) -> bool:
        return _rows(x) and x.shape[1] % 2 == 0

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, 2 * d] = [gate | up] -> silu(gate) * up [tokens, d] in x's dtype."""
        return self._act_and_mul(self._silu, x, "cpu_silu_and_mul")

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, 2 * d] = [gate | up] -> gelu_tanh(gate) * up [tokens, d]."""
        return self._act_and_mul(self._gelu, x, "cpu_gelu_tanh_and_mul")

    def _act_and_mul(self, kernel, x: torch.Tensor, name: str) -> torch.Tensor:
        n, d = x.shape[0], x.shape[1] // 2
        out = torch.empty((n, d), dtype=x.dtype)
        status = kernel(DTYPE_CODES[x.dtype], out.data_ptr(), d, x.data_ptr(), x.stride(0),
                        n, d, torch.get_num_threads())
        _check(status, name)
        return out

    @staticmethod
    def head_rms_norm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
        return (_heads(x) and weight.dtype == torch.float32 and weight.is_contiguous()
                and weight.shape == x.shape[2:])

    def head_rms_norm_(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        """RMSNorm of every head of x [tokens, heads, head_dim], in place."""
        status = self._head_norm(DTYPE_CODES[x.dtype], x.data_ptr(), x.stride(0), x.shape[1],
                                 x.shape[2], weight.data_ptr(), x.shape[0], eps,
                                 torch.get_num_threads())
        _check(status, "cpu_head_rms_norm")

    @staticmethod
    def rotary_supported(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor) -> bool:
        return (_heads(q) and _heads(k) and q.dtype == k.dtype and q.shape[0] == k.shape[0]
                and q.shape[2] == k.shape[2] == cos.shape[1] and cos.is_contiguous())

    def rotary_embedding(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotates q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] in place by
        the float32 cos/sin table rows [max_position, head_dim] at `positions`."""
        if positions.dtype != torch.int64 or not positions.is_contiguous():
            positions = positions.to(torch.int64).contiguous()
        status = self._rope(DTYPE_CODES[q.dtype], positions.data_ptr(), q.data_ptr(),
                            q.stride(0), q.shape[1], k.data_ptr(), k.stride(0), k.shape[1],
                            q.shape[0], q.shape[2], cos.data_ptr(), sin.data_ptr(),
                            cos.shape[0], torch.get_num_threads())
        _check(status, "cpu_rotary_embedding")

    @staticmethod
    def argmax_supported(x: torch.Tensor) -> bool:
        return (x.dim() == 2 and x.dtype == torch.float32 and x.shape[1] > 0
                and (x.stride(1) == 1 or x.shape[1] == 1) and x.is_cpu)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """torch.argmax(x, dim=-1) of float32 rows [n, vocab] -> [n] int64: the first index
        of each row's maximum, NaN counting as the maximum."""
        n = x.shape[0]
        out = torch.empty(n, dtype=torch.int64)
        if n:
            status = self._argmax(x.data_ptr(), x.stride(0), n, x.shape[1], out.data_ptr(),
                                  torch.get_num_threads())
            _check(status, "cpu_argmax")
        return out


def _check(status: int, name: str) -> None:
    if status == 2:
        raise IndexError(f"{name}: a position is outside the rotary table")
    if status:
        raise RuntimeError(f"{name} rejected its arguments (status {status})")


def native_ops() -> CpuOps | None:
    """The library, or None when disabled or unavailable (callers then use torch)."""
    return _load() if ENABLED else None


@functools.cache
def _load() -> CpuOps | None:
    try:
        return CpuOps()
    except UNAVAILABLE as e:
        logger.warning("fused cpu ops unavailable, using torch ops: %s", e)
        return None
