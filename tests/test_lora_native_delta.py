"""The Python layer loop's native LoRA delta (worker/lora/native_delta.py) against its torch
ops: several adapters of different ranks, contiguous and interleaved rows, a layer one adapter
leaves alone, output rows wider than one column block and strided, and the torch fallback for
bfloat16; merged layers (block-diagonal b) and steps big enough for a parallel region."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from protocol.lora import LoRARequest
from worker.lora import native_delta
from worker.lora.lora_model import LoRAModel
from worker.lora.mapping import LoRAMapping
from worker.native import cpu_decoder

pytestmark = pytest.mark.skipif(
    cpu_decoder.lora_delta() is None,
    reason="the native decoder library cannot be built here (no C++ compiler)")

K, N = 96, 600  # N spans three of the kernel's 256-column blocks


def _models(dtype: torch.dtype = torch.float32) -> dict[int, LoRAModel]:
    g = torch.Generator().manual_seed(0)
    models = {}
    for i, rank in ((1, 4), (2, 16), (3, 7)):
        layers = [(torch.randn(K, rank, generator=g).to(dtype),
                   torch.randn(rank, N, generator=g).to(dtype)),
                  None if i == 2 else (torch.randn(N, rank, generator=g).to(dtype),
                                       torch.randn(rank, K, generator=g).to(dtype))]
        models[i] = LoRAModel(LoRARequest(f"a{i}", i, "/x"), layers, 0, 0.0)
    return models


def _mappings(ids, counts, models, monkeypatch) -> tuple[LoRAMapping, LoRAMapping]:
    """The same step twice: with the native kernel, and forced onto the torch ops."""
    build = lambda: LoRAMapping.build(np.array(ids), np.array(counts), models,  # noqa: E731
                                      torch.device("cpu"))
    native, torch_ops = build(), build()
    native.kernel = native_delta.NativeDelta(native.segments, native.index)  # else on first use
    with monkeypatch.context() as m:
        m.setattr(native_delta, "ENABLED", False)
        torch_ops.kernel = native_delta.NativeDelta(torch_ops.segments, torch_ops.index)
    return native, torch_ops


@pytest.mark.parametrize("ids, counts", [
    ([2], [5]),                                   # one adapter, contiguous
    ([1, 1, 3, 0, 2, 2], [1, 1, 4, 2, 1, 1]),     # each adapter's rows together
    ([1, 2, 0, 3, 1, 2, 3, 0], [1, 1, 1, 9, 1, 1, 1, 1]),  # interleaved, with a prefill
])
def test_native_delta_equals_the_torch_ops(ids, counts, monkeypatch):
    models = _models()
    native, torch_ops = _mappings(ids, counts, models, monkeypatch)
    assert native.kernel.step is not None and torch_ops.kernel.step is None
    rows = sum(counts)
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(rows, N + 40, generator=g)  # y a column slice: row stride N + 40
    for target, (k, n) in enumerate(((K, N), (N, K))):
        x = torch.randn(rows, k, generator=g)
        y = wide[:, 8:8 + n] if target == 0 else torch.randn(rows, n, generator=g)
        expected = y.clone()
        torch_ops.add_delta(expected, x, target)
        before, original = wide.clone(), y.clone()
        native.add_delta(y, x, target)
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-4)
        changed = any(models[i].layers[target] is not None for i in ids if i)
        assert ((y - original).abs().max() > 1) == changed  # adapter 2 leaves target 1
        if target == 0:  # the columns beside the slice are untouched
            assert torch.equal(wide[:, :8], before[:, :8])
            assert torch.equal(wide[:, 8 + n:], before[:, 8 + n:])


def test_other_dtypes_take_the_torch_ops(monkeypatch):
    models = _models(torch.bfloat16)
    native, torch_ops = _mappings([1, 2, 3], [2, 1, 2], models, monkeypatch)
    assert native.kernel.step is None  # bfloat16 factors: no table
    x = torch.randn(5, K).bfloat16()
    y, expected = torch.zeros(5, N).bfloat16(), torch.zeros(5, N).bfloat16()
    native.add_delta(y, x, 0)
    torch_ops.add_delta(expected, x, 0)
    assert torch.equal(y, expected) and y.abs().max() > 0
    # float32 factors but a bfloat16 step: the kernel declines, torch adds the delta
    native, _ = _mappings([1, 2, 3], [2, 1, 2], _models(), monkeypatch)
    assert native.kernel.step is not None
    assert not native.kernel.apply(torch.zeros(5, N).bfloat16(), x, 0)


def _merged_models(k: int, n: int) -> dict[int, LoRAModel]:
    """Adapters of one merged layer of three parts (q/k/v-like): b block-diagonal, each part's
    rank rows nonzero only in its columns, one rank row all zero."""
    g = torch.Generator().manual_seed(2)
    models = {}
    for i in (1, 2, 3):
        b = torch.zeros(16, n)
        for rows, columns in ((slice(0, 6), slice(0, n // 2)),
                              (slice(6, 11), slice(n // 2, 3 * n // 4)),
                              (slice(11, 15), slice(3 * n // 4, n))):
            b[rows, columns] = torch.randn(b[rows, columns].shape, generator=g)
        layers = [(torch.randn(k, 16, generator=g), b)]
        models[i] = LoRAModel(LoRARequest(f"a{i}", i, "/x"), layers, 0, 0.0)
    return models


@pytest.mark.parametrize("rows_each", [1, 40])  # on the calling thread; a region of its own
def test_merged_parts_and_big_steps(rows_each, monkeypatch):
    """Block-diagonal b (the expand skips the zero blocks) and a step big enough for a
    parallel region of its own (over 2**20 multiply-adds) on two threads."""
    k, n = 512, 768
    models = _merged_models(k, n)
    spans = native_delta._spans(models[1].layers[0][1])
    assert spans[0].tolist() == [0, n // 2] and spans[6].tolist() == [n // 2, 3 * n // 4]
    assert spans[15].tolist() == [0, 0]
    ids = [1, 2, 3] * rows_each
    native, torch_ops = _mappings(ids, [1] * len(ids), models, monkeypatch)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(len(ids), k, generator=g), torch.randn(len(ids), n, generator=g)
    expected = y.clone()
    torch_ops.add_delta(expected, x, 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        native.add_delta(y, x, 0)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-4)
