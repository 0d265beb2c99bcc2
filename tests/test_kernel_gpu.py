"""Tier 3 (marker `gpu`; skipped, with the reason, where there is no CUDA GPU): the CuPy
kernels against the float64 reference and the torch backend on CUDA at realistic sizes, and
the decode bandwidth benchmark. Backend selection is checked on any machine.

Tolerances as in test_kernel_emulated.py: float32 1e-5, float16 5e-3, bfloat16 3e-2 vs the
float64 reference; twice that vs the torch backend.
"""
from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest
import torch
from attention_cases import make_case, reference

from worker.attention.cuda.cupy_backend import cuda_unavailable_reason
from worker.attention.selector import make_attention_backend

REASON = cuda_unavailable_reason()
needs_gpu = pytest.mark.skipif(REASON is not None, reason=REASON or "")
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
_rng = random.Random(11)
SPECS = {
    "decode": [(_rng.randrange(0, 8192), 1) for _ in range(48)] + [(0, 1), (4095, 1)],
    "prefill": [(1000, 512), (0, 700), (4096, 256), (37, 129), (15, 1)],
    "mixed": [(_rng.randrange(0, 3000), 1) for _ in range(24)] + [(2048, 300), (0, 64)],
}


def _check(split_tokens, specs, **case_args):
    from worker.attention.cuda.cupy_backend import CupyAttentionBackend
    from worker.attention.torch_backend import TorchAttentionBackend
    host = make_case(specs, **case_args)
    ref, dtype, n = reference(host), host.query.dtype, host.query.shape[0] - host.num_padding
    outs = []
    for backend in (CupyAttentionBackend(torch.device("cuda"), split_tokens=split_tokens),
                    TorchAttentionBackend()):
        case = host.to("cuda")
        backend.plan(case.metadata)
        outs.append(backend.forward(case.query, case.key, case.value, case.k_cache,
                                    case.v_cache, case.metadata, case.scale)[:n].cpu())
    tol = TOL[dtype]
    torch.testing.assert_close(outs[0].double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(outs[0].double(), outs[1].double(), atol=2 * tol, rtol=2 * tol)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kind", sorted(SPECS))
@pytest.mark.parametrize("heads", [(32, 8), (64, 8), (16, 16), (32, 1)],
                         ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_cupy_matches_reference_and_torch(dtype, kind, heads):
    _check(None, SPECS[kind], num_heads=heads[0], num_kv_heads=heads[1], head_dim=128,
           dtype=dtype, num_padding=3, seed=len(kind))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("head_dim,block_size", [(64, 32), (80, 16), (96, 32), (256, 16)])
@pytest.mark.parametrize("split", [None, 0, 256])
def test_cupy_head_dims_and_splits(head_dim, block_size, split):
    _check(split, SPECS["mixed"], num_heads=16, num_kv_heads=4, head_dim=head_dim,
           block_size=block_size, dtype=torch.bfloat16, seed=head_dim)


@pytest.mark.gpu
@needs_gpu
def test_decode_bandwidth(capsys):
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_attention_gpu.py"
    spec = importlib.util.spec_from_file_location("bench_attention_gpu", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.measure(bench.parse_args([]))
    with capsys.disabled():
        print(f"\n{result}")
    if any(name in result.device for name in ("H100", "H200")):
        assert result.ratio >= bench.TARGET, result


def test_cupy_backend_needs_a_gpu():
    if REASON is None:
        pytest.skip("a CUDA GPU is present")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        make_attention_backend("cupy", torch.device("cpu"))


def test_backend_selection_without_a_gpu():
    assert make_attention_backend("auto", torch.device("cpu")).name in ("cpu", "torch")
    assert make_attention_backend("emulated", torch.device("cpu")).name == "emulated"
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        make_attention_backend("triton", torch.device("cpu"))
