"""A shared-memory all-reduce and all-gather for tensor-parallel ranks on one host (the CPU's
small per-layer reductions and the vocabulary-parallel logits), next to gloo, which keeps
everything else.

gloo's all-reduce goes through loopback TCP: on this project's 2-core VM a [1, 576] sum takes
~0.5 ms at the median and ~4 ms at p90 (each call wakes a sleeping peer), and a 30-layer model
makes 61 of them per step. Here every rank copies its input into its own slot of a segment
all ranks map, publishes a sequence number, waits (spinning briefly, then sleeping) for the
others', and sums the slots in rank order, so every rank gets the same bits
(worker/kernels/shm_all_reduce.cpp documents the protocol). Tensors larger than a slot, and
any setup failure, fall back to gloo. `DELTASERVE_SHM_ALLREDUCE=0` turns it off.

The segment is a file in /dev/shm (mode 0600, created exclusively by rank 0, opened by the
others between two gloo barriers, then unlinked), so it never outlives the group.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import secrets

import torch
import torch.distributed as dist

from worker.native.library import (
    DTYPE_CODES,
    F64,
    I32,
    I64,
    PTR,
    U64,
    UNAVAILABLE,
    NativeLibrary,
    entry_point,
)

logger = logging.getLogger("deltaserve")

ENV_SWITCH = "DELTASERVE_SHM_ALLREDUCE"
SLOT_BYTES = 8 << 20  # per rank and parity: a [3600, 576] float32 decode step fits
SHM_DIR = "/dev/shm"
LIBRARY = NativeLibrary("shm-all-reduce", "shm_all_reduce.cpp",
                        needed=lambda use: use.tensor_parallel)
# base, slot_bytes, rank, world, seq, dtype, x, numel, timeout_s
_ARGS = [PTR, I64, I32, I32, U64, I32, PTR, I64, F64]
# base, slot_bytes, rank, world, seq, x, bytes, timeout_s
_EXCHANGE_ARGS = [PTR, I64, I32, I32, U64, PTR, I64, F64]


class ShmAllReduce:
    def __init__(self, fd: int, rank: int, world: int, timeout_s: float) -> None:
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self._map = mmap.mmap(fd, _segment_bytes(world))
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._seq = 0
        library = LIBRARY.path()
        self._kernel = entry_point(library, "shm_all_reduce", _ARGS)
        self._exchange = entry_point(library, "shm_exchange", _EXCHANGE_ARGS)

    @classmethod
    def create(cls, rank: int, world: int, timeout_s: float) -> ShmAllReduce | None:
        """Collective over the initialized gloo group (the same calls on every rank, whatever
        fails): every rank maps the same segment, or every rank gets None and keeps gloo."""
        if os.environ.get(ENV_SWITCH, "1") == "0":
            return None
        name = [os.path.join(SHM_DIR, f"deltaserve-allreduce-{secrets.token_hex(8)}")]
        dist.broadcast_object_list(name, src=0)
        fd, error = -1, ""
        if rank == 0:
            fd, error = _open_segment(name[0], create=True, world=world)
        dist.barrier()  # the segment exists (or rank 0 failed to make it)
        if rank != 0:
            fd, error = _open_segment(name[0], create=False, world=world)
        instance = None
        if fd >= 0:
            try:
                instance = cls(fd, rank, world, timeout_s)
            except (*UNAVAILABLE, ValueError) as e:
                error = str(e)
            finally:
                os.close(fd)
        mapped: list[bool | None] = [None] * world
        dist.all_gather_object(mapped, instance is not None)  # also: every rank has opened it
        if rank == 0:
            _unlink(name[0])
        if not all(mapped):
            if error:
                logger.warning("shared-memory all-reduce unavailable, using gloo: %s", error)
            return None
        return instance

    def all_reduce(self, x: torch.Tensor) -> bool:
        """Sum `x` in place across the ranks; False (nothing done) when it does not apply."""
        code = DTYPE_CODES.get(x.dtype)
        if code is None or not self._fits(x):
            return False
        self._seq += 1
        self._check(self._kernel(self._base, SLOT_BYTES, self.rank, self.world, self._seq,
                                 code, x.data_ptr(), x.numel(), self.timeout_s))
        return True

    def all_gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `x` concatenated along the last dimension, in rank order; None
        (nothing done) when it does not apply."""
        if not self._fits(x):
            return None
        self._seq += 1
        nbytes = x.numel() * x.element_size()
        self._check(self._exchange(self._base, SLOT_BYTES, self.rank, self.world, self._seq,
                                   x.data_ptr(), nbytes, self.timeout_s))
        parity = self._seq % 2  # slot layout as in shm_all_reduce.cpp
        parts = [torch.frombuffer(self._map, dtype=x.dtype, count=x.numel(),
                                  offset=self.world * 64 + (2 * r + parity) * SLOT_BYTES)
                 for r in range(self.world)]
        return torch.cat([p.view(x.shape) for p in parts], dim=-1)  # copies before the next call

    def native_sum(self) -> tuple[int, int, int, int, int, float]:
        """(shm_all_reduce's address, the segment's base, slot bytes, rank, world, timeout_s):
        what native code passes to call the sum itself (cpu_decoder.cpp's AllReduce). Its
        sequence numbers are `next_seq`, `next_seq + 1`, ..., recorded with `advance`."""
        address = ctypes.cast(self._kernel, ctypes.c_void_p).value
        return address, self._base, SLOT_BYTES, self.rank, self.world, self.timeout_s

    @property
    def next_seq(self) -> int:
        return self._seq + 1

    def advance(self, calls: int) -> None:
        """Records `calls` collectives made by native code (sequence numbers from `next_seq`
        on, in order, none skipped: the slots' reuse relies on it)."""
        self._seq += calls

    @staticmethod
    def fits_bytes(nbytes: int) -> bool:
        return nbytes <= SLOT_BYTES

    @staticmethod
    def _fits(x: torch.Tensor) -> bool:
        return x.is_cpu and x.is_contiguous() and x.numel() * x.element_size() <= SLOT_BYTES

    def _check(self, status: int) -> None:
        if status == 1:
            raise RuntimeError(f"tensor-parallel collective: no peer answer in "
                               f"{self.timeout_s:.0f} s (rank {self.rank} of {self.world})")
        if status:
            raise RuntimeError(f"shm_all_reduce rejected its arguments (status {status})")


def _segment_bytes(world: int) -> int:
    """One 64-byte flag line per rank, then two slots per rank (shm_all_reduce.cpp)."""
    return world * 64 + 2 * world * SLOT_BYTES


def _open_segment(path: str, create: bool, world: int) -> tuple[int, str]:
    """(fd, "") or (-1, why): rank 0 creates the zeroed segment, the others open it."""
    try:
        if not create:
            return os.open(path, os.O_RDWR), ""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, _segment_bytes(world))
        return fd, ""
    except OSError as e:
        return -1, str(e)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
