"""Fixtures of the fused cpu ops tests (imported by their modules): the library, and the ops
switched on whatever DELTASERVE_CPU_OPS says. Imported under these names; pytest knows them
as `ops` and `enabled`."""
from __future__ import annotations

import pytest

from worker.native import cpu_ops


@pytest.fixture(scope="module", name="ops")
def ops_fixture() -> cpu_ops.CpuOps:
    loaded = cpu_ops._load()
    if loaded is None:
        pytest.skip("the fused cpu ops do not build here")
    return loaded


@pytest.fixture(autouse=True, name="enabled")
def enabled_fixture(monkeypatch):
    monkeypatch.setattr(cpu_ops, "ENABLED", True)
