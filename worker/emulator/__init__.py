"""kemu: run the project's CUDA kernels on the CPU, one fiber per CUDA thread (for tests).

`load_library(sources, kernels)` builds (or finds cached) a g++ library of the given
template instantiations and returns a `Library` whose `launch` mirrors a CUDA launch:
grid, block, dynamic shared memory bytes, and the kernel's arguments (tensors or arrays
with host pointers, None for a null pointer, numpy scalars of the parameter's exact type).
Harness errors (divergent barriers, deadlocks, bad shuffles, too little shared memory) come
back as `KernelEmulationError`; the process and the library stay usable.
"""
from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from worker.emulator.build import (EmulatorBuildError, EmulatorUnavailable, build_library,
                                   cuda_include_dir)

__all__ = ["EmulatorBuildError", "EmulatorUnavailable", "KernelEmulationError", "Library",
           "cuda_include_dir", "load_library"]

_ERROR_BYTES = 4096
_SCALARS = {np.dtype(np.int32): ("i4", ctypes.c_int32), np.dtype(np.int64): ("i8", ctypes.c_int64),
            np.dtype(np.float32): ("f4", ctypes.c_float),
            np.dtype(np.float64): ("f8", ctypes.c_double)}


class KernelEmulationError(RuntimeError):
    """The emulator found a bug while running a kernel (the message says which and where)."""


def default_workers() -> int:
    return int(os.environ.get("DELTASERVE_KEMU_WORKERS", 0)) or os.cpu_count() or 1


class Library:
    """One built emulator library, loaded with ctypes (calls release the GIL)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        self._lib.kemu_launch.restype = ctypes.c_int
        self._lib.kemu_launch.argtypes = [
            ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_uint),
            ctypes.c_ulonglong, ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
            ctypes.c_char_p, ctypes.c_int]
        self._lib.kemu_kernel_name.restype = ctypes.c_char_p
        self.kernel_set = frozenset(self.kernels)
        self.workers = default_workers()

    @property
    def kernels(self) -> list[str]:
        return [self._lib.kemu_kernel_name(i).decode()
                for i in range(self._lib.kemu_num_kernels())]

    def launch(self, name: str, grid: Sequence[int], block: Sequence[int], shared_mem: int,
               args: Sequence[object]) -> None:
        values, signature = [], []
        for arg in args:
            code, value = _c_argument(arg)
            signature.append(code)
            values.append(value)
        pointers = (ctypes.c_void_p * max(1, len(values)))(
            *(ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values))
        dims = [(ctypes.c_uint * 3)(*(tuple(d) + (1, 1))[:3]) for d in (grid, block)]
        error = ctypes.create_string_buffer(_ERROR_BYTES)
        status = self._lib.kemu_launch(name.encode(), dims[0], dims[1], shared_mem,
                                       "".join(c + "," for c in signature).encode(), pointers,
                                       self.workers, error, _ERROR_BYTES)
        if status:
            raise KernelEmulationError(f"{name}: {error.value.decode()}")


def _c_argument(arg: object) -> tuple[str, ctypes._SimpleCData]:
    if arg is None:
        return "p", ctypes.c_void_p(0)
    if hasattr(arg, "data_ptr"):  # a torch tensor (CPU)
        if arg.device.type != "cpu":
            raise ValueError(f"the emulator needs CPU tensors, got one on {arg.device}")
        return "p", ctypes.c_void_p(arg.data_ptr())
    if isinstance(arg, np.ndarray):
        return "p", ctypes.c_void_p(arg.ctypes.data)
    if isinstance(arg, np.generic) and arg.dtype in _SCALARS:
        code, ctype = _SCALARS[arg.dtype]
        return code, ctype(arg.item())
    raise TypeError(f"kernel arguments must be tensors, arrays, None or numpy scalars of a "
                    f"fixed width; got {type(arg).__name__}")


_loaded: dict[tuple, list[Library]] = {}  # (sources, defines) -> libraries loaded
_lock = threading.Lock()


def load_library(sources: Sequence[Path], kernels: Sequence[str], *, tag: str = "kernels",
                 defines: Sequence[str] = ()) -> Library:
    """A library with (at least) `kernels`: one already loaded in this process from the same
    sources, e.g. one a test suite built for many configs at once, or else a new build (or
    the disk cache's)."""
    key = (tuple(str(Path(s).resolve()) for s in sources), tuple(defines))
    with _lock:
        for library in _loaded.get(key, []):
            if set(kernels) <= library.kernel_set:
                return library
        library = Library(build_library(sources, kernels, tag=tag, defines=defines))
        _loaded.setdefault(key, []).append(library)
        return library
