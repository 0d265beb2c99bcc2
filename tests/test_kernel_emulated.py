"""Tier 2, no GPU: the CUDA kernels (worker/kernels/*.cu) run on the CPU in the emulator
(worker/emulator: a fiber per CUDA thread, NaN-poisoned dynamic shared memory) through the
same planning and launch code as the CuPy backend, on random cases with NaN-poisoned caches
and permuted physical blocks, against the float64 reference and the torch backend.

Tolerances (atol = rtol, vs the float64 reference): float32 1e-5, float16 5e-3, bfloat16
3e-2; against the torch backend twice that (both carry their own rounding).
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from attention_cases import make_case, reference

from worker.attention.cuda.emulated_backend import EmulatedAttentionBackend
from worker.attention.cuda.kernels import KernelConfig, name_expressions, source_paths
from worker.attention.cuda.planner import SplitPolicy, launch_work_items
from worker.attention.torch_backend import TorchAttentionBackend
from worker.emulator import EmulatorUnavailable, KernelEmulationError, load_library
from worker.emulator.build import EMULATOR_DIR

TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
SPECS = {  # (context_len, query_len) per request
    "decode": [(0, 1), (15, 1), (16, 1), (17, 1), (100, 1), (31, 1)],
    "prefill": [(0, 5), (0, 16), (0, 33)],
    "prefill_with_context": [(16, 5), (7, 9), (32, 32), (48, 1), (3, 40)],
    "mixed": [(40, 1), (0, 7), (23, 1), (16, 16), (1, 1), (64, 3)],
    "long": [(300, 1), (0, 70), (250, 45), (511, 1), (33, 1)],
}
SPLITS = {"auto": None, "off": 0, "odd": 48}  # split_tokens: heuristic, never, 48 keys
HEADS = [(4, 4), (8, 2), (8, 1)]  # GQA ratios 1, 4, 8
MAIN = KernelConfig(torch.float32, 64, 16)
SHAPES = [KernelConfig(torch.bfloat16, 128, 16), KernelConfig(torch.float16, 128, 32),
          KernelConfig(torch.bfloat16, 64, 32), KernelConfig(torch.float32, 128, 32),
          KernelConfig(torch.float16, 256, 16), KernelConfig(torch.bfloat16, 96, 16),
          KernelConfig(torch.float32, 80, 32)]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def kernel_library():
    """One emulator library with every config used here; the backend finds it loaded."""
    try:
        return load_library(source_paths(), name_expressions([MAIN, *SHAPES]),
                            tag="attention-tests")
    except EmulatorUnavailable as e:
        pytest.skip(f"kernel emulator unavailable: {e}")


def _run(backend, case):
    backend.plan(case.metadata)
    return backend.forward(case.query, case.key, case.value, case.k_cache, case.v_cache,
                           case.metadata, case.scale)


def _check(split_tokens, specs, **case_args):
    """Emulated kernels vs the reference and the torch backend (on a fresh copy of the case:
    it zeroes the null block); returns the step's plan."""
    case, torch_case = make_case(specs, **case_args), make_case(specs, **case_args)
    out = _run(EmulatedAttentionBackend(split_tokens=split_tokens), case)
    n = case.query.shape[0] - case.num_padding
    tol = TOL[case.query.dtype]
    torch.testing.assert_close(out[:n].double(), reference(case), atol=tol, rtol=tol)
    expected = _run(TorchAttentionBackend(), torch_case)[:n]
    torch.testing.assert_close(out[:n].double(), expected.double(), atol=2 * tol, rtol=2 * tol)
    return case.metadata.plan


@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("window", [1, 7, 40])
def test_sliding_window_reads_only_its_keys(window, split):
    """Rows attend their last `window` keys; blocks before every row's window are NaN and
    named by the null block, so a read shows up as NaN (splits start at the window too)."""
    _check(SPLITS[split], SPECS["mixed"] + SPECS["long"] + SPECS["prefill_with_context"],
           num_heads=8, num_kv_heads=2, head_dim=64, num_padding=1, seed=window,
           sliding_window=window)


