"""Tier 1, no GPU needed: every instantiation in worker/attention/cuda/kernels.py's table compiles
exactly as CuPy's RawModule would (NVRTC through `cupy.cuda.nvrtc`, for sm_80 and sm_90) and
with `nvcc -cubin -Xptxas -v` (sm_90), and ptxas reports no register spills and no
local-memory stack frame for any kernel. Skipped, with the reason, where NVRTC or nvcc is
missing. The whole table compiles once per module, the three compilations side by side
(about a minute of CPU each); the ptxas reports are cached under
~/.cache/deltaserve/compile-check keyed by a hash of the exact inputs (source, names, flags,
compiler version), so a rerun on unchanged kernels is instant
(DELTASERVE_COMPILE_CHECK_CACHE=0 always recompiles).
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import multiprocessing
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from nvrtc_compile import nvrtc_compile

from worker.attention.cuda.kernels import (
    DECODE_ROWS,
    INSTANTIATIONS,
    KERNEL_DIR,
    NVRTC_OPTIONS,
    SOURCES,
    attention_smem_bytes,
    kernel_source,
    name_expressions,
)

ARCHS = ("sm_80", "sm_90")
NVCC_ARCH = "sm_90"
DECODE_REGISTER_BUDGET = 128  # 4 CTAs of 128 threads per SM (decode, rows up to 512 bytes)
SM80_MAX_SMEM = 163 * 1024  # opt-in dynamic shared memory per block on sm_80 (sm_90: 227 KiB)
pytestmark = pytest.mark.timeout(600)


def nvrtc_missing() -> str | None:
    try:
        from cupy.cuda import nvrtc
        nvrtc.getVersion()
    except Exception as e:  # ImportError, or NVRTC's shared library not found
        return f"NVRTC unavailable ({type(e).__name__}: {e}); pip install nvidia-cuda-nvrtc"
    return None


def nvcc_missing() -> str | None:
    return None if shutil.which("nvcc") else "nvcc not on PATH (CUDA toolkit not installed)"


@dataclass
class Resources:
    registers: int
    stack: int
    spill_stores: int
    spill_loads: int


def parse_ptxas(log: str) -> dict[str, Resources]:
    """ptxas -v output (nvcc's or NVRTC's) -> per mangled kernel name."""
    found = {}
    for block in re.split(r"Compiling entry function ", log)[1:]:
        name = re.match(r"'([^']+)'", block).group(1)
        frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                          r"(\d+) bytes spill loads", block)
        registers = re.search(r"Used (\d+) registers", block)
        found[name] = Resources(int(registers.group(1)), *map(int, frame.groups()))
    return found


def nvcc_source(names: list[str]) -> str:
    """The kernels plus host code taking each instantiation's address, which instantiates it."""
    table = "".join(f"    (void*)&{name},\n" for name in names)
    return f"{kernel_source()}\nstatic void* const instantiations[] = {{\n{table}}};\n"


NVCC_FLAGS = ["-std=c++17", "-ftz=true", f"-arch={NVCC_ARCH}", "-cubin", "-Xptxas", "-v"]


def _cache_path(*parts: str) -> Path | None:
    if os.environ.get("DELTASERVE_COMPILE_CHECK_CACHE", "1") == "0":
        return None
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]
    return Path("~/.cache/deltaserve/compile-check").expanduser() / f"{key}.json"


def _store(path: Path | None, value: dict) -> dict:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(value))
        os.replace(tmp, path)
    return value


def _nvrtc_job(arch: str) -> dict:
    result = nvrtc_compile(arch)
    return {"lowered": result.lowered, "log": result.log}


def _nvrtc_reports() -> dict[str, dict]:
    """Per arch {"lowered", "log"}: cached, or compiled in parallel processes (NVRTC holds
    the GIL)."""
    from cupy.cuda import nvrtc
    names = "\n".join(name_expressions())
    caches = {arch: _cache_path("nvrtc", kernel_source(), names, arch, *NVRTC_OPTIONS,
                                str(nvrtc.getVersion())) for arch in ARCHS}
    todo = [a for a in ARCHS if not (caches[a] and caches[a].exists())]
    reports = {a: json.loads(caches[a].read_text()) for a in ARCHS if a not in todo}
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=context) as pool:
        futures = {arch: pool.submit(_nvrtc_job, arch) for arch in todo}
        for arch, future in futures.items():
            reports[arch] = _store(caches[arch], future.result())
    return reports


