"""A weight matrix kept as GGUF block rows, bound once for many products (a layer's weight):
the shape, type and layout are checked when it is made, so a product costs one ctypes call
and the output's allocation (~3 us of Python instead of ~7 us through gguf_ops.matmul)."""
from __future__ import annotations

import torch

from worker.native import gguf_ops


class GgufMatrix:
    """W [N, K] as `qweight` uint8 [N, row_bytes] (rows contiguous, any row stride; the
    tensor must outlive this object's use, as its address is kept). With `a8` the products
    quantize x to 8 bits per block first (worker/native/gguf_a8.py), or per token for I8 rows
    (w8a8, worker/native/w8a8.py): not exact; `code` is the kernel's type code, A8_FLAG
    included."""

    __slots__ = ("qweight", "qtype", "n", "k", "a8", "code", "_call", "_w", "_w_stride")

    def __init__(self, qweight: torch.Tensor, qtype: str | int, n: int, k: int,
                 a8: bool = False) -> None:
        self.qtype = gguf_ops.gguf_type(qtype)
        if a8 and self.qtype.name not in (*gguf_ops.A8_TYPES, gguf_ops.W8A8_TYPE):
            raise ValueError(f"no 8-bit-activation kernel for {self.qtype.name}")
        self.a8, self.code = a8, self.qtype.code | (gguf_ops.A8_FLAG if a8 else 0)
        self.qweight = gguf_ops.weight_rows(qweight, self.qtype, n, k)
        self.n, self.k = n, k
        ops = gguf_ops.native()
        self._call = ops._matmul if ops is not None else None
        self._w, self._w_stride = self.qweight.data_ptr(), self.qweight.stride(0)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] float32 · Wᵀ -> float32 [M, N], new or into `out` ([M, N] float32, rows
        contiguous: a column slice of a wider buffer works). Anything else (other shapes,
        no native library) goes through gguf_ops.matmul and its checks."""
        n, k = self.n, self.k
        if (self._call is None or x.dim() != 2 or x.dtype != torch.float32
                or x.stride(1) != 1 or x.shape[1] != k or not x.is_cpu):
            return gguf_ops.matmul(x, self.qweight, self.qtype.code, n, k, out=out, a8=self.a8)
        m = x.shape[0]
        if out is None:
            out = torch.empty((m, n), dtype=torch.float32)
        elif out.shape != (m, n) or out.dtype != torch.float32 or (n > 1 and out.stride(1) != 1):
            raise ValueError(f"out must be float32 [{m}, {n}] with contiguous rows")
        status = self._call(self.code, self._w, self._w_stride, x.data_ptr(),
                            x.stride(0), out.data_ptr(), out.stride(0), m, n, k, 0,
                            torch.get_num_threads())
        if status:
            raise RuntimeError(f"gguf_matmul rejected its arguments (status {status})")
        return out