@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("kind", sorted(SPECS))
def test_matches_reference_and_torch(kind, heads, split):
    plan = _check(SPLITS[split], SPECS[kind], num_heads=heads[0], num_kv_heads=heads[1],
                  head_dim=64, num_padding=2, seed=len(kind) + heads[0] * heads[1])
    splits = [launch.num_splits for launch in plan.launches]
    if split == "off":
        assert splits == [1] * len(splits)
    if split == "odd" and kind in ("long", "mixed", "decode"):
        assert max(splits) > 1


@pytest.mark.parametrize("split", [0, 64])
@pytest.mark.parametrize("config", SHAPES, ids=lambda c: c.label)
def test_dtypes_and_head_dims(config, split):
    _check(split, SPECS["mixed"] + SPECS["long"][:2], num_heads=8, num_kv_heads=2,
           head_dim=config.head_dim, block_size=config.block_size, dtype=config.dtype,
           num_padding=1, seed=config.head_dim + split)


@pytest.mark.parametrize("seed", range(12))
def test_random_batches(seed):
    """Random mixes of decode rows, fresh prefills and chunks with cached context."""
    rng = random.Random(seed)
    config = [MAIN, SHAPES[0], SHAPES[1]][seed % 3]
    specs = [(rng.choice([0, rng.randrange(1, 40), rng.randrange(40, 700)]),
              rng.choice([1, 1, rng.randrange(2, 80)])) for _ in range(rng.randrange(1, 9))]
    heads = rng.choice([(4, 4), (8, 2), (8, 1), (6, 2), (16, 2)])
    split = rng.choice([None, 0, rng.randrange(16, 200)])
    _check(split, specs, num_heads=heads[0], num_kv_heads=heads[1], head_dim=config.head_dim,
           block_size=config.block_size, dtype=config.dtype, num_padding=rng.randrange(4),
           seed=seed)


@pytest.mark.parametrize("heads", [(12, 4), (32, 2), (16, 1)], ids=["group3", "group16",
                                                                    "mqa16"])