class _Nvcc:
    """nvcc over the whole table, started in the background (or found in the cache)."""

    def __init__(self, directory: str) -> None:
        version = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout
        self.cache = _cache_path("nvcc", kernel_source(), "\n".join(name_expressions()),
                                 *NVCC_FLAGS, version)
        self.process = None
        if not (self.cache and self.cache.exists()):
            source = Path(directory) / "kernels.cu"
            source.write_text(nvcc_source(name_expressions()))
            self.process = subprocess.Popen(
                ["nvcc", *NVCC_FLAGS, str(source), "-o", str(source) + ".cubin"],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def report(self) -> dict:
        if self.process is None:
            return json.loads(self.cache.read_text())
        log = self.process.communicate()[0]
        value = {"returncode": self.process.returncode, "log": log}
        return _store(self.cache, value) if value["returncode"] == 0 else value


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """{"nvrtc": {arch: {"lowered", "log"}}, "nvcc": {"returncode", "log"}}; a missing tool's
    entry is left out. nvcc runs while NVRTC compiles."""
    nvcc = None if nvcc_missing() else _Nvcc(str(tmp_path_factory.mktemp("nvcc")))
    result = {"nvrtc": {} if nvrtc_missing() else _nvrtc_reports()}
    if nvcc is not None:
        result["nvcc"] = nvcc.report()
    return result


def _mangled_to_name(compiled) -> dict[str, str]:
    any_result = next(iter(compiled["nvrtc"].values()), None)
    return {v: k for k, v in any_result["lowered"].items()} if any_result else {}


def _assert_clean(report: dict[str, Resources], names: dict[str, str]) -> None:
    dirty = {names.get(k, k): r for k, r in report.items()
             if r.stack or r.spill_stores or r.spill_loads}
    assert not dirty, f"register spills or a stack frame: {dirty}"
    for mangled, r in report.items():
        name = names.get(mangled, mangled)
        if (name.startswith("paged_attention") and name.endswith(f", {DECODE_ROWS}>")
                and not name.startswith("paged_attention<float, 256")):
            assert r.registers <= DECODE_REGISTER_BUDGET, f"{name}: {r.registers} registers"


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_nvrtc_compiles_every_instantiation_without_spills(compiled, arch):
    if reason := nvrtc_missing():
        pytest.skip(reason)
    result = compiled["nvrtc"][arch]
    assert sorted(result["lowered"]) == sorted(name_expressions())
    report = parse_ptxas(result["log"])
    assert set(report) == set(result["lowered"].values()), "ptxas must report every kernel"
    _assert_clean(report, {v: k for k, v in result["lowered"].items()})


@pytest.mark.slow
def test_nvcc_compiles_every_instantiation_without_spills(compiled):
    if reason := nvcc_missing():
        pytest.skip(reason)
    nvcc = compiled["nvcc"]
    assert nvcc["returncode"] == 0, nvcc["log"][-4000:]
    report = parse_ptxas(nvcc["log"])
    assert len(report) == len(name_expressions())
    _assert_clean(report, _mangled_to_name(compiled))


def test_attention_kernels_use_16_byte_loads():
    if reason := nvrtc_missing():
        pytest.skip(reason)
    config = next(c for c in INSTANTIATIONS if c.head_dim == 128 and c.ctype == "__nv_bfloat16")
    ptx = nvrtc_compile("compute_90", config.kernels).binary.decode()
    bodies = dict(re.findall(r"\.entry (\w+)\((.*?)\n}", ptx, flags=re.S))
    for name, body in bodies.items():
        assert re.search(r"ld\.global(\.nc)?\.v4\.[ubf]32", body), f"{name}: no 16-byte loads"
        assert re.search(r"st\.global\.v4\.(u|b|f)32", body), f"{name}: no 16-byte stores"


def test_shared_memory_fits_every_architecture():
    for config in INSTANTIATIONS:
        assert attention_smem_bytes(config.dtype, config.head_dim, DECODE_ROWS) <= 48 * 1024
        for rows in (DECODE_ROWS, 32):
            assert attention_smem_bytes(config.dtype, config.head_dim, rows) <= SM80_MAX_SMEM


def test_sources_use_only_nvrtc_safe_headers():
    for name in SOURCES:
        text = re.sub(r"//[^\n]*", "", (KERNEL_DIR / name).read_text())  # code, not comments
        includes = re.findall(r"#include\s*[<\"]([^>\"]+)", text)
        assert set(includes) <= {"cuda_fp16.h", "cuda_bf16.h", "common.cuh"}, (name, includes)
        assert not re.search(r"\b(INFINITY|FLT_MAX|NAN)\b", text), name


def test_parse_ptxas_reads_spills():
    log = ("ptxas info    : Compiling entry function '_Z1kv' for 'sm_90'\n"
           "ptxas info    : Function properties for _Z1kv\n"
           "    8 bytes stack frame, 12 bytes spill stores, 16 bytes spill loads\n"
           "ptxas info    : Used 80 registers, used 1 barriers\n")
    assert parse_ptxas(log) == {"_Z1kv": Resources(80, 8, 12, 16)}
