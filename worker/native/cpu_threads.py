"""Pinning torch's OpenMP threads (worker/kernels/cpu_threads.cpp), for
VLLM_CPU_OMP_THREADS_BIND's CPU lists."""
from __future__ import annotations

import ctypes
import os

import torch

from worker.native.library import I32, PTR, NativeLibrary, entry_point

LIBRARY = NativeLibrary("cpu-threads", "cpu_threads.cpp")


def bind_threads(cpus: tuple[int, ...]) -> None:
    """This process (its calling thread, and the threads it starts later) on `cpus`, and
    torch's team of len(cpus) threads one per CPU, in order. OSError if Linux refuses (a
    CPU outside what this process may use)."""
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))
    bind = entry_point(LIBRARY.path(), "cpu_bind_threads", [PTR, I32])
    array = (ctypes.c_int * len(cpus))(*cpus)
    if bind(ctypes.cast(array, ctypes.c_void_p), len(cpus)):
        raise OSError(f"could not pin the OpenMP threads to CPUs {list(cpus)}")
