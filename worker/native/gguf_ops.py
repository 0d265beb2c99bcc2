"""Matrix products with weights kept in their GGUF block formats (worker/kernels/gguf_*.{cpp,h}):
`y = x · Wᵀ` with float32 activations and W as the raw bytes of a GGUF tensor, decoded in
registers to exactly `gguf.quants.dequantize`'s float32 values and accumulated in float32,
so results equal dequantize-then-float32-matmul up to summation order.

Shapes and dtypes:
  x        float32 [..., K], last dim contiguous (any other strides)
  qweight  uint8 [N, row_bytes] (row_bytes = K / block_elems * block_bytes), bytes of a row
           contiguous, any row stride: a row slice (tensor-parallel rank) or a column slice at
           block boundaries (a K slice) of a bigger tensor's bytes is a plain view; or a
           contiguous 1-D uint8 tensor of N * row_bytes bytes
  result   float32 [..., N]; or `out` float32 [M, N] (last dim contiguous), overwritten or,
           with accumulate=True, added to
`native()` is the loaded library or None where it cannot be built (then one warning per
process); `matmul` and `dequantize` fall back to `gguf.quants.dequantize` and torch there.
The block formats (`GgufType`, `gguf_type`, `weight_rows`, the reference decoder) live in
worker/native/gguf_types.py; their names are importable from here too.
"""
from __future__ import annotations

import functools
import logging

import torch

from worker.native.gguf_types import (
    GGUF_TYPES,
    GgufType,
    dequantize_reference,
    gguf_type,
    random_blocks,
    supported,
    weight_rows,
)
from worker.native.library import I32, I64, PTR, UNAVAILABLE, NativeLibrary, entry_point
from worker.native.q8_activations import quantize_dequantize, quantize_dequantize_tokens

__all__ = ["A8_FLAG", "A8_ISAS", "A8_TYPES", "DENSE_BLOCK", "DENSE_CODES", "DENSE_ROWS",
           "GGUF_TYPES", "LIBRARY", "W8A8_TYPE", "GgufOps", "GgufType", "dense_few_rows",
           "dequantize", "dequantize_reference", "gguf_type", "load", "matmul", "native",
           "random_blocks", "supported", "weight_rows"]

logger = logging.getLogger("deltaserve")

LIBRARY = NativeLibrary("gguf-matmul", "gguf_matmul.cpp")
# qtype, w, w_stride, x, x_stride, y, y_stride, m, n, k, accumulate, num_threads
_MATMUL_ARGS = [I32, PTR, I64, PTR, I64, PTR, I64, I64, I64, I64, I32, I32]
# qtype, w, w_stride, out, out_stride, n, k
_DEQUANTIZE_ARGS = [I32, PTR, I64, PTR, I64, I64, I64]
# x, x_stride, m, k, q, d, s
_QUANTIZE_ARGS = [PTR, I64, I64, I64, PTR, PTR, PTR]
# The qtype bit selecting 8-bit activations (gguf_a8.h; worker/native/gguf_a8.py), the types
# that have such a kernel, and its ISA variants by gguf_a8_isa's codes.
A8_FLAG = 0x100
A8_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
A8_ISAS = ("scalar", "avx2", "vnni")
# I8 rows with A8_FLAG: the w8a8 product (worker/kernels/w8a8.h): x quantized per token to
# int8 (not per block), int32 sums; the caller multiplies by the rows' scales. Same ISAs.
W8A8_TYPE = "I8"
# x, x_stride, m, k, q, scale
_QUANTIZE_W8A8_ARGS = [PTR, I64, I64, I64, PTR, PTR]
# GGML's codes of the dense types gguf_matmul and fused_moe also multiply (dense_blocks.h).
DENSE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}
DENSE_BLOCK = 32  # a dense row's K must be a multiple of this
# Up to this many x rows gguf_matmul runs its direct (decode) driver: one pass over the
# weights in address order (gguf_drive.h's DIRECT_ROWS with AVX-512; 4 with AVX2).
DENSE_ROWS = 8


