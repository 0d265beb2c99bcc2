"""The native CPU attention kernel (worker/kernels/cpu_paged_attention.cpp) against the float64
reference and the torch backend, on the same random cases and tolerances as the emulated CUDA
kernels: NaN-poisoned caches (any read past a request's keys shows up as NaN), permuted
physical blocks, partial last blocks, GQA 1/4/8 (and 3, 16), decode rows, prefills with and
without cached context, padding tokens, float32/bfloat16/float16 and several head dims.

Tolerances (atol = rtol, vs the float64 reference): float32 1e-5, float16 5e-3, bfloat16
3e-2; against the torch backend twice that.
"""
from __future__ import annotations

import logging
import random
import sys

import pytest
import torch
from attention_cases import make_case, reference

from worker.attention import selector
from worker.attention.cpu_backend import CpuAttentionBackend, tile_work_items
from worker.attention.torch_backend import TorchAttentionBackend
from worker.native import build as native_build
from worker.native import cpu_attention

TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
SPECS = {  # (context_len, query_len) per request
    "decode": [(0, 1), (15, 1), (16, 1), (17, 1), (100, 1), (31, 1)],
    "prefill": [(0, 5), (0, 16), (0, 33)],
    "prefill_with_context": [(16, 5), (7, 9), (32, 32), (48, 1), (3, 40)],
    "mixed": [(40, 1), (0, 7), (23, 1), (16, 16), (1, 1), (64, 3)],
    "long": [(300, 1), (0, 70), (250, 45), (511, 1), (33, 1)],
}
HEADS = [(4, 4), (8, 2), (8, 1)]  # GQA ratios 1, 4, 8
SHAPES = [  # dtype, head_dim, block_size
    (torch.bfloat16, 128, 16), (torch.float16, 128, 32), (torch.bfloat16, 64, 32),
    (torch.float32, 128, 32), (torch.float16, 256, 16), (torch.bfloat16, 96, 16),
    (torch.float32, 80, 32), (torch.float16, 64, 16)]


@pytest.fixture(scope="module", autouse=True)
def kernel():
    try:
        return cpu_attention.load()
    except native_build.CompilerUnavailable as e:
        pytest.skip(f"no C++ compiler: {e}")


def _run(backend, case, query=None, key=None, value=None):
    backend.plan(case.metadata)
    return backend.forward(case.query if query is None else query,
                           case.key if key is None else key,
                           case.value if value is None else value,
                           case.k_cache, case.v_cache, case.metadata, case.scale)


def _check(specs, **case_args):
    """The kernel vs the reference and the torch backend (on a fresh copy of the case)."""
    case, torch_case = make_case(specs, **case_args), make_case(specs, **case_args)
    out = _run(CpuAttentionBackend(), case)
    n = case.query.shape[0] - case.num_padding
    tol = TOL[case.query.dtype]
    assert out.dtype == case.query.dtype and out.shape == case.query.shape
    torch.testing.assert_close(out[:n].double(), reference(case), atol=tol, rtol=tol)
    expected = _run(TorchAttentionBackend(), torch_case)[:n]
    torch.testing.assert_close(out[:n].double(), expected.double(), atol=2 * tol, rtol=2 * tol)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("kind", sorted(SPECS))
def test_matches_reference_and_torch(kind, heads):
    _check(SPECS[kind], num_heads=heads[0], num_kv_heads=heads[1], head_dim=64, num_padding=2,
           seed=len(kind) + heads[0] * heads[1])


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{str(s[0])[6:]}-d{s[1]}-b{s[2]}")
def test_dtypes_and_head_dims(shape):
    dtype, head_dim, block_size = shape
    _check(SPECS["mixed"] + SPECS["long"][:2], num_heads=8, num_kv_heads=2, head_dim=head_dim,
           block_size=block_size, dtype=dtype, num_padding=1, seed=head_dim + block_size)


@pytest.mark.parametrize("heads", [(12, 4), (32, 2), (16, 1), (9, 3)],
                         ids=["group3", "group16", "mqa16", "smollm2"])
def test_odd_and_large_groups(heads):
    """Groups that do not divide the 32-row tile, and groups of 16 (two tokens per tile)."""
    _check(SPECS["mixed"] + SPECS["prefill_with_context"], num_heads=heads[0],
           num_kv_heads=heads[1], num_padding=1, seed=heads[0])


