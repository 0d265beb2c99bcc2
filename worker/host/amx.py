"""AMX: whether this CPU advertises it, and whether Linux lets this process use it.

Linux enables AMX's tile data per process: a process asks with
`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`, and until that succeeds any tile
instruction raises SIGILL. A VM may list `amx_tile amx_int8 amx_bf16` in /proc/cpuinfo
without granting the state (the hypervisor does not pass it through), so the flags alone
promise nothing. oneDNN (torch's matmuls) makes the same request and uses AMX only when it
is granted; our own kernels are built without AMX (worker/native/build.py no_amx_flags), so
nothing of ours depends on the answer. The worker asks once and reports it.
"""
from __future__ import annotations

import ctypes
import functools
import platform
from collections.abc import Callable, Set
from typing import Literal

from worker.host.cpuinfo import cpuinfo_flags

AmxState = Literal["absent", "granted", "not granted"]
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
SYS_ARCH_PRCTL = 158  # x86-64


def request_tile_permission() -> bool:
    """Ask Linux for this process's AMX tile data state; True once it is granted."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    if libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0:
        return False
    granted = ctypes.c_ulong(0)
    if libc.syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.byref(granted)) != 0:
        return False
    return bool(granted.value & (1 << XFEATURE_XTILEDATA))


def amx_state(flags: Set[str] | None = None,
              request: Callable[[], bool] = request_tile_permission) -> AmxState:
    """"absent" where the CPU does not advertise AMX (then nothing is requested); else
    whether the request for its tile state succeeded."""
    flags = cpuinfo_flags() if flags is None else flags
    if "amx_tile" not in flags:
        return "absent"
    return "granted" if request() else "not granted"


@functools.cache
def this_process() -> AmxState:
    """This process's AMX state (asked once)."""
    return amx_state()


def describe(state: AmxState) -> str:
    """For the startup line."""
    return {"absent": "no AMX",
            "granted": "AMX granted (oneDNN uses it)",
            "not granted": "AMX advertised but not granted (not used)"}[state]