def test_groups_split_across_ctas(heads):
    """Groups of 3 and 16 heads: the decode variant holds 8 heads, so 16 take two CTAs."""
    plan = _check(None, SPECS["mixed"], num_heads=heads[0], num_kv_heads=heads[1], seed=7)
    assert plan.launches[0].heads_per_cta == {3: 3, 16: 8}[heads[0] // heads[1]]


def test_writes_new_kv_into_slots_and_skips_padding():
    case = make_case([(5, 3), (0, 1), (16, 1)], num_padding=3, seed=4)
    before = case.k_cache.clone(), case.v_cache.clone()
    _run(EmulatedAttentionBackend(), case)
    real = case.metadata.slot_mapping[:5]
    for cache, new, old in ((case.k_cache, case.key, before[0]),
                            (case.v_cache, case.value, before[1])):
        flat = cache.view(-1, *cache.shape[2:])
        torch.testing.assert_close(flat[real], new[:5], rtol=0, atol=0)
        changed = ~torch.isclose(cache, old, equal_nan=True)
        assert int(changed.any(-1).any(-1).sum()) == 5  # exactly the real slots


def test_strided_views_of_a_fused_qkv_tensor():
    case = make_case(SPECS["mixed"], num_heads=8, num_kv_heads=2, seed=9)
    fused = torch.cat([case.query, case.key, case.value], dim=1)  # [tokens, 8 + 2 + 2, 64]
    q, k, v = fused.split([8, 2, 2], dim=1)
    assert not q.is_contiguous() and not k.is_contiguous()
    backend = EmulatedAttentionBackend()
    backend.plan(case.metadata)
    out = backend.forward(q, k, v, case.k_cache, case.v_cache, case.metadata, case.scale)
    torch.testing.assert_close(out.double(), reference(case), atol=1e-5, rtol=1e-5)


def test_work_items_and_split_policy():
    items = launch_work_items([1, 40, 1, 0, 3], [10, 50, 99, 7, 3], decode=False, tokens_per_item=16)
    assert items.tolist() == [[1, 32, 8, 50], [1, 16, 16, 42], [1, 0, 16, 26], [4, 0, 3, 3]]
    assert launch_work_items([1, 40, 1], [10, 50, 99], decode=True, tokens_per_item=1)[:, 0].tolist() \
        == [2, 0]
    policy = SplitPolicy(target_ctas=264, min_split_tokens=256)
    assert policy.split_tokens(512, 4096) > 4096  # enough CTAs: no split
    assert policy.split_tokens(8, 4096) == 256  # few CTAs: as many splits as allowed
    assert policy.split_tokens(64, 4096) == 832  # ceil(264 / 64) = 5 splits, whole tiles
    assert policy.split_tokens(8, 300) > 300  # too short to split


def test_too_little_shared_memory_is_reported(monkeypatch):
    import worker.attention.cuda.planner as backend_module
    original = backend_module.attention_smem_bytes
    monkeypatch.setattr(backend_module, "attention_smem_bytes", lambda *a: original(*a) - 16)
    with pytest.raises(KernelEmulationError, match="needs .* bytes of dynamic shared memory"):
        _run(EmulatedAttentionBackend(), make_case([(3, 1)], seed=1))


SELFTEST = ["selftest_reduce", "selftest_read_unwritten_smem", "selftest_divergent_syncthreads",
            "selftest_divergent_shuffle", "selftest_deadlock", "selftest_shuffle_after_exit"]
PLANTED = {  # kernel -> what the report must say
    "selftest_divergent_syncthreads": r"divergent barrier: thread 32 reached __syncthreads at "
                                      r"selftest\.cu:\d+ while others wait at __syncthreads",
    "selftest_divergent_shuffle": r"divergent barrier: .*__syncwarp .* __shfl_xor_sync",
    "selftest_deadlock": r"deadlock: .*threads 0-15 wait at __shfl_xor_sync .*threads 16-63 "
                         r"wait at __syncthreads",
    "selftest_shuffle_after_exit": r"exited while lanes of its warp wait at __shfl_xor_sync",
}


@pytest.fixture(scope="module", params=["fast_switch", "ucontext"])
def selftest_library(request):
    source = EMULATOR_DIR / "selftest.cu"
    defines = ("KEMU_UCONTEXT",) if request.param == "ucontext" else ()
    return load_library([source], SELFTEST, tag=f"selftest-{request.param}", defines=defines)


def test_harness_runs_collectives_and_poisons_shared_memory(selftest_library):
    out = np.zeros(3 * 64, np.float32)
    selftest_library.launch("selftest_reduce", (3,), (64,), 0, [out])
    per_block = [2 * (block + 1) * sum(range(1, 33)) for block in range(3)]
    np.testing.assert_array_equal(out, np.repeat(per_block, 64))
    out = np.zeros(64, np.float32)
    selftest_library.launch("selftest_read_unwritten_smem", (1,), (64,), 256, [out])
    assert np.isnan(out).all()


@pytest.mark.parametrize("kernel", sorted(PLANTED))
def test_harness_reports_planted_bugs(selftest_library, kernel):
    out = np.zeros(64, np.float32)
    with pytest.raises(KernelEmulationError, match=PLANTED[kernel]):
        selftest_library.launch(kernel, (2,), (64,), 0, [out])
    selftest_library.launch("selftest_reduce", (1,), (64,), 0, [out])  # still usable
    assert out[0] == 2 * sum(range(1, 33))


def test_harness_checks_argument_types(selftest_library):
    out = np.zeros(64, np.float32)
    with pytest.raises(KernelEmulationError, match=r"takes \(p,\) but was given \(p,i4,\)"):
        selftest_library.launch("selftest_reduce", (1,), (64,), 0, [out, np.int32(1)])
