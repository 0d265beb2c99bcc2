"""Imports run one way: `launch` and `replay` may use everything below them; `engine_core` and
`worker` use `protocol` and `common` but never `launch`, `replay` or each other; `protocol`
uses only `common`, and `common` nothing of the project's."""
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


def _imported_packages(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_run_one_way(package):
    wrong = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        used = _imported_packages(path) & set(PACKAGES) - {package}
        if used - ALLOWED[package]:
            wrong[str(path.relative_to(ROOT))] = sorted(used - ALLOWED[package])
    assert not wrong, f"imports against the layering: {wrong}"
