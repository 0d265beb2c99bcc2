"""Shared fixtures and test-session settings."""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Keep torch from oversubscribing the 2-core machine when tests spawn processes.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def scheduler_factory():
    from sched_utils import make_scheduler
    return make_scheduler