class GgufOps:
    """Bound entry points of one build of the library (`march` as in library.march_flags)."""

    def __init__(self, march: str = "native") -> None:
        library = LIBRARY.path(march)
        self._matmul = entry_point(library, "gguf_matmul", _MATMUL_ARGS)
        self._dequantize = entry_point(library, "gguf_dequantize", _DEQUANTIZE_ARGS)
        self.simd_width: int = entry_point(library, "gguf_simd_width", [])()
        self._quantize_q8 = entry_point(library, "gguf_quantize_q8", _QUANTIZE_ARGS)
        self._a8_isa = entry_point(library, "gguf_a8_isa", [I32])
        self._quantize_w8a8 = entry_point(library, "gguf_quantize_w8a8", _QUANTIZE_W8A8_ARGS)

    @property
    def a8_isa(self) -> str:
        """The 8-bit-activation variant in use: vnni, avx2 or scalar (the CPU's best in this
        build, lowered by DELTASERVE_GGUF_A8_ISA=avx2|scalar or set_a8_isa)."""
        return A8_ISAS[self._a8_isa(-1)]

    def set_a8_isa(self, name: str) -> None:
        """Use the variant `name` from now on (ValueError where the build or CPU lacks it)."""
        if self._a8_isa(A8_ISAS.index(name)) < 0:
            raise ValueError(f"no {name} variant of the 8-bit-activation kernels here")

    def quantize_q8(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x float32 [M, K] quantized as the 8-bit-activation products do: q int8 [M, K],
        d and s float32 [M, K / 32]."""
        x2 = _activation_rows(x, x.shape[-1])
        m, k = x2.shape
        q = torch.empty((m, k), dtype=torch.int8)
        d, s = (torch.empty((m, k // 32), dtype=torch.float32) for _ in range(2))
        _check(self._quantize_q8(x2.data_ptr(), x2.stride(0), m, k, q.data_ptr(), d.data_ptr(),
                                 s.data_ptr()), "gguf_quantize_q8")
        return q, d, s

    def quantize_w8a8(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x float32 [M, K] quantized per token as the w8a8 products do: q int8 [M, K],
        scale float32 [M]."""
        x2 = _activation_rows(x, x.shape[-1])
        m, k = x2.shape
        q = torch.empty((m, k), dtype=torch.int8)
        scale = torch.empty(m, dtype=torch.float32)
        _check(self._quantize_w8a8(x2.data_ptr(), x2.stride(0), m, k, q.data_ptr(),
                                   scale.data_ptr()), "gguf_quantize_w8a8")
        return q, scale

    def matmul(self, x: torch.Tensor, qweight: torch.Tensor, qtype: str | int, n: int, k: int,
               out: torch.Tensor | None = None, accumulate: bool = False,
               a8: bool = False) -> torch.Tensor:
        """x [..., K] · W[N, K]ᵀ -> [..., N] float32 (or into `out` [M, N]); a8: x quantized
        to 8 bits per block of 32 first (not exact; worker/native/gguf_a8.py)."""
        t = GGUF_TYPES.get(qtype) or gguf_type(qtype)
        w = weight_rows(qweight, t, n, k)
        x2 = x if x.dim() == 2 and x.stride(1) == 1 else _activation_rows(x, k)
        if x2.dtype != torch.float32 or x2.shape[1] != k or not x2.is_cpu:
            _activation_rows(x, k)  # raises (the fast path above skips the checks)
        m = x2.shape[0]
        if out is None:
            if accumulate:
                raise ValueError("accumulate=True needs `out`")
            out = torch.empty((m, n), dtype=torch.float32)
        elif (out.dtype != torch.float32 or out.shape != (m, n) or not out.is_cpu
              or (n > 1 and out.stride(1) != 1)):
            raise ValueError(f"out must be float32 [{m}, {n}] on the CPU with contiguous rows")
        status = self._matmul(t.code | (A8_FLAG if a8 else 0), w.data_ptr(), w.stride(0), x2.data_ptr(), x2.stride(0),
                              out.data_ptr(), out.stride(0), m, n, k, accumulate,
                              torch.get_num_threads())
        if status:
            _check(status, "gguf_matmul")
        return out if x.dim() == 2 else out.view(*x.shape[:-1], n)

    def dense_matmul(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 · weight [N, K]ᵀ -> [M, N] float32 for a dense float32, float16
        or bfloat16 weight (rows contiguous, K a multiple of 32): each weight widened to
        float32 in registers, float32 sums, so the result is x · weight.float()ᵀ up to the
        summation order, reading the weight's own bytes (half a float32 copy's for 16 bits)."""
        n, k = weight.shape
        x2 = _activation_rows(x, k)
        if (weight.dtype not in DENSE_CODES or weight.stride(1) != 1 or k % DENSE_BLOCK
                or not weight.is_cpu):
            raise ValueError(f"weight must be dense float32/float16/bfloat16 [N, K] CPU rows "
                             f"(K a multiple of 32), got {weight.dtype} {tuple(weight.shape)}")
        out = torch.empty((x2.shape[0], n), dtype=torch.float32)
        status = self._matmul(DENSE_CODES[weight.dtype], weight.data_ptr(),
                              weight.stride(0) * weight.element_size(), x2.data_ptr(),
                              x2.stride(0), out.data_ptr(), out.stride(0), x2.shape[0], n, k, 0,
                              torch.get_num_threads())
        _check(status, "gguf_matmul")
        return out

    def dequantize(self, qweight: torch.Tensor, qtype: str | int, n: int, k: int) -> torch.Tensor:
        """The weights as float32 [N, K], exactly gguf.quants.dequantize's values."""
        t = gguf_type(qtype)
        w = weight_rows(qweight, t, n, k)
        out = torch.empty((n, k), dtype=torch.float32)
        _check(self._dequantize(t.code, w.data_ptr(), w.stride(0), out.data_ptr(), k, n, k),
               "gguf_dequantize")
        return out


def _activation_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """x as [M, K] float32 CPU rows, each contiguous (a view where x allows)."""
    if x.dtype != torch.float32 or x.shape[-1] != k or not x.is_cpu:
        raise ValueError(f"x must be float32 [..., {k}] on the CPU, got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    return x2 if x2.stride(1) == 1 else x2.contiguous()


def _check(status: int, name: str) -> None:
    if status:
        raise RuntimeError(f"{name} rejected its arguments (status {status})")


@functools.cache
def load(march: str = "native") -> GgufOps:
    """The library built for `march` (raises one of UNAVAILABLE where it cannot be built)."""
    return GgufOps(march)


@functools.cache
def native() -> GgufOps | None:
    """The native build, or None where it cannot be built (callers then use torch)."""
    try:
        return load()
    except UNAVAILABLE as e:
        logger.warning("GGUF kernels unavailable, dequantizing with gguf.quants: %s", e)
        return None


def dense_few_rows(weight: torch.Tensor) -> GgufOps | None:
    """The library, where a 16-bit dense weight [N, K] (bfloat16 or float16 CPU rows, K a
    multiple of DENSE_BLOCK) can be multiplied by `dense_matmul`; else None."""
    if (weight.dtype not in (torch.bfloat16, torch.float16) or not weight.is_cpu
            or weight.dim() != 2 or weight.shape[1] % DENSE_BLOCK or weight.stride(1) != 1):
        return None
    return native()


def matmul(x: torch.Tensor, qweight: torch.Tensor, qtype: str | int, n: int, k: int, *,
           out: torch.Tensor | None = None, accumulate: bool = False,
           a8: bool = False) -> torch.Tensor:
    """x [..., K] float32 · W[N, K]ᵀ -> float32 [..., N], W as GGUF block bytes (see the module
    docstring; a8 as GgufOps.matmul); the native kernel, or dequantize + torch where it cannot
    be built."""
    ops = native()
    if ops is not None:
        return ops.matmul(x, qweight, qtype, n, k, out=out, accumulate=accumulate, a8=a8)
    if accumulate and out is None:
        raise ValueError("accumulate=True needs `out`")
    x2 = _activation_rows(x, k)
    if a8:
        per_token = gguf_type(qtype).name == W8A8_TYPE
        x2 = (quantize_dequantize_tokens if per_token else quantize_dequantize)(x2)
    y = x2 @ dequantize_reference(qweight, qtype, n, k).T
    if out is None:
        return y if x.dim() == 2 else y.view(*x.shape[:-1], n)
    return out.add_(y) if accumulate else out.copy_(y)


def dequantize(qweight: torch.Tensor, qtype: str | int, n: int, k: int) -> torch.Tensor:
    """The weights as float32 [N, K] (native, or gguf.quants where it cannot be built)."""
    ops = native()
    return (ops.dequantize(qweight, qtype, n, k) if ops is not None
            else dequantize_reference(qweight, qtype, n, k))
