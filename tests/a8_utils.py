"""What the 8-bit-activation kernel tests share (tests/test_gguf_a8_kernels.py,
tests/test_w8a8_kernels.py): the library, its ISA variants, heavy-tailed activations."""
from __future__ import annotations

import pytest
import torch

from worker.native import build as native_build
from worker.native import gguf_ops


def load_ops() -> gguf_ops.GgufOps:
    """The GGUF library, or a skip where there is no compiler."""
    try:
        return gguf_ops.load()
    except native_build.CompilerUnavailable as e:
        pytest.skip(f"no C++ compiler: {e}")


def detected_isa(ops: gguf_ops.GgufOps) -> str:
    """The best variant this build and CPU have (set_a8_isa fails above it); left selected."""
    for name in reversed(gguf_ops.A8_ISAS):
        try:
            ops.set_a8_isa(name)
            return name
        except ValueError:
            continue
    raise AssertionError("no variant at all")


def isas(ops: gguf_ops.GgufOps) -> list[str]:
    """Every variant this build and CPU have, from the lowest (scalar) to the best."""
    best = detected_isa(ops)
    return list(gguf_ops.A8_ISAS[:gguf_ops.A8_ISAS.index(best) + 1])


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    """[m, k] heavy-tailed rows with an outlier channel, as activations have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4
    x[:, 7 % k] *= 20
    return x


# What an AVX2 host without VNNI compiles, and the baseline build: (march, its variants,
# best first).
PORTABLE_BUILDS = [("x86-64-v3", ["avx2", "scalar"]), ("x86-64", ["scalar"])]


def portable_ops(march: str, variants: list[str]) -> gguf_ops.GgufOps:
    """The library built for `march`, its best variant checked to be `variants[0]`; a skip
    where this CPU can't run that build or there is no compiler."""
    if march == "x86-64-v3" and not torch.backends.cpu.get_cpu_capability().startswith("AVX"):
        pytest.skip("this CPU has no AVX2")
    try:
        ops = gguf_ops.load(march)
    except native_build.CompilerUnavailable as e:
        pytest.skip(f"no C++ compiler: {e}")
    assert ops.a8_isa == variants[0]
    return ops


def check_threads_agree(ops: gguf_ops.GgufOps, w: torch.Tensor, qtype: str, n: int,
                        k: int) -> None:
    """num_threads = 0 (a step of the native layer loop's team) gives the bits of a call of
    its own; 2 threads give the bits of 1 (each output is one tile's); accumulate adds."""
    code = gguf_ops.gguf_type(qtype).code | gguf_ops.A8_FLAG
    before = torch.get_num_threads()
    for m in (1, 7, 40):
        x = activations(m, k, seed=m)
        torch.set_num_threads(1)
        one = ops.matmul(x, w, qtype, n, k, a8=True)
        torch.set_num_threads(2)
        two = ops.matmul(x, w, qtype, n, k, a8=True)
        torch.set_num_threads(before)
        team = torch.empty(m, n)
        assert ops._matmul(code, w.data_ptr(), w.stride(0), x.data_ptr(), k, team.data_ptr(),
                           n, m, n, k, 0, 0) == 0
        assert torch.equal(one, two) and torch.equal(one, team), m
        acc = torch.ones(m, n)
        ops.matmul(x, w, qtype, n, k, out=acc, accumulate=True, a8=True)
        assert torch.equal(acc, one + 1)