@pytest.mark.parametrize("seed", range(8))
def test_random_batches(seed):
    """Random mixes of decode rows, fresh prefills and chunks with cached context."""
    rng = random.Random(seed)
    dtype, head_dim, block_size = [(torch.float32, 64, 16), *SHAPES[:2]][seed % 3]
    specs = [(rng.choice([0, rng.randrange(1, 40), rng.randrange(40, 700)]),
              rng.choice([1, 1, rng.randrange(2, 80)])) for _ in range(rng.randrange(1, 9))]
    heads = rng.choice([(4, 4), (8, 2), (8, 1), (6, 2), (16, 2)])
    _check(specs, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
           block_size=block_size, dtype=dtype, num_padding=rng.randrange(4), seed=seed)


@pytest.mark.parametrize("window", [1, 5, 16, 33, 100])
@pytest.mark.parametrize("heads", [(4, 1), (8, 2)], ids=["mqa4", "gqa4"])
def test_sliding_window_reads_only_its_keys(window, heads):
    """Each row attends its last `window` keys; blocks before every row's window are NaN and
    named by the null block (a read shows up as NaN)."""
    _check(SPECS["mixed"] + SPECS["long"] + SPECS["prefill_with_context"], num_heads=heads[0],
           num_kv_heads=heads[1], num_padding=1, seed=window, sliding_window=window)
    _check(SPECS["long"], num_heads=heads[0], num_kv_heads=heads[1], head_dim=256,
           block_size=32, seed=window, sliding_window=window)


def test_writes_new_kv_into_slots_and_skips_padding():
    case = make_case([(5, 3), (0, 1), (16, 1)], num_padding=3, seed=4)
    before = case.k_cache.clone(), case.v_cache.clone()
    _run(CpuAttentionBackend(), case)
    real = case.metadata.slot_mapping[:5]
    for cache, new, old in ((case.k_cache, case.key, before[0]),
                            (case.v_cache, case.value, before[1])):
        flat = cache.view(-1, *cache.shape[2:])
        torch.testing.assert_close(flat[real], new[:5], rtol=0, atol=0)
        changed = ~torch.isclose(cache, old, equal_nan=True)
        assert int(changed.any(-1).any(-1).sum()) == 5  # exactly the real slots, null block too


def test_strided_views_of_a_fused_qkv_tensor():
    case = make_case(SPECS["mixed"], num_heads=8, num_kv_heads=2, seed=9)
    fused = torch.cat([case.query, case.key, case.value], dim=1)  # [tokens, 8 + 2 + 2, 64]
    q, k, v = fused.split([8, 2, 2], dim=1)
    assert not q.is_contiguous() and not k.is_contiguous()
    out = _run(CpuAttentionBackend(), case, q, k, v)
    torch.testing.assert_close(out.double(), reference(case), atol=1e-5, rtol=1e-5)


def test_work_items_tile_queries_and_put_costly_first():
    items = tile_work_items([1, 40, 1, 3], [10, 50, 99, 3], group=2)  # 16 tokens per tile
    # costs (keys x tokens): 672, 416, 400, 99, 10, 9
    assert items.tolist() == [[1, 16, 32], [1, 0, 16], [1, 32, 40], [2, 0, 1], [0, 0, 1],
                              [3, 0, 3]]
    assert tile_work_items([1, 1], [5, 9], group=64).tolist() == [[1, 0, 1], [0, 0, 1]]


def test_layers_share_one_plan_per_head_group():
    case = make_case(SPECS["mixed"], num_heads=8, num_kv_heads=2, seed=2)
    backend = CpuAttentionBackend()
    _run(backend, case)
    plan = case.metadata.plan
    backend.forward(case.query, case.key, case.value, case.k_cache, case.v_cache,
                    case.metadata, case.scale)
    assert case.metadata.plan is plan


def test_without_a_compiler_falls_back_to_torch_with_one_warning(monkeypatch, caplog):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setattr(selector, "_fallback_warned", False)
    cpu_attention.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="deltaserve"):
            backends = [selector.make_attention_backend("cpu", torch.device("cpu"))
                        for _ in range(2)]
    finally:
        cpu_attention.load.cache_clear()
    assert [b.name for b in backends] == ["torch", "torch"]
    warnings = [r for r in caplog.records if "cpu attention kernel unavailable" in r.message]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0].message


