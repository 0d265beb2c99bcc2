"""Compiling the CUDA kernels for a given architecture without a GPU (tests only): NVRTC as
CuPy's RawModule runs it, but through `cupy.cuda.nvrtc` directly, since CuPy's own helpers
query a device."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from worker.attention.cuda.kernels import NVRTC_OPTIONS, kernel_source, name_expressions


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
