"""The native kernels' build and cache (worker/native/{build,library,prebuild}.py): keys that
follow the sources, flags, compiler and CPU but not the checkout's path (a second clone
compiles nothing), every library compiled before the first step, failures remembered, and
no AMX in anything we build (a VM may advertise AMX without granting it)."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from worker.native import build, library, prebuild
from worker.native.library import KERNEL_DIR, LIBRARIES, NativeLibrary

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ("from worker.native.prebuild import declared_libraries\n"
           "from worker.native import library\n"
           "for lib in declared_libraries():\n"
           "    print(lib.tag, library.build.library_target(*lib._build_args('native'), "
           "library.cache_dir(), lib.tag).name, lib.is_built())\n")


def _library(tag: str) -> NativeLibrary:
    """A declared library (declared_libraries imports every declaring module)."""
    return {lib.tag: lib for lib in prebuild.declared_libraries()}[tag]


def _targets(cwd: Path) -> dict[str, tuple[str, str]]:
    out = subprocess.run([sys.executable, "-c", TARGETS], cwd=cwd, check=True,
                         capture_output=True, text=True).stdout
    return {tag: (name, built) for tag, name, built in (line.split() for line in
                                                        out.splitlines())}


@pytest.mark.slow
def test_a_second_checkout_compiles_nothing(tmp_path):
    """A copy of the sources elsewhere finds every library this checkout built."""
    prebuild.prebuild(say=None)
    clone = tmp_path / "elsewhere"
    shutil.copytree(ROOT / "worker", clone / "worker",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "protocol", clone / "protocol",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "common", clone / "common",
                    ignore=shutil.ignore_patterns("__pycache__"))
    here, there = _targets(ROOT), _targets(clone)
    assert here == there and {built for _, built in there.values()} == {"True"}
    # ... while a changed header changes the key of (only) the libraries including it
    header = clone / "worker" / "kernels" / "cpu_exp.h"
    header.write_text(header.read_text() + "\n// changed\n")
    changed = {tag for tag, target in _targets(clone).items() if target != here[tag]}
    users = {lib.tag for lib in prebuild.declared_libraries()
             if KERNEL_DIR / "cpu_exp.h" in library.local_includes(lib.source)}
    assert changed == users and "cpu-ops" in changed and "gguf-matmul" not in changed


def test_keys_follow_the_flags_and_the_checkout_path_does_not(monkeypatch):
    lib = _library("cpu-ops")
    text, inputs, flags = lib._build_args("native")
    cxx = build.compiler()
    key = build.fingerprint(text, inputs, flags, cxx)
    assert "-I" + str(KERNEL_DIR) in flags and str(build.CHECKOUT) in flags[-1]
    assert build.fingerprint(text, inputs, [*flags, "-DX"], cxx) != key
    monkeypatch.setattr(build, "CHECKOUT", Path("/some/other/clone"))
    assert build.fingerprint(text, inputs, flags, cxx) != key  # the path is no longer masked


def test_every_library_in_the_code_is_prebuilt():
    """Each NativeLibrary declared anywhere in the worker is one
    the prebuild knows, so no library can be compiled lazily inside a step."""
    declared = {lib.tag for lib in prebuild.declared_libraries()}
    pattern = re.compile(r'(?:NativeLibrary|build_library)\(\s*"([\w-]+)"')
    in_code = {tag for path in (ROOT / "worker").rglob("*.py")
               for tag in pattern.findall(path.read_text())}
    assert in_code and in_code <= declared


def test_a_step_never_compiles(tmp_path, monkeypatch):
    """With an empty cache, the model runner compiles every library its model uses before it
    exists and nothing during steps (the compiler here copies this checkout's cached builds,
    whose keys are the same). int8 weights: the native layer loop and every kernel library a
    dense model at TP=1 uses run; the experts' and the ranks' libraries are not compiled."""
    from model_utils import make_tiny_model

    from engine_core import CacheConfig, Request, Scheduler, SchedulerConfig
    from protocol import EngineConfig, SamplingParams
    from worker.model_runner import ModelRunner
    prebuild.prebuild(say=None)
    real_cache, phase, compiled = library.cache_dir(), ["init"], []

    def fake_compile(cxx, flags, link, text, target, error):
        compiled.append((target.name.rsplit("-", 1)[0], phase[0]))
        shutil.copy(real_cache / target.name, target)

    model_dir = make_tiny_model(str(tmp_path / "model"))
    monkeypatch.setenv("DELTASERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_compile", fake_compile)
    runner = ModelRunner(EngineConfig(model=model_dir, quantization="int8",
                                      num_gpu_blocks_override=64, max_model_len=128))
    phase[0] = "step"
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256,
                                          max_model_len=128), CacheConfig(16, 64, True))
    scheduler.add_request(Request("0", list(range(1, 20)), SamplingParams(max_tokens=4), 0.0))
    while scheduler.has_unfinished_requests():
        so = scheduler.schedule()
        scheduler.update_from_output(so, runner.execute_model(so))
    assert runner.model.model.native_loop  # the native layer loop ran the decode steps
    used = prebuild.libraries_for(library.KernelUse(experts=False, tensor_parallel=False))
    assert {tag for tag, _ in compiled} == {lib.tag for lib in used}
    assert {"fused-moe", "shm-all-reduce"}.isdisjoint(lib.tag for lib in used)
    assert {when for _, when in compiled} == {"init"}


def test_a_moe_model_and_ranks_get_their_libraries():
    every = {lib.tag for lib in prebuild.declared_libraries()}
    assert {lib.tag for lib in prebuild.libraries_for(library.KernelUse())} == every
    dense = {lib.tag for lib in prebuild.libraries_for(library.KernelUse(experts=False))}
    assert every - dense == {"fused-moe"}


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """A library of one source file in tmp_path (its own kernel directory and cache; this
    process's failure records set aside): (the source's path, the library)."""
    monkeypatch.setattr(library, "KERNEL_DIR", tmp_path)
    monkeypatch.setattr(library, "_FAILURES", {})
    monkeypatch.setenv("DELTASERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    try:
        yield tmp_path / "scratch.cpp", NativeLibrary("scratch-test", "scratch.cpp",
                                                      (f"-I{tmp_path}",))
    finally:
        LIBRARIES.pop("scratch-test", None)


SCRATCH = 'extern "C" __attribute__((visibility("default"))) int answer() { return 42; }\n'
# Another process building the scratch library (as a tensor-parallel peer or `deltaserve
# kernels build` would): argv[1] is its kernel directory.
BUILD_SCRATCH = ("import sys; from pathlib import Path; from worker.native import library\n"
                 "library.KERNEL_DIR = Path(sys.argv[1])\n"
                 "print(library.NativeLibrary('scratch-test', 'scratch.cpp',\n"
                 "                            ('-I' + sys.argv[1],)).path())\n")


def test_a_rejected_source_is_reported_once_and_not_recompiled(scratch, monkeypatch):
    source, broken = scratch
    source.write_text("this is not C++\n")
    lines: list[str] = []
    report = prebuild.prebuild([broken], say=lines.append)
    assert list(report.failed) == ["scratch-test"] and not report.compiled
    assert "compiling" in lines[0] and "failed: scratch-test" in lines[1]
    calls = []
    monkeypatch.setattr(build, "_compile", lambda *a: calls.append(a))
    with pytest.raises(build.NativeBuildError):
        broken.path()
    assert calls == []


def test_a_failure_is_forgotten_once_the_source_changes(scratch):
    """A source fixed after a failed build (a kernel edited while a process runs) builds:
    the failure belongs to the inputs that failed, not to the library's name."""
    source, lib = scratch
    source.write_text("this is not C++\n")
    with pytest.raises(build.NativeBuildError):
        lib.path()
    source.write_text(SCRATCH)
    assert lib.path().exists() and lib.is_built()


