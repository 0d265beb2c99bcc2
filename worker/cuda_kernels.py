"""The CUDA kernels: their source, the one table of template instantiations, their launch
geometry, and loading them with CuPy (NVRTC) once per process.

The same table feeds CuPy's `name_expressions`, the CI compile checks
(tests/test_kernel_compile.py) and the CPU emulator (worker/emulator). CuPy is imported
lazily, so this module works on machines without it.
"""
from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
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


class CupyLauncher:
    """Launches the kernels of one config on a CUDA device, on torch's current stream, with
    tensors passed zero-copy through DLPack."""

    def __init__(self, config: KernelConfig, device: torch.device) -> None:
        self.device = device
        self.module = _cupy_module(config)
        self._functions: dict[str, object] = {}
        self._lock = threading.Lock()

    def _function(self, name: str, shared_mem: int) -> object:
        with self._lock:
            if name not in self._functions:
                self._functions[name] = self.module.get_function(name)
            function = self._functions[name]
        if shared_mem > max(SMEM_DEFAULT_LIMIT, function.max_dynamic_shared_size_bytes):
            function.max_dynamic_shared_size_bytes = shared_mem  # opt in above 48 KiB
        return function

    def launch(self, name: str, grid: Sequence[int], block: Sequence[int], shared_mem: int,
               args: Sequence[object]) -> None:
        import cupy
        function = self._function(name, shared_mem)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        with cupy.cuda.Device(self.device.index or 0), cupy.cuda.ExternalStream(stream):
            converted = tuple(cupy.from_dlpack(a) if isinstance(a, torch.Tensor) else a
                              for a in args)
            function(tuple(grid), tuple(block), converted, shared_mem=shared_mem)


@dataclass
class NvrtcResult:
    arch: str
    lowered: dict[str, str]  # name expression -> mangled kernel name
    log: str  # NVRTC's log; with `ptxas_verbose`, ptxas's per-kernel resource report
    binary: bytes  # the cubin for sm_XX, the PTX text for compute_XX


def nvrtc_compile(arch: str, names: Sequence[str] | None = None,
                  ptxas_verbose: bool = True) -> NvrtcResult:
    """Compile to a cubin for `arch` ("sm_90"; "compute_90" gives PTX) the way CuPy's
    RawModule does (NVRTC with CuPy's include options, -ftz=true, -arch=sm_XX,
    --device-as-default-execution-space, name expressions), but through `cupy.cuda.nvrtc`
    directly: CuPy's own helpers query the device, so they fail without a GPU. Raises
    RuntimeError with the compiler log on failure."""
    from cupy._core import core
    from cupy.cuda import nvrtc
    names = list(name_expressions() if names is None else names)
    options = [*core.assemble_cupy_compiler_options(NVRTC_OPTIONS), "-ftz=true",
               f"-arch={arch}", "--device-as-default-execution-space"]
    cubin = arch.startswith("sm_")
    if ptxas_verbose and cubin:
        options.append("-Xptxas=-v")
    program = nvrtc.createProgram(kernel_source(), "deltaserve_kernels.cu", [], [])
    try:
        for name in names:
            nvrtc.addNameExpression(program, name)
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC failed for {arch}:\n{nvrtc.getProgramLog(program)}") from e
        binary = nvrtc.getCUBIN(program) if cubin else nvrtc.getPTX(program)
        return NvrtcResult(arch, {n: nvrtc.getLoweredName(program, n) for n in names},
                           nvrtc.getProgramLog(program), binary)
    finally:
        nvrtc.destroyProgram(program)


@functools.cache
def _cupy_module(config: KernelConfig) -> object:
    """One NVRTC module per config, compiled on first use (CuPy caches cubins on disk)."""
    import cupy
    return cupy.RawModule(code=kernel_source(), options=NVRTC_OPTIONS, backend="nvrtc",
                          name_expressions=list(config.kernels))
