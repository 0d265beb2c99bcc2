"""The fused mixture-of-experts kernel (worker/kernels/fused_moe.cpp): route-grouped products
per active expert, SiLU gating and the weighted combine for one layer in one native call. A
layer binds its expert weights once (`FusedExperts`); a call costs one ctypes call.

Weights: a set of E matrices [n, k] (`ExpertMatrices`) is either GGUF blocks (uint8 [E, n,
row_bytes], any GGUF type with a kernel, I8 with per-row scales for weight-only int8) or dense
rows (float32, bfloat16 or float16 [E, n, k]); a set's rows may be a view of a wider tensor
(gate and up as the two halves of one [E, 2 * inter, ...] tensor). Activations, accumulation
and results are float32, except that bfloat16 experts take bfloat16 inputs (as Hugging Face's
and vLLM's do): x, for bf16 gate and up, and the SiLU product, for a bf16 down, are rounded to
bf16 before their products (exact in float32; with AVX-512 the kernel splits bf16 weight lines
into floats and multiplies them with FMAs). `experts_reference` is the same computation in
torch: the fallback where the library cannot be built, and the tests' reference.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.native import gguf_ops
from worker.native.library import I32, I64, PTR, UNAVAILABLE, NativeLibrary, entry_point

logger = logging.getLogger("deltaserve")

LIBRARY = NativeLibrary("fused-moe", "fused_moe.cpp", needed=lambda use: use.experts)
DENSE_CODES, DENSE_BLOCK = gguf_ops.DENSE_CODES, gguf_ops.DENSE_BLOCK  # dense_blocks.h's
BF16_CODE = DENSE_CODES[torch.bfloat16]
# layer, x, x_stride, tokens, ids, weights, topk, out, out_stride, accumulate, num_threads
_FORWARD_ARGS = [PTR, PTR, I64, I64, PTR, PTR, I64, PTR, I64, I32, I32]
_I64 = ctypes.c_int64


class ExpertWeights(ctypes.Structure):
    _fields_ = [("qtype", _I64), ("w", PTR), ("expert_stride", _I64), ("row_stride", _I64),
                ("scale", PTR), ("scale_stride", _I64)]


class MoeLayer(ctypes.Structure):
    _fields_ = [("num_experts", _I64), ("hidden", _I64), ("inter", _I64),
                ("gate", ExpertWeights), ("up", ExpertWeights), ("down", ExpertWeights)]


@dataclass(frozen=True, slots=True)
class ExpertMatrices:
    """E matrices [n, k]: `data` uint8 [E, n, >= row_bytes] of GGUF type `qtype` (a GGML
    code), or dense float [E, n, k] (qtype None); rows contiguous, any strides above.
    `scale`: float32 [E, n] (expert rows contiguous) multiplying output column c of matrix e
    by scale[e, c], or None."""

    data: torch.Tensor
    qtype: int | None = None
    scale: torch.Tensor | None = None

    @property
    def code(self) -> int:
        return DENSE_CODES[self.data.dtype] if self.qtype is None else self.qtype

    def native_form(self, k: int) -> ExpertWeights | None:
        """The kernel's view of these weights, or None where it has no kernel for them."""
        d, s = self.data, self.scale
        if self.qtype is None:
            if d.dtype not in DENSE_CODES or k % DENSE_BLOCK:
                return None
        elif not gguf_ops.supported(self.qtype) or k % gguf_ops.gguf_type(self.qtype).block_elems:
            return None
        if d.dim() != 3 or d.stride(2) != 1 or not d.is_cpu:
            return None
        if s is not None and (s.dtype != torch.float32 or s.stride(1) != 1):
            return None
        size = d.element_size()
        return ExpertWeights(self.code, d.data_ptr(), d.stride(0) * size, d.stride(1) * size,
                             None if s is None else s.data_ptr(),
                             0 if s is None else s.stride(0))

    def dense(self, e: int, k: int) -> torch.Tensor:
        """Matrix e as float32 [n, k] (dequantized, scaled)."""
        d = self.data[e]
        if self.qtype is None:
            w = d.float()
        elif self.qtype == gguf_ops.gguf_type("I8").code:  # plain int8, any K
            w = d[:, :k].view(torch.int8).float()
        else:
            t = gguf_ops.gguf_type(self.qtype)
            w = gguf_ops.dequantize(d[:, :t.row_bytes(k)], t.code, d.shape[0], k)
        return w if self.scale is None else w * self.scale[e][:, None]