def test_a_failure_does_not_hide_another_process_build(scratch, monkeypatch, tmp_path):
    """A build that failed here for a passing reason (its compiler killed) while another
    process then built the same inputs: this process loads that library rather than repeat
    its failure (and its loaders' "unavailable, using torch" warning)."""
    source, lib = scratch
    source.write_text(SCRATCH)

    def killed(*args) -> None:
        raise build.NativeBuildError("g++ was killed")
    monkeypatch.setattr(build, "_compile", killed)
    with pytest.raises(build.NativeBuildError, match="killed"):
        lib.path()
    built = subprocess.run([sys.executable, "-c", BUILD_SCRATCH, str(tmp_path)], cwd=ROOT,
                           check=True, capture_output=True, text=True).stdout.strip()
    assert lib.path() == Path(built) and lib.path().exists()  # nothing compiled here


def test_concurrent_builds_compile_once(tmp_path, monkeypatch):
    """Two threads (as two tensor-parallel ranks) building the same library into an empty
    cache: one compiles under the lock, the other waits and loads the same file."""
    monkeypatch.setenv("DELTASERVE_KERNEL_CACHE", str(tmp_path))
    paths: list[Path] = []
    threads = [threading.Thread(target=lambda: paths.append(_library("cpu-threads").path()))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(paths)) == 1 and paths[0].exists()
    assert [p.name for p in tmp_path.glob("*.so")] == [paths[0].name]


