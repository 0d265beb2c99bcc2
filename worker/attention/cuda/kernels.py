"""The CUDA kernels' source and the one table of their template instantiations, with the
launch geometry both sides must agree on.

The same table feeds CuPy's `name_expressions` (worker/attention/cuda/cupy_backend.py), the CI compile
checks (tests/test_kernel_compile.py) and the CPU emulator (worker/emulator).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.native.library import KERNEL_DIR

SOURCES = ("common.cuh", "reshape_and_cache.cu", "paged_attention.cu")  # in include order
NVRTC_OPTIONS = ("-std=c++17",)
NUM_THREADS = 128
DECODE_ROWS = 8  # rows of the decode variant: one query token x up to 8 heads of a KV group
PREFILL_ROWS = 32  # rows of the prefill variant: 32 // heads_per_cta query tokens x heads
SMEM_DEFAULT_LIMIT = 48 * 1024  # above this a kernel must opt in to more dynamic smem

CTYPES = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
HEAD_DIMS = (64, 80, 96, 128, 256)
BLOCK_SIZES = (16, 32)


@dataclass(frozen=True)
class KernelConfig:
    """The kernels one attention layer needs, for one (dtype, head_dim, block_size)."""

    dtype: torch.dtype
    head_dim: int
    block_size: int

    @property
    def ctype(self) -> str:
        return CTYPES[self.dtype]

    @property
    def reshape_and_cache(self) -> str:
        return f"reshape_and_cache<{self.ctype}>"

    def attention(self, rows: int) -> str:
        return f"paged_attention<{self.ctype}, {self.head_dim}, {self.block_size}, {rows}>"

    @property
    def reduce(self) -> str:
        return f"attention_reduce<{self.ctype}, {self.head_dim}>"

    @property
    def kernels(self) -> tuple[str, ...]:
        return (self.reshape_and_cache, self.attention(DECODE_ROWS),
                self.attention(PREFILL_ROWS), self.reduce)

    @property
    def label(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}-d{self.head_dim}-bs{self.block_size}"


# The instantiation table: every (dtype, head_dim, block_size) the kernels are built for.
INSTANTIATIONS = tuple(KernelConfig(dtype, head_dim, block_size) for dtype in CTYPES
                       for head_dim in HEAD_DIMS for block_size in BLOCK_SIZES)


def config_for(dtype: torch.dtype, head_dim: int, block_size: int) -> KernelConfig:
    config = KernelConfig(dtype, head_dim, block_size)
    if config not in INSTANTIATIONS:
        raise ValueError(f"no CUDA attention kernel for dtype={dtype}, head_dim={head_dim}, "
                         f"block_size={block_size}; supported: dtypes "
                         f"{[str(d) for d in CTYPES]}, head_dim {HEAD_DIMS}, "
                         f"block_size {BLOCK_SIZES} (use attention_backend='torch')")
    return config


def name_expressions(configs: Sequence[KernelConfig] = INSTANTIATIONS) -> list[str]:
    """Every kernel of `configs` once, in table order."""
    return list(dict.fromkeys(name for config in configs for name in config.kernels))


def source_paths() -> list[Path]:
    return [KERNEL_DIR / name for name in SOURCES]


@functools.cache
def kernel_source() -> str:
    """All kernel sources as one NVRTC program: CuPy's cache key then covers every file.
    `#line` keeps compiler messages pointing at the real files."""
    parts = []
    for path in source_paths():
        parts.append(f'#line 1 "{path.name}"\n{path.read_text()}')
    return "\n".join(parts)


def attention_tile(row_bytes: int, rows: int) -> int:
    """Keys per tile (mirrors `ds::attention_tile` in paged_attention.cu)."""
    fit = 16384 // row_bytes
    tile = 64 if fit >= 64 else 32 if fit >= 32 else 16
    return tile // 2 if rows > 8 and tile > 16 else tile


def attention_smem_bytes(dtype: torch.dtype, head_dim: int, rows: int) -> int:
    """Dynamic shared memory of paged_attention (mirrors `ds::AttentionLayout::BYTES`; the
    emulator checks every launch against the kernel's own figure)."""
    itemsize = dtype.itemsize
    vec = 16 // itemsize
    tile = attention_tile(head_dim * itemsize, rows)
    q_bytes = rows * head_dim * 4
    kv_bytes = 2 * tile * (head_dim + vec) * itemsize
    p_bytes = -(-rows * (tile + 1) * 4 // 16) * 16
    return q_bytes + kv_bytes + p_bytes + 3 * rows * 4 + 128 * 4
