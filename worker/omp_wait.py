"""How long idle OpenMP threads spin before sleeping, set before torch loads libgomp."""
from __future__ import annotations

import os

# libgomp's default (OMP_WAIT_POLICY unset) spins an idle thread 300,000 iterations, about
# 8 ms on a 2-core EPYC host, after every parallel region. A worker is idle between steps
# for the engine core's and the front-end's whole turn, so its helper threads keep the cores
# those processes need (measured: a 256-request decode step of 2.3 ms grew to tens of ms
# when the host was busy). 10,000 iterations (~0.3 ms) still bridges the gaps between the
# parallel regions of one forward pass, so the forward is as fast as with the default,
# unlike OMP_WAIT_POLICY=PASSIVE or 1,000 iterations (both ~20% slower on the demo model).
SPIN_COUNT = "10000"


def bound_omp_spinning(environ: os._Environ | dict = os.environ) -> None:
    """Default GOMP_SPINCOUNT unless the user chose a wait policy or a spin count. Only
    effective before libgomp is loaded (it reads its environment once, at load)."""
    if "OMP_WAIT_POLICY" not in environ and "GOMP_SPINCOUNT" not in environ:
        environ["GOMP_SPINCOUNT"] = SPIN_COUNT
