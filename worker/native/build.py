"""Cached, file-locked builds of shared libraries with the system C++ compiler.

A library is named `{tag}-{key}.so` in a cache directory, where `key` hashes the generated
source text, the bytes of every input file, the flags, the compiler's version and (for
`-march=native` builds) what the compiler resolves `native` to on this CPU. A build compiles
into a temporary file that is renamed into place under a file lock, so concurrent processes
(e.g. tensor-parallel workers) build it once and never load a half-written library.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path


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


def _compiler_identity(cxx: str, flags: Sequence[str]) -> bytes:
    """The compiler's version, plus its predefined macros under `-march=native` (the CPU's
    instruction-set features as the compiler sees them) when the flags ask for it."""
    identity = subprocess.run([cxx, "--version"], check=False, capture_output=True,
                              text=True).stdout
    if any(f.startswith("-march=native") for f in flags):
        identity += subprocess.run([cxx, "-march=native", "-dM", "-E", "-x", "c++", os.devnull],
                                   check=False, capture_output=True, text=True).stdout
    return identity.encode()


def fingerprint(text: str, inputs: Sequence[Path], flags: Sequence[str], cxx: str) -> str:
    digest = hashlib.sha256(text.encode())
    for path in inputs:
        digest.update(Path(path).read_bytes())
    digest.update("\0".join(flags).encode())
    digest.update(_compiler_identity(cxx, flags))
    return digest.hexdigest()[:20]


def cached_library(text: str, inputs: Sequence[Path], flags: Sequence[str], directory: Path,
                   tag: str, *, link: Sequence[str] = (), error: type[Exception] = NativeBuildError,
                   cxx: str | None = None) -> Path:
    """The path of the library compiled from `text` (C++ that may #include `inputs`), built
    unless the cache already holds it. `link` goes after the source on the command line."""
    cxx = cxx or compiler()
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"{tag}-{fingerprint(text, inputs, [*flags, *link], cxx)}.so"
    if target.exists():
        return target
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
