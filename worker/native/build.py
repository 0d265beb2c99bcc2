"""Cached, file-locked builds of shared libraries with the system C++ compiler.

A library is named `{tag}-{key}.so` in a cache directory, where `key` hashes the generated
source text, the bytes of every input file, the flags, the compiler's version and (for
`-march=native` builds) what the compiler resolves `native` to on this CPU. Paths inside
this checkout are hashed relative to it, so another clone or worktree of the same sources
finds the same key (and compiles nothing). A build compiles into a temporary file that is
renamed into place under a file lock, so concurrent processes (e.g. tensor-parallel
workers) build it once and never load a half-written library.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

# The checkout holding this file: paths under it enter a key as `<checkout>/...`.
CHECKOUT = Path(__file__).resolve().parents[2]


class CompilerUnavailable(RuntimeError):
    """No C++ compiler on this machine."""


class NativeBuildError(RuntimeError):
    """The compiler rejected a library's source."""


def compiler() -> str:
    cxx = shutil.which(os.environ.get("CXX") or "g++")
    if not cxx:
        raise CompilerUnavailable(f"no C++ compiler ({os.environ.get('CXX') or 'g++'} not "
                                  "found): install g++ or set CXX")
    return cxx


@functools.cache
def compiler_version(cxx: str) -> str:
    return subprocess.run([cxx, "--version"], check=False, capture_output=True,
                          text=True).stdout


@functools.cache
def native_macros(cxx: str) -> str:
    """The compiler's predefined macros under `-march=native`: this CPU's instruction-set
    features as the compiler sees them (`#define __AVX512F__ 1`, ...)."""
    return subprocess.run([cxx, "-march=native", "-dM", "-E", "-x", "c++", os.devnull],
                          check=False, capture_output=True, text=True).stdout


def no_amx_flags(macros: str) -> list[str]:
    """`-mno-amx-*` for every AMX extension the macros enable (`__AMX_TILE__` ->
    `-mno-amx-tile`): our kernels have no AMX code, and a VM may advertise AMX without
    granting its tile state, where any tile instruction raises SIGILL. Each flag is one the
    compiler knows, since it defined the macro."""
    found = re.findall(r"^#define __AMX_(\w+)__ 1$", macros, re.MULTILINE)
    return [f"-mno-amx-{name.lower().replace('_', '-')}" for name in sorted(set(found))]


def _compiler_identity(cxx: str, flags: Sequence[str]) -> str:
    """The compiler's version, plus what `-march=native` resolves to when the flags ask for
    it."""
    identity = compiler_version(cxx)
    if any(f.startswith("-march=native") for f in flags):
        identity += native_macros(cxx)
    return identity


def portable(text: str) -> str:
    """`text` with this checkout's path replaced by a placeholder (keys are the same in
    every clone)."""
    return text.replace(str(CHECKOUT), "<checkout>")


def fingerprint(text: str, inputs: Sequence[Path], flags: Sequence[str], cxx: str) -> str:
    digest = hashlib.sha256(portable(text).encode())
    for path in inputs:
        digest.update(Path(path).read_bytes())
    digest.update(portable("\0".join(flags)).encode())
    digest.update(_compiler_identity(cxx, flags).encode())
    return digest.hexdigest()[:20]


def library_target(text: str, inputs: Sequence[Path], flags: Sequence[str], directory: Path,
                   tag: str, *, link: Sequence[str] = (), cxx: str | None = None) -> Path:
    """Where the library of these inputs lives in `directory` (built or not)."""
    cxx = cxx or compiler()
    return directory / f"{tag}-{fingerprint(text, inputs, [*flags, *link], cxx)}.so"


def cached_library(text: str, inputs: Sequence[Path], flags: Sequence[str], directory: Path,
                   tag: str, *, link: Sequence[str] = (), error: type[Exception] = NativeBuildError,
                   cxx: str | None = None) -> Path:
    """The path of the library compiled from `text` (C++ that may #include `inputs`), built
    unless the cache already holds it. `link` goes after the source on the command line."""
    cxx = cxx or compiler()
    target = library_target(text, inputs, flags, directory, tag, link=link, cxx=cxx)
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            _compile(cxx, flags, link, text, target, error)
    return target


def _compile(cxx: str, flags: Sequence[str], link: Sequence[str], text: str, target: Path,
             error: type[Exception]) -> None:
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source = Path(tmp) / "library.cpp"
        source.write_text(text)
        output = Path(tmp) / target.name
        result = subprocess.run([cxx, *flags, str(source), "-o", str(output), *link],
                                check=False, capture_output=True, text=True)
        if result.returncode != 0:
            raise error(f"{Path(cxx).name} failed building {target.name}:\n"
                        f"{result.stderr[-8000:]}")
        os.replace(output, target)
