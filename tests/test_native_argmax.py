"""The sampler's native greedy argmax (worker/kernels/argmax.h through cpu_ops.cpp) against
torch.argmax(dim=-1), index for index: ties to the first index, NaN counting as the maximum,
rows of -inf, odd vocabulary sizes (block and vector tails), one row and many (the parallel
path), strided rows; and the sampler's fallback to torch where the library is absent."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from cpu_ops_utils import enabled_fixture, ops_fixture  # noqa: F401  (fixtures)

from worker.native import cpu_ops
from worker.sample import sampler as sampler_module
from worker.sample.metadata import SamplingMetadata
from worker.sample.sampler import Sampler, argmax

BLOCK = 1024  # argmax.h's ARGMAX_BLOCK: sizes around it reach the block boundaries


def _check(ops: cpu_ops.CpuOps, x: torch.Tensor) -> None:
    assert ops.argmax_supported(x)
    got = ops.argmax(x)
    assert got.dtype == torch.int64 and got.shape == (x.shape[0],)
    assert got.tolist() == x.argmax(dim=-1).tolist()


@pytest.mark.parametrize("rows", [1, 2, 7, 32, 65])
@pytest.mark.parametrize("cols", [1, 2, 15, 17, 31, 1000, BLOCK - 1, BLOCK, BLOCK + 1,
                                  3 * BLOCK + 5, 32000, 32003])
def test_random_rows_match_torch(ops, rows, cols):
    generator = torch.Generator().manual_seed(rows * 100003 + cols)
    _check(ops, torch.randn(rows, cols, generator=generator))


@pytest.mark.parametrize("cols", [5, BLOCK + 3, 4 * BLOCK + 7, 32000])
def test_ties_go_to_the_first_index(ops, cols):
    x = torch.randn(6, cols, generator=torch.Generator().manual_seed(cols)).clamp(max=1.0)
    x[0, :] = 0.5  # every element the maximum
    x[1, [cols - 1, cols // 2, 0]] = 3.0  # first, middle and last: the first wins
    x[2, [cols - 1, cols // 2]] = 3.0
    x[3, cols - 1] = 3.0  # the very last element, alone
    x[4, [cols // 3, cols - 1]] = float("inf")
    x[5, :] = -1.0
    x[5, [cols // 2, cols - 1]] = 0.0
    x[5, cols // 2] = -0.0  # -0.0 == +0.0: the earlier of the two
    _check(ops, x)


@pytest.mark.parametrize("cols", [3, BLOCK + 9, 32000])
def test_nan_counts_as_the_maximum(ops, cols):
    nan = float("nan")
    x = torch.randn(6, cols, generator=torch.Generator().manual_seed(cols))
    x[0, cols - 1] = nan  # after the maximum
    x[1, 0] = nan
    x[2, [cols // 2, cols - 1]] = nan  # the first NaN
    x[2, 1] = float("inf")
    x[3, :] = nan
    x[4, cols // 2] = nan  # NaN in a later block than a +inf
    x[4, 0] = float("inf")
    x[5, [cols - 1]] = nan
    x[5, :cols - 1] = float("-inf")
    _check(ops, x)


@pytest.mark.parametrize("cols", [1, 17, BLOCK + 1, 32000])
def test_rows_of_minus_inf(ops, cols):
    x = torch.full((4, cols), float("-inf"))
    x[1, cols - 1] = -1e30  # the one finite element
    x[2, cols // 2] = float("-inf")
    x[3, 0] = torch.finfo(torch.float32).min
    _check(ops, x)


def test_strided_rows_and_one_column(ops):
    wide = torch.randn(32, 32000 + 40, generator=torch.Generator().manual_seed(1))
    _check(ops, wide[:, 13:13 + 32000])  # rows of a wider buffer
    _check(ops, wide[::3, 7:9000])
    _check(ops, wide[:, 5:6])  # one column: always index 0


def test_parallel_and_serial_agree(ops, monkeypatch):
    x = torch.randn(64, 4099, generator=torch.Generator().manual_seed(2))
    x[::5, 100] = float("nan")
    x[1::7, [9, 4000]] = 50.0
    expected = x.argmax(dim=-1).tolist()
    for threads in (1, 2, 3):
        monkeypatch.setattr(torch, "get_num_threads", lambda t=threads: t)
        assert ops.argmax(x).tolist() == expected


def test_zero_rows_and_unsupported_inputs(ops):
    assert ops.argmax(torch.zeros(0, 10)).shape == (0,)
    assert not ops.argmax_supported(torch.zeros(4, 10, dtype=torch.bfloat16))
    assert not ops.argmax_supported(torch.zeros(10))
    assert not ops.argmax_supported(torch.zeros(4, 0))
    assert not ops.argmax_supported(torch.zeros(10, 4).t())  # columns not contiguous
    x = torch.randn(10, 4).t()
    assert argmax(x).tolist() == x.argmax(dim=-1).tolist()  # the sampler's torch route


def test_sampler_argmax_falls_back_to_torch_without_the_library(monkeypatch):
    monkeypatch.setattr(sampler_module, "native_ops", lambda: None)
    x = torch.randn(3, 100)
    x[1, [4, 60]] = 9.0
    assert argmax(x).tolist() == x.argmax(dim=-1).tolist()


@pytest.mark.parametrize("native", [True, False])
def test_greedy_sampling_takes_the_first_maximum(monkeypatch, native):
    if not native:
        monkeypatch.setattr(sampler_module, "native_ops", lambda: None)
    logits = torch.randn(4, 32000, generator=torch.Generator().manual_seed(3))
    logits[0, [7, 31999]] = 100.0
    logits[2, 5] = float("nan")
    n = logits.shape[0]
    metadata = SamplingMetadata(
        temperature=np.zeros(n, np.float32), all_greedy=True, top_k=np.zeros(n, np.int64),
        top_p=np.ones(n, np.float32), min_p=np.zeros(n, np.float32), generators={},
        logprobs=np.full(n, -1, np.int64), penalized=np.zeros(0, np.int64), penalty_params=[],
        prompt_tokens=[], output_tokens=[], below_min_tokens=np.zeros(0, np.int64),
        stop_tokens=[])
    tokens, logprobs = Sampler(0, torch.device("cpu")).sample(logits, metadata)
    assert tokens == logits.argmax(dim=-1).tolist() and tokens[0] == 7 and tokens[2] == 5
    assert logprobs is None
