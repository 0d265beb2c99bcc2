"""The paged-attention library (worker/kernels/cpu_paged_attention*.{cpp,h}) and its entry
point, as the cpu attention backend calls it."""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

from worker.native.library import F32, I32, I64, PTR, NativeLibrary, entry_point

LIBRARY = NativeLibrary("cpu-paged-attention", "cpu_paged_attention.cpp")
# dtype, q, q_stride, k, k_stride, v, v_stride, k_cache, v_cache, slot_mapping, num_tokens,
# query_start_loc, seq_lens, block_table, bt_stride, items, num_items, out, num_heads,
# num_kv_heads, head_dim, block_size, scale, num_threads, sliding_window
# or'ed into the bfloat16 dtype code: multiply with vdpbf16ps where the build has AVX512-BF16
# (cpu_paged_attention_bf16.h; ignored by builds without it)
BF16_DOT = 0x10
ARGTYPES = [I32, PTR, I64, PTR, I64, PTR, I64, PTR, PTR, PTR, I64, PTR, PTR, PTR, I64, PTR, I64,
            PTR, I32, I32, I32, I32, F32, I32, I32]


def build(march: str = "native") -> Path:
    """The library's path (compiles unless the cache holds this source/flags/CPU)."""
    return LIBRARY.path(march)


@functools.cache
def load(march: str = "native") -> ctypes._CFuncPtr:
    """The attention kernel's entry point, returning an int status."""
    return entry_point(build(march), "cpu_paged_attention", ARGTYPES)


def simd_width(march: str = "native") -> int:
    """Floats per SIMD vector in that build (16: AVX-512, 8: AVX2, 4: baseline)."""
    return entry_point(build(march), "cpu_paged_attention_simd_width", [])()


def bf16_dot(march: str = "native") -> bool:
    """Whether that build honours BF16_DOT (compiled for a target with AVX512-BF16)."""
    return bool(entry_point(build(march), "cpu_paged_attention_bf16_dot", [])())
