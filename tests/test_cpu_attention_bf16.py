"""The attention kernel's vdpbf16ps units for bfloat16 caches (cpu_paged_attention_bf16.h):
against the float64 reference and the widened bf16 path on the same random NaN-poisoned
cases as test_cpu_attention.py; the backend's choice (the widened path unless asked); builds
without AVX512-BF16 (x86-64-v3) ignore the request bit for bit."""
from __future__ import annotations

import pytest
import torch
from attention_cases import make_case, reference

from worker.attention.cpu_backend import CpuAttentionBackend
from worker.host.cpuinfo import cpuinfo_flags
from worker.native import build as native_build
from worker.native import cpu_attention
from worker.native.cpu_attention import BF16_DOT

TOL = 3e-2  # bfloat16, as test_cpu_attention.py
SPECS = {  # (context_len, query_len) per request
    "decode": [(0, 1), (15, 1), (16, 1), (17, 1), (100, 1), (31, 1), (300, 1)],
    "prefill": [(0, 5), (0, 16), (0, 33), (16, 5), (7, 9), (3, 40)],
    "mixed": [(40, 1), (0, 7), (23, 1), (16, 16), (1, 1), (64, 3), (250, 45), (511, 1)],
}
HAS_BF16 = "avx512_bf16" in cpuinfo_flags()
needs_bf16 = pytest.mark.skipif(not HAS_BF16, reason="this CPU has no AVX512-BF16")


@pytest.fixture(scope="module", autouse=True)
def kernel():
    try:
        return cpu_attention.load()
    except native_build.CompilerUnavailable as e:
        pytest.skip(f"no C++ compiler: {e}")


def _backend(kernel, flag: int) -> CpuAttentionBackend:
    """A backend whose bf16 calls carry exactly `flag` (0 or BF16_DOT)."""
    return CpuAttentionBackend(kernel, bf16_dot=bool(flag))


def _run(backend, case):
    backend.plan(case.metadata)
    n = case.query.shape[0] - case.num_padding
    return backend.forward(case.query, case.key, case.value, case.k_cache, case.v_cache,
                           case.metadata, case.scale)[:n]


def _case(kind, heads, head_dim, block_size, seed=0, **extra):
    return make_case(SPECS[kind], num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
                     block_size=block_size, dtype=torch.bfloat16, num_padding=1, seed=seed,
                     **extra)


@needs_bf16
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 32), (256, 16), (96, 16)])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("kind", sorted(SPECS))
def test_dot_units_match_reference_and_widened_path(kind, heads, head_dim, block_size):
    """head_dim 96 exercises the runtime-dim instantiation (a multiple of 32)."""
    assert cpu_attention.bf16_dot()
    dot = _run(_backend(cpu_attention.load(), BF16_DOT), _case(kind, heads, head_dim, block_size))
    widened = _run(_backend(cpu_attention.load(), 0), _case(kind, heads, head_dim, block_size))
    expected = reference(_case(kind, heads, head_dim, block_size))
    torch.testing.assert_close(dot.double(), expected, atol=TOL, rtol=TOL)
    torch.testing.assert_close(dot.double(), widened.double(), atol=2 * TOL, rtol=2 * TOL)


@needs_bf16
@pytest.mark.parametrize("window", [1, 5, 16, 40])
def test_dot_units_with_a_sliding_window(window):
    case = _case("mixed", (8, 2), 64, 16, seed=window, sliding_window=window)
    out = _run(_backend(cpu_attention.load(), BF16_DOT), case)
    torch.testing.assert_close(out.double(), reference(case), atol=TOL, rtol=TOL)


@needs_bf16
def test_dot_units_never_pair_a_row_with_keys_it_cannot_see():
    """A prefill row that sees key t but not t + 1 (a later token whose value is inf) gets t
    alone: 0 * inf must not turn it into NaN."""
    for first in range(4):  # the inf key at either position of a pair
        case = make_case([(20 + first, 9)], num_heads=8, num_kv_heads=2, head_dim=64,
                         dtype=torch.bfloat16, seed=3)
        expected = reference(case)[:6]
        case.value[6] = float("inf")
        out = _run(_backend(cpu_attention.load(), BF16_DOT), case)
        torch.testing.assert_close(out[:6].double(), expected, atol=TOL, rtol=TOL)
        assert not out[6:].isfinite().all()


@pytest.mark.parametrize("forced", ["0", "1"])
@pytest.mark.parametrize("asked,flag", [(None, 0), (False, 0), (True, BF16_DOT)])
def test_backend_asks_for_the_units_only_when_told(monkeypatch, forced, asked, flag):
    """The widened path is the default (faster where measured, cpu_backend.py); the
    DELTASERVE_CPU_BF16 override does not change it."""
    monkeypatch.setenv("DELTASERVE_CPU_BF16", forced)
    backend = CpuAttentionBackend(bf16_dot=asked)
    assert backend._codes[torch.bfloat16] == 1 | flag
    assert backend._codes[torch.float32] == 0 and backend._codes[torch.float16] == 2
    case = _case("mixed", (8, 2), 64, 16, seed=5)
    torch.testing.assert_close(_run(backend, case).double(), reference(case), atol=TOL, rtol=TOL)


def test_avx2_build_ignores_the_request():
    """An x86-64-v3 build has no vdpbf16ps: BF16_DOT gives the widened path's bits."""
    kernel = cpu_attention.load("x86-64-v3")
    assert not cpu_attention.bf16_dot("x86-64-v3")
    for kind in sorted(SPECS):
        asked = _run(_backend(kernel, BF16_DOT), _case(kind, (8, 2), 64, 16, seed=1))
        plain = _run(_backend(kernel, 0), _case(kind, (8, 2), 64, 16, seed=1))
        assert torch.equal(asked, plain)
        torch.testing.assert_close(asked.double(), reference(_case(kind, (8, 2), 64, 16, seed=1)),
                                   atol=TOL, rtol=TOL)
