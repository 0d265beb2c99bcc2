"""The project's C++ libraries (worker/kernels/*.cpp): compiled with the system C++ compiler,
cached on disk (worker/native/build.py), bound through ctypes.

Each library is declared once, at import, as a `NativeLibrary` (its tag, translation unit and
extra flags); the declarations form the registry `LIBRARIES` that `worker.native.prebuild`
compiles before a worker reports ready, so no step ever waits on a compiler.

Each library is linked against `libgomp.so.1`, the soname of the OpenMP runtime torch ships
and loads first, so the dynamic loader binds it to torch's copy: a kernel's parallel region
runs on torch's intra-op threads, never on a second pool.
"""
from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from worker.native import build

KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernels"
# Every library's flags, then march_flags(march), then its own.
CXX_FLAGS = ("-std=c++20", "-O3", "-fopenmp", "-shared", "-fPIC", "-fvisibility=hidden",
             "-fno-math-errno", "-ffp-contract=fast", "-Wall", "-Wextra", "-Werror")
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # cpu_dtypes.h's codes
# ctypes argument types of the entry points.
PTR, I64, I32, F32, F64, U64 = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float,
                                ctypes.c_double, ctypes.c_uint64)
# What loading a library can raise where it cannot be had here (callers fall back to torch).
UNAVAILABLE = (build.CompilerUnavailable, build.NativeBuildError, OSError)
_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def cache_dir() -> Path:
    return Path(os.environ.get("DELTASERVE_KERNEL_CACHE",
                               "~/.cache/deltaserve/cpu-kernels")).expanduser()


@dataclass(frozen=True)
class KernelUse:
    """What a worker's model may call natively: a library whose `needed` says no to it is
    not compiled before that worker is ready (nor ever, unless something else loads it)."""

    experts: bool = True  # mixture-of-experts layers (here or in a draft model)
    tensor_parallel: bool = True  # more than one rank


@dataclass(frozen=True)
class NativeLibrary:
    """A library of KERNEL_DIR: `source` is its translation unit (the headers it includes
    with quotes are found and keyed automatically), `extra_flags` follow CXX_FLAGS;
    `needed` (None: always) tells whether a worker's model uses it.
    Constructing one registers it in LIBRARIES (one per tag)."""

    tag: str
    source: str
    extra_flags: tuple[str, ...] = ()
    needed: Callable[[KernelUse], bool] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        known = LIBRARIES.setdefault(self.tag, self)
        if known != self:
            raise ValueError(f"native library {self.tag!r} is declared twice, differently")

    def path(self, march: str = "native") -> Path:
        """The built library (compiles unless the cache holds this source/flags/CPU). Inputs
        the compiler rejected are not compiled again by this process; changed inputs are, and
        a library another process has since built from the same inputs is loaded."""
        args = self._build_args(march)
        target = build.library_target(*args, cache_dir(), self.tag)
        failure = _FAILURES.get(target)
        if failure is not None and not target.exists():
            raise failure
        try:
            return build.cached_library(*args, cache_dir(), self.tag)
        except build.NativeBuildError as e:
            _FAILURES[target] = e
            raise

    def is_built(self, march: str = "native") -> bool:
        return build.library_target(*self._build_args(march), cache_dir(), self.tag).exists()

    def _build_args(self, march: str) -> tuple[str, list[Path], list[str]]:
        text = f'#include "{self.source}"\n'
        return text, local_includes(self.source), compile_flags(self.extra_flags, march)


LIBRARIES: dict[str, NativeLibrary] = {}
# What this process's builds raised, by the library file their inputs name (build.py's key)
_FAILURES: dict[Path, build.NativeBuildError] = {}


def march_flags(march: str = "native") -> list[str]:
    """`-march=<march>`; for native, without the AMX extensions (build.no_amx_flags).
    Another `march` builds a portable variant (tests build x86-64-v3 and x86-64 to check the
    AVX2 and baseline SIMD paths on an AVX-512 host)."""
    if march != "native":
        return [f"-march={march}"]
    return ["-march=native", *build.no_amx_flags(build.native_macros(build.compiler()))]


def compile_flags(extra_flags: Sequence[str] = (), march: str = "native",
                  include_dir: Path = KERNEL_DIR) -> list[str]:
    return [*CXX_FLAGS, *march_flags(march), *extra_flags, f"-I{include_dir}"]


def local_includes(source: str) -> list[Path]:
    """`source` and every file of KERNEL_DIR it includes with quotes, transitively, in a
    stable order."""
    seen: dict[str, Path] = {}
    pending = [source]
    while pending:
        name = pending.pop()
        path = KERNEL_DIR / name
        if name in seen or not path.is_file():
            continue
        seen[name] = path
        pending += _LOCAL_INCLUDE.findall(path.read_text())
    return [seen[name] for name in sorted(seen)]


def entry_point(library: Path, name: str, argtypes: Sequence[type],
                restype: type = ctypes.c_int) -> ctypes._CFuncPtr:
    """`name` in `library` (ctypes releases the GIL during calls)."""
    function = getattr(ctypes.CDLL(str(library)), name)
    function.restype = restype
    function.argtypes = list(argtypes)
    return function