E2E_MODELS = {  # name -> (architecture, config overrides)
    "llama-d64-gqa": ("llama", {"hidden_size": 256, "num_attention_heads": 4,
                                "num_key_value_heads": 2}),
    "qwen3-d128-mqa": ("qwen3", {"hidden_size": 128, "num_attention_heads": 4,
                                 "num_key_value_heads": 1, "head_dim": 128}),
}
_rng = random.Random(5)
_SHARED = [_rng.randrange(1, 250) for _ in range(40)]
WAVES = [  # the second wave runs after the first, so its shared prefix hits the cache
    [_SHARED + [_rng.randrange(1, 250) for _ in range(n)] for n in (3, 30)]
    + [[_rng.randrange(1, 250) for _ in range(n)] for n in (90, 1, 5)],
    [_SHARED + [7, 8, 9], _SHARED[:33], _SHARED[:16] + [11]],
]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(E2E_MODELS))
def test_engine_matches_hf_greedy(name, tmp_path):
    """`LLM(attention_backend="cpu")`: chunked prefills (a 24-token budget chunks the 90- and
    70-token prompts), decode and prefix-cache hits give Hugging Face's greedy tokens."""
    from model_utils import assert_greedy_matches, hf_greedy, make_tiny_model

    from launch import LLM, SamplingParams
    arch, overrides = E2E_MODELS[name]
    path = make_tiny_model(str(tmp_path / "model"), arch, tokenizer=True, **overrides)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(path, dtype="float32", attention_backend="cpu", block_size=16,
             max_num_batched_tokens=24, num_gpu_blocks_override=64, max_model_len=256) as llm:
        assert llm.engine.ready.attention_backend == "cpu"
        outs = [llm.generate([{"prompt_token_ids": p} for p in wave], params, use_tqdm=False)
                for wave in WAVES]
    for wave, wave_outs in zip(WAVES, outs):
        assert_greedy_matches([o.outputs[0].token_ids for o in wave_outs],
                              hf_greedy(path, wave, 8))
    assert min(o.num_cached_tokens for o in outs[1]) >= 16, "the second wave should hit"


@pytest.mark.parametrize("march,width", [("x86-64-v3", 8), ("x86-64", 4)])
def test_portable_simd_builds(march, width):
    """The AVX2 and baseline builds of the same source (8- and 4-lane vectors; this host may
    run the AVX-512 one) against the reference: decode and prefill tiles (direct and
    transposed scores), a head dim that is not a multiple of the vector, 16-bit types."""
    backend = CpuAttentionBackend(cpu_attention.load(march))
    assert cpu_attention.simd_width(march) == width
    cases = [(torch.float32, 64, 16, (8, 2)), (torch.bfloat16, 80, 32, (12, 4)),
             (torch.float16, 96, 16, (16, 1)), (torch.float32, 36, 16, (4, 4))]
    for dtype, head_dim, block_size, heads in cases:
        case = make_case(SPECS["mixed"] + SPECS["long"][:3], num_heads=heads[0],
                         num_kv_heads=heads[1], head_dim=head_dim, block_size=block_size,
                         dtype=dtype, num_padding=1, seed=head_dim)
        out = _run(backend, case)[: case.query.shape[0] - case.num_padding]
        tol = TOL[dtype]
        torch.testing.assert_close(out.double(), reference(case), atol=tol, rtol=tol)


def test_native_build_uses_the_widest_vectors():
    flags = open("/proc/cpuinfo").read() if sys.platform == "linux" else ""
    expected = 16 if " avx512f " in flags else 8 if " avx2 " in flags else 4
    assert cpu_attention.simd_width() == expected


def test_future_keys_of_a_prefill_never_reach_earlier_rows():
    """Within a prefill tile, rows load K/V rows of later tokens for their neighbours: an inf
    in a later token's value must not turn an earlier row into NaN (0 * inf)."""
    case = make_case([(20, 9)], num_heads=8, num_kv_heads=2, seed=3)
    expected = reference(case)[:6]  # (the dense reference itself would compute 0 * inf)
    case.value[6] = float("inf")
    out = _run(CpuAttentionBackend(), case)
    torch.testing.assert_close(out[:6].double(), expected, atol=1e-5, rtol=1e-5)
    assert not out[6:].isfinite().all()
