"""How this process's OpenMP threads wait (torch's libgomp, which our kernels share), as its
environment set libgomp up when it loaded: for the workers' startup line."""
from __future__ import annotations

import os
from collections.abc import Mapping


def describe(environ: Mapping[str, str] = os.environ) -> str:
    if "GOMP_SPINCOUNT" in environ:
        return f"OpenMP waits spin {environ['GOMP_SPINCOUNT']}x, then sleep"
    policy = environ.get("OMP_WAIT_POLICY", "").lower()
    if policy in ("passive", "active"):
        return f"OpenMP waits {'sleep' if policy == 'passive' else 'spin'} (OMP_WAIT_POLICY)"
    return "OpenMP waits spin, then sleep (libgomp's default)"
