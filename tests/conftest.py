"""Test-session settings: the repository on sys.path, and no thread oversubscription."""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Keep torch from oversubscribing the 2-core machine when tests spawn processes.
os.environ.setdefault("OMP_NUM_THREADS", "1")