def test_a_declaration_is_one_per_tag():
    _library("cpu-ops")
    with pytest.raises(ValueError, match="declared twice"):
        NativeLibrary("cpu-ops", "cpu_ops.cpp", ("-DOTHER",))


MACROS = "#define __AVX512F__ 1\n#define __AMX_TILE__ 1\n#define __AMX_BF16__ 1\n" \
         "#define __AMX_INT8__ 1\n#define __AMX_COMPLEX__ 1\n"


def test_amx_is_stripped_from_native_builds():
    assert build.no_amx_flags(MACROS) == ["-mno-amx-bf16", "-mno-amx-complex",
                                          "-mno-amx-int8", "-mno-amx-tile"]
    assert build.no_amx_flags("#define __AVX512F__ 1\n") == []


def test_the_strip_flags_leave_no_amx_on_an_amx_target():
    """What -march=native resolves to on an AMX host (Sapphire Rapids here): with our flags
    the compiler defines no AMX macro, so no AMX intrinsic or instruction is available."""
    cxx = build.compiler()

    def macros(*flags: str) -> str:
        return subprocess.run([cxx, *flags, "-dM", "-E", "-x", "c++", "/dev/null"],
                              capture_output=True, text=True, check=True).stdout
    amx = macros("-march=sapphirerapids")
    if "__AMX_TILE__" not in amx:
        pytest.skip(f"{cxx} does not know Sapphire Rapids' AMX")
    stripped = macros("-march=sapphirerapids", *build.no_amx_flags(amx))
    assert "__AMX" not in stripped and "__AVX512BF16__" in stripped


@pytest.mark.slow
def test_our_kernels_hold_no_tile_instruction_on_an_amx_target(tmp_path, monkeypatch):
    """The kernels built for Sapphire Rapids (an AMX CPU) as -march=native would there:
    AVX-512 code, and not one AMX instruction, so they cannot SIGILL where the tile state is
    not granted."""
    monkeypatch.setenv("DELTASERVE_KERNEL_CACHE", str(tmp_path))
    amx_macros = subprocess.run([build.compiler(), "-march=sapphirerapids", "-dM", "-E", "-x",
                                 "c++", "/dev/null"], capture_output=True, text=True).stdout
    monkeypatch.setattr(library, "march_flags", lambda march="native": [
        "-march=sapphirerapids", *build.no_amx_flags(amx_macros)])
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("no objdump")
    path = _library("cpu-ops").path()
    code = subprocess.run([objdump, "-d", "--no-show-raw-insn", str(path)],
                          capture_output=True, text=True, check=True).stdout
    assert "zmm" in code
    assert not re.search(r"\b(ldtilecfg|sttilecfg|tileloadd|tilestored|tdp\w+|tilezero|"
                         r"tilerelease)\b", code)
