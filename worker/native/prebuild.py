"""Compiling the native libraries a worker's model uses before it reports ready (and every one
for `deltaserve kernels build`), so no step ever waits on a compiler and the step timeout
never fires because of one.

The libraries are the `NativeLibrary` declarations of the modules in PACKAGES (imported
here, so a library declared at module level there is prebuilt without being listed). Those
not in the cache compile side by side, one compiler per usable core; a library that fails
is reported and remembered (its loaders fall back to torch, as without a compiler).
"""
from __future__ import annotations

import importlib
import logging
import os
import pkgutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from worker.native.library import (
    LIBRARIES,
    UNAVAILABLE,
    KernelUse,
    NativeLibrary,
    cache_dir,
    local_includes,
)

logger = logging.getLogger("deltaserve")

PACKAGES = ("worker.native", "worker.distributed")


@dataclass
class BuildReport:
    compiled: dict[str, float] = field(default_factory=dict)  # tag -> seconds
    cached: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # tag -> the first line of why
    seconds: float = 0.0

    def summary(self) -> str:
        reasons: dict[str, list[str]] = {}
        for tag, why in self.failed.items():
            reasons.setdefault(why, []).append(tag)
        parts = [f"compiled {', '.join(f'{t} ({s:.1f} s)' for t, s in self.compiled.items())}"
                 f" in {self.seconds:.1f} s" if self.compiled else "",
                 f"{len(self.cached)} cached" if self.cached else "",
                 *(f"failed: {', '.join(tags)}: {why}" for why, tags in reasons.items())]
        return f"native kernels: {'; '.join(p for p in parts if p)} ({cache_dir()})"


def declared_libraries() -> list[NativeLibrary]:
    """Every library declared by the modules of PACKAGES, in tag order."""
    for package_name in PACKAGES:
        package = importlib.import_module(package_name)
        for module in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{package_name}.{module.name}")
    return [LIBRARIES[tag] for tag in sorted(LIBRARIES)]


def libraries_for(use: KernelUse) -> list[NativeLibrary]:
    """The declared libraries a model that calls what `use` says can load."""
    return [lib for lib in declared_libraries() if lib.needed is None or lib.needed(use)]


def prebuild(libraries: list[NativeLibrary] | None = None, jobs: int | None = None,
             say: Callable[[str], None] | None = logger.info) -> BuildReport:
    """Build what the cache lacks; `say` (None: silent) gets one line before compiling
    and one after, naming what was compiled and how long it took."""
    libraries = declared_libraries() if libraries is None else libraries
    report = BuildReport()
    pending = []
    for library in libraries:
        try:
            (report.cached if library.is_built() else pending).append(library)
        except UNAVAILABLE as e:  # no compiler: nothing can be built
            report.failed[library.tag] = _first_line(e)
    report.cached = [library.tag for library in report.cached]
    if not pending:
        return report
    if say:
        say(f"compiling native kernels for this CPU and compiler (once; cached in "
            f"{cache_dir()}): {', '.join(lib.tag for lib in pending)} ...")
    start = time.perf_counter()
    pending.sort(key=lambda lib: -sum(p.stat().st_size for p in local_includes(lib.source)))
    jobs = jobs or min(len(pending), len(os.sched_getaffinity(0)))  # the longest first
    with ThreadPoolExecutor(jobs) as pool:
        for library, outcome in zip(pending, pool.map(_timed_build, pending)):
            if isinstance(outcome, float):
                report.compiled[library.tag] = outcome
            else:
                report.failed[library.tag] = outcome
    report.seconds = time.perf_counter() - start
    if say:
        say(report.summary())
    return report


def _timed_build(library: NativeLibrary) -> float | str:
    start = time.perf_counter()
    try:
        library.path()
    except UNAVAILABLE as e:
        return _first_line(e)
    return time.perf_counter() - start


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
