"""The project's C++ libraries (worker/kernels/*.cpp): compiled with the system C++ compiler
on first use, cached on disk (worker/native/build.py), bound through ctypes.

Each library is linked against `libgomp.so.1`, the soname of the OpenMP runtime torch ships
and loads first, so the dynamic loader binds it to torch's copy: a kernel's parallel region
runs on torch's intra-op threads, never on a second pool.
"""
from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from worker.native import build

KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernels"
CXX_FLAGS = ("-std=c++20", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC",
             "-fvisibility=hidden", "-fno-math-errno", "-ffp-contract=fast", "-Wall", "-Wextra",
             "-Werror")
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # cpu_dtypes.h's codes
# ctypes argument types of the entry points.
PTR, I64, I32, F32, F64, U64 = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float,
                                ctypes.c_double, ctypes.c_uint64)
# What loading a library can raise where it cannot be had here (callers fall back to torch).
UNAVAILABLE = (build.CompilerUnavailable, build.NativeBuildError, OSError)


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
    return build.cached_library(text, [KERNEL_DIR / s for s in sources],
                                [*flags, *extra_flags, f"-I{KERNEL_DIR}"], cache_dir(), tag)


def entry_point(library: Path, name: str, argtypes: Sequence[type],
                restype: type = ctypes.c_int) -> ctypes._CFuncPtr:
    """`name` in `library` (ctypes releases the GIL during calls)."""
    function = getattr(ctypes.CDLL(str(library)), name)
    function.restype = restype
    function.argtypes = list(argtypes)
    return function
