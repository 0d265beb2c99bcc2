"""Compiled CPU kernel libraries (worker/kernels/*.cpp), built with the system C++ compiler on
first use and cached on disk (worker/native_build.py); here the paged-attention kernel's.

Each library is linked against `libgomp.so.1`, the soname of the OpenMP runtime torch ships
and loads first, so the dynamic loader binds it to torch's copy: a kernel's parallel region
runs on torch's intra-op threads, never on a second pool.
"""
from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from worker import native_build

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
SOURCES = ("cpu_paged_attention.cpp", "cpu_dtypes.h", "cpu_exp.h", "cpu_paged_attention_simd.h",
           "cpu_paged_attention_rows.h", "cpu_paged_attention_tile.h")
CXX_FLAGS = ("-std=c++20", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC",
             "-fvisibility=hidden", "-fno-math-errno", "-ffp-contract=fast", "-Wall", "-Wextra",
             "-Werror")
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the .cpp's dispatch

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
# dtype, q, q_stride, k, k_stride, v, v_stride, k_cache, v_cache, slot_mapping, num_tokens,
# query_start_loc, seq_lens, block_table, bt_stride, items, num_items, out, num_heads,
# num_kv_heads, head_dim, block_size, scale, num_threads
ARGTYPES = [_I32, _P, _I64, _P, _I64, _P, _I64, _P, _P, _P, _I64, _P, _P, _P, _I64, _P, _I64,
            _P, _I32, _I32, _I32, _I32, _F32, _I32]


def cache_dir() -> Path:
    return Path(os.environ.get("DELTASERVE_KERNEL_CACHE",
                               "~/.cache/deltaserve/cpu-kernels")).expanduser()


def build_library(tag: str, sources: Sequence[str], extra_flags: Sequence[str] = (),
                  march: str = "native") -> Path:
    """The path of the library compiled from `sources` in KERNEL_DIR (the first is the
    translation unit, the rest what it includes); compiles unless the cache holds it.
    `march` other than native builds a portable variant (tests build x86-64-v3 and x86-64 to
    check the AVX2 and baseline SIMD paths on an AVX-512 host)."""
    text = f'#include "{KERNEL_DIR / sources[0]}"\n'
    flags = [f if f != "-march=native" else f"-march={march}" for f in CXX_FLAGS]
    return native_build.cached_library(text, [KERNEL_DIR / s for s in sources],
                                       [*flags, *extra_flags, f"-I{KERNEL_DIR}"],
                                       cache_dir(), tag)


def entry_point(library: Path, name: str, argtypes: Sequence[type],
                restype: type = ctypes.c_int) -> ctypes._CFuncPtr:
    """`name` in `library` (ctypes releases the GIL during calls)."""
    function = getattr(ctypes.CDLL(str(library)), name)
    function.restype = restype
    function.argtypes = list(argtypes)
    return function


def build(march: str = "native") -> Path:
    """The attention library's path (compiles unless the cache holds this source/flags/CPU)."""
    return build_library("cpu-paged-attention", SOURCES, march=march)


@functools.cache
def load(march: str = "native") -> ctypes._CFuncPtr:
    """The attention kernel's entry point, returning an int status."""
    return entry_point(build(march), "cpu_paged_attention", ARGTYPES)


def simd_width(march: str = "native") -> int:
    """Floats per SIMD vector in that build (16: AVX-512, 8: AVX2, 4: baseline)."""
    return entry_point(build(march), "cpu_paged_attention_simd_width", [])()