class FusedExperts:
    """One layer's experts (gate and up [E, inter, hidden], down [E, hidden, inter]) bound
    for the kernel; the tensors must outlive it. Calls run natively where the library and the
    weights allow, else `experts_reference`."""

    def __init__(self, gate: ExpertMatrices, up: ExpertMatrices, down: ExpertMatrices,
                 hidden: int, inter: int) -> None:
        self.gate, self.up, self.down = gate, up, down
        self.num_experts, self.hidden, self.inter = down.data.shape[0], hidden, inter
        forms = (gate.native_form(hidden), up.native_form(hidden), down.native_form(inter))
        self._forward = native()
        self._layer = (MoeLayer(self.num_experts, hidden, inter, *forms)
                       if self._forward is not None and None not in forms else None)

    @property
    def is_native(self) -> bool:
        return self._layer is not None

    @property
    def native_layer(self) -> int | None:
        """The address of the bound MoeLayer (fused_moe_forward's first argument; valid while
        this object lives), or None where calls run in torch."""
        return None if self._layer is None else ctypes.addressof(self._layer)

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
        """x [T, hidden] float32 (rows contiguous); topk_weights float32 and topk_ids int32
        [T, topk] -> out [T, hidden] float32 (new, or written or added to)."""
        if out is None:
            if accumulate:
                raise ValueError("accumulate=True needs `out`")
            out = x.new_empty(x.shape[0], self.hidden, dtype=torch.float32)
        if self._layer is None:
            y = experts_reference(x, topk_weights, topk_ids, self)
            return out.add_(y) if accumulate else out.copy_(y)
        weights = topk_weights.to(torch.float32).contiguous()
        ids = topk_ids.to(torch.int32).contiguous()
        if x.dtype != torch.float32 or x.stride(1) != 1 or out.stride(1) != 1:
            raise ValueError("x and out must be float32 rows with contiguous elements")
        status = self._forward(ctypes.byref(self._layer), x.data_ptr(), x.stride(0),
                               x.shape[0], ids.data_ptr(), weights.data_ptr(), ids.shape[1],
                               out.data_ptr(), out.stride(0), int(accumulate),
                               torch.get_num_threads())
        if status:
            raise RuntimeError(f"fused_moe_forward rejected its arguments (status {status}; "
                               "an expert id outside the layer's experts?)")
        return out


def experts_reference(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      experts: FusedExperts) -> torch.Tensor:
    """The same result in torch, grouped by expert: each active expert's rows at once."""
    hidden, inter = experts.hidden, experts.inter
    out = x.new_zeros(x.shape[0], hidden, dtype=torch.float32)
    flat = topk_ids.reshape(-1).long()
    if flat.numel() and (flat.min() < 0 or flat.max() >= experts.num_experts):
        raise RuntimeError("fused_moe: an expert id outside the layer's experts")
    bf16_in = experts.gate.code == experts.up.code == BF16_CODE
    for e in flat.unique().tolist():
        tokens, choice = (topk_ids == e).nonzero(as_tuple=True)
        xe = x[tokens].float()
        if bf16_in:
            xe = xe.bfloat16().float()
        act = F.silu(xe @ experts.gate.dense(e, hidden).T) * (xe @ experts.up.dense(e, hidden).T)
        if experts.down.code == BF16_CODE:
            act = act.bfloat16().float()
        y = act @ experts.down.dense(e, inter).T
        out.index_add_(0, tokens, y * topk_weights[tokens, choice, None].to(y))
    return out


@functools.cache
def load(march: str = "native") -> ctypes._CFuncPtr:
    """The kernel's entry point built for `march` (raises one of UNAVAILABLE)."""
    return entry_point(LIBRARY.path(march), "fused_moe_forward", _FORWARD_ARGS)


@functools.cache
def native() -> ctypes._CFuncPtr | None:
    """The native build, or None where it cannot be built (then one warning per process)."""
    try:
        return load()
    except UNAVAILABLE as e:
        logger.warning("fused MoE kernel unavailable, experts run in torch: %s", e)
        return None


_MADV_HUGEPAGE, _MADV_COLLAPSE, _HUGE_PAGE = 14, 25, 2 << 20  # Linux's values; x86-64 THP size


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:
    if not sys.platform.startswith("linux"):
        return None
    f = ctypes.CDLL(None, use_errno=True).madvise
    f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return f


def back_with_huge_pages(t: torch.Tensor) -> int:
    """Best effort: the whole 2 MB pages inside t's storage marked for transparent huge pages
    and collapsed into them now (Linux >= 6.1's MADV_COLLAPSE; the contents stay). Expert
    weights are read in short runs all over a few GB: on 4 KB pages nearly every run is a
    TLB miss (measured: the one-token bf16 kernel over 8 layers 7.8-7.9 ms instead of
    8.3-8.9). Returns the bytes collapsed (0: not on Linux, THP off, no memory for it, or
    DELTASERVE_MOE_HUGE_PAGES=0)."""
    madvise = _madvise()
    if madvise is None or os.environ.get("DELTASERVE_MOE_HUGE_PAGES", "1") == "0" or not t.is_cpu:
        return 0
    storage = t.untyped_storage()
    start = -(-storage.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
    end = (storage.data_ptr() + storage.nbytes()) // _HUGE_PAGE * _HUGE_PAGE
    if end <= start:
        return 0
    madvise(start, end - start, _MADV_HUGEPAGE)
    return end - start if madvise(start, end - start, _MADV_COLLAPSE) == 0 else 0


def bind_stacked(w13: torch.Tensor, w2: torch.Tensor, hidden: int,
                 types: tuple[int | None, int | None, int | None] = (None, None, None),
                 scale13: torch.Tensor | None = None,
                 scale2: torch.Tensor | None = None) -> FusedExperts:
    """Experts stored as vLLM stores them: w13 [E, 2 * inter, ...] (gate rows, then up
    rows), w2 [E, hidden, ...]; `types`: the GGUF codes of gate, up and down (None: dense);
    scales float32 [E, 2 * inter] and [E, hidden] or None."""
    inter = w13.shape[1] // 2
    gate, up, down = types
    for t in (w13, w2):
        back_with_huge_pages(t)
    s13 = (None, None) if scale13 is None else (scale13[:, :inter], scale13[:, inter:])
    return FusedExperts(ExpertMatrices(w13[:, :inter], gate, s13[0]),
                        ExpertMatrices(w13[:, inter:], up, s13[1]),
                        ExpertMatrices(w2, down, scale2), hidden, inter)
