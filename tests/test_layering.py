"""Imports run one way.

Top level: `launch` and `replay` may use everything below them; `engine_core` and `worker` use
`protocol` and `common` but never `launch`, `replay` or each other; `protocol` uses only
`common`, and `common` nothing of the project's.

One level down, each room keeps to its concern (FORBIDDEN below), and no module of the tree
takes part in an import circle, lazy (function-level) imports included.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("common", "protocol", "engine_core", "worker", "launch", "replay")
ALLOWED = {
    "common": set(),
    "protocol": {"common"},
    "engine_core": {"protocol", "common"},
    "worker": {"protocol", "common"},
    "launch": {"protocol", "common", "engine_core", "worker", "replay"},
    "replay": {"protocol", "common", "engine_core", "worker"},
}
# room -> modules (and everything below them) it must never import
FORBIDDEN = {
    "worker.native": ("worker.layers", "worker.models", "worker.attention", "worker.sample",
                      "worker.distributed", "worker.model_runner", "worker.input_batch",
                      "worker.worker_proc"),
    "worker.distributed": ("worker.layers", "worker.models", "worker.attention",
                           "worker.sample", "worker.model_runner", "worker.worker_proc"),
    "worker.attention": ("worker.layers", "worker.models", "worker.sample",
                         "worker.model_runner", "worker.input_batch", "worker.worker_proc"),
    "worker.layers": ("worker.models", "worker.sample", "worker.model_runner",
                      "worker.input_batch", "worker.worker_proc"),
    "worker.sample": ("worker.layers", "worker.models", "worker.attention",
                      "worker.model_runner", "worker.input_batch", "worker.worker_proc",
                      "worker.spec_decode"),
    "worker.models": ("worker.sample", "worker.model_runner", "worker.input_batch",
                      "worker.worker_proc", "worker.spec_decode"),
    "worker.spec_decode": ("worker.model_runner", "worker.worker_proc"),
    "worker.pooling": ("worker.models", "worker.sample", "worker.model_runner",
                       "worker.worker_proc", "worker.spec_decode"),
    "launch.model_cache": ("launch.processing", "launch.client", "launch.metrics",
                           "launch.entrypoints", "launch.cli", "launch.llm",
                           "launch.async_llm"),
    "launch.processing": ("launch.client", "launch.entrypoints", "launch.cli", "launch.llm",
                          "launch.async_llm"),
    "launch.metrics": ("launch.client", "launch.processing", "launch.entrypoints",
                       "launch.cli", "launch.llm", "launch.async_llm"),
    "launch.client": ("launch.entrypoints", "launch.cli", "launch.llm", "launch.async_llm"),
    "launch.entrypoints": ("launch.cli",),
    "engine_core.kv_cache": ("engine_core.sched", "engine_core.workers",
                             "engine_core.engine_core", "engine_core.engine_core_proc"),
    "engine_core.sched": ("engine_core.workers", "engine_core.structured_output",
                          "engine_core.engine_core", "engine_core.engine_core_proc"),
    "engine_core.spec_decode": ("engine_core.kv_cache", "engine_core.workers",
                                "engine_core.structured_output", "engine_core.engine_core",
                                "engine_core.engine_core_proc"),
    "engine_core.workers": ("engine_core.sched", "engine_core.spec_decode", "engine_core.kv_cache",
                            "engine_core.structured_output", "engine_core.engine_core",
                            "engine_core.engine_core_proc"),
    "engine_core.structured_output": ("engine_core.sched", "engine_core.kv_cache",
                                      "engine_core.workers", "engine_core.engine_core",
                                      "engine_core.engine_core_proc"),
}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def _imports(path: pathlib.Path, known: dict[str, pathlib.Path]) -> set[str]:
    """The project modules `path` imports (`from pkg import mod` counts as `pkg.mod`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names
                      if f"{node.module}.{a.name}" in known}
    return {name for name in found if name.split(".")[0] in PACKAGES}


def _inside(module: str, room: str) -> bool:
    return module == room or module.startswith(room + ".")


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_run_one_way(package):
    wrong = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        used = {m.split(".")[0] for m in _imports(path, {})} - {package}
        if used - ALLOWED[package]:
            wrong[str(path.relative_to(ROOT))] = sorted(used - ALLOWED[package])
    assert not wrong, f"imports against the layering: {wrong}"


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_rooms_keep_to_their_concern(room):
    modules = _modules()
    wrong = {}
    for name, path in sorted(modules.items()):
        if not _inside(name, room):
            continue
        bad = sorted(m for m in _imports(path, modules)
                     if any(_inside(m, f) for f in FORBIDDEN[room]))
        if bad:
            wrong[name] = bad
    assert not wrong, f"{room} imports what it must not: {wrong}"


def test_no_import_circles():
    modules = _modules()
    graph = {name: sorted(m for m in _imports(path, modules) if m in modules and m != name)
             for name, path in modules.items()}
    # A package's __init__ re-exporting its own modules is not a circle of concerns.
    graph = {name: [m for m in deps if not (_inside(name, m) and (ROOT / m.replace(".", "/")
                                                                  / "__init__.py").exists())]
             for name, deps in graph.items()}
    circles = _strongly_connected(graph)
    assert not circles, f"import circles: {circles}"


def _strongly_connected(graph: dict[str, list[str]]) -> list[list[str]]:
    """Components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(graph[child])))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found
