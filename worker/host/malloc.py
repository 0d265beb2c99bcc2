"""glibc malloc kept from returning a CPU worker's activations to the kernel between steps.

A step's large tensors (a prefill chunk's 8192 x 1408 float32 MLP activations: 46 MB) exceed
glibc's largest mmap threshold (32 MiB), so each is mmap'd and unmapped on every step and its
pages faulted in and zeroed again: 6 % of a bf16 256-request run's worker samples were page
faults (kernel time, and the other OpenMP thread waiting meanwhile). With mmap off and the
heap's top kept (`M_MMAP_MAX` 0, `M_TRIM_THRESHOLD` 1 GiB), freed blocks are reused by the
next step: the resident size stays at the largest step's, which the KV cache dwarfs.
`DELTASERVE_KEEP_MALLOC=0` leaves glibc's defaults (other C libraries are left alone)."""
from __future__ import annotations

import ctypes
import ctypes.util
import os

ENV_SWITCH = "DELTASERVE_KEEP_MALLOC"
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters
_TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Applies the settings in this process; whether they took (glibc only)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
