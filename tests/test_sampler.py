"""Sampler: seeds reproduce, filters never leak, penalties and logprobs match direct math."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from protocol import NewRequestData, SamplingParams
from worker.input_batch import InputBatch
from worker.sample.logits_processors import apply_penalties
from worker.sample.metadata import SamplingMetadata
from worker.sample.sampler import Sampler, apply_top_k_top_p_min_p

VOCAB = 50
CPU = torch.device("cpu")


def _metadata(params: list[SamplingParams], outputs: list[list[int]] | None = None,
              eos: int | None = None, prompt: tuple[int, ...] = (1, 2, 3)) -> SamplingMetadata:
    """The sampling metadata of an InputBatch with one row per params, each holding `prompt`
    then its outputs."""
    batch = InputBatch(max_model_len=64, block_size=16, device=CPU)
    for i, p in enumerate(params):
        batch.add_request(NewRequestData(i, f"r{i}", list(prompt), p, [1], 0, eos))
        for token in (outputs[i] if outputs else []):
            batch.append_tokens(np.array([i]), [token])
    return batch.sampling_metadata(np.arange(len(params)))


def _logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_is_argmax():
    logits = _logits(4)
    metadata = _metadata([SamplingParams(temperature=0.0, seed=5)] * 4)
    tokens, logprobs = Sampler(0, CPU).sample(logits, metadata)
    assert tokens == logits.argmax(-1).tolist() and logprobs is None


@pytest.mark.parametrize("other,plain", [
    (SamplingParams(temperature=0.0), True),
    (SamplingParams(temperature=0.7), False),
    (SamplingParams(temperature=0.0, logprobs=0), False),
    (SamplingParams(temperature=0.0, repetition_penalty=1.3), False),
    (SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7]), False),
])
def test_plain_steps_take_the_argmax_and_others_every_part(other, plain):
    """A step of greedy rows with nothing else is marked plain (the sampler then only takes
    the argmax); one row with a draw, logprobs, penalties or min_tokens makes it not."""
    metadata = _metadata([SamplingParams(temperature=0.0)] * 3 + [other], eos=7)
    assert metadata.plain == plain
    logits = _logits(4, seed=3)
    logits[0, [7, 40]] = 50.0  # a tie: the first index
    tokens, _ = Sampler(0, CPU).sample(logits, metadata)
    assert tokens[:3] == logits[:3].argmax(-1).tolist() and tokens[0] == 7


def test_seeded_requests_reproduce_across_runs_and_batches():
    logits = _logits(1)
    seeded = SamplingParams(temperature=1.0, seed=1234)

    def draw(global_seed: int, batch_size: int) -> list[int]:
        sampler = Sampler(global_seed, CPU)
        metadata = _metadata([seeded] + [SamplingParams()] * (batch_size - 1))
        return [sampler.sample(logits.repeat(batch_size, 1), metadata)[0][0]
                for _ in range(20)]

    first = draw(0, 1)
    assert first == draw(99, 3) == draw(7, 5)  # independent of the engine seed and the batch
    assert len(set(first)) >= 2  # really random, not argmax
    sampler = Sampler(0, CPU)
    metadata = _metadata([SamplingParams(temperature=1.0, seed=4321)])
    assert [sampler.sample(logits, metadata)[0][0] for _ in range(20)] != first


def test_unseeded_sampling_is_reproducible_for_the_same_engine_seed():
    logits = _logits(8)
    metadata = _metadata([SamplingParams(temperature=0.8)] * 8)
    assert Sampler(3, CPU).sample(logits, metadata)[0] == \
        Sampler(3, CPU).sample(logits, metadata)[0]


@pytest.mark.parametrize("params", [
    SamplingParams(top_k=5), SamplingParams(top_p=0.3), SamplingParams(top_k=10, top_p=0.5),
    SamplingParams(min_p=0.2), SamplingParams(top_k=1, temperature=5.0),
    SamplingParams(top_p=0.9, temperature=0.5)])
def test_filters_never_sample_outside_their_set(params):
    logits = _logits(1, seed=11)[0]
    allowed = set(_allowed(logits / params.temperature, params))
    metadata = _metadata([params] * 2000)
    tokens = Sampler(0, CPU).sample(logits.repeat(2000, 1), metadata)[0]
    assert set(tokens) <= allowed
    assert len(set(tokens)) > 1 or len(allowed) == 1  # sampling, not argmax


def _allowed(logits: torch.Tensor, p: SamplingParams) -> list[int]:
    """The candidate set, computed the slow obvious way."""
    order = logits.argsort(descending=True).tolist()
    if p.top_k > 0:
        order = order[:p.top_k]
    probs = torch.softmax(logits[order], -1).tolist()
    kept, mass = [], 0.0
    for token, prob in zip(order, probs):
        if mass >= p.top_p:
            break
        kept.append(token)
        mass += prob
    if p.min_p > 0:
        masked = torch.full_like(logits, float("-inf"))
        masked[kept] = logits[kept]
        probs = torch.softmax(masked, -1)
        kept = [t for t in kept if probs[t] >= p.min_p * probs.max()]
    return kept


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0] + [-30.0] * (VOCAB - 4)])
    n = 6000
    metadata = _metadata([SamplingParams(temperature=1.0)] * n)
    tokens = Sampler(0, CPU).sample(logits.repeat(n, 1), metadata)[0]
    freq = np.bincount(tokens, minlength=4)[:4] / n
    expected = torch.softmax(logits[0, :4], -1).numpy()
    assert np.abs(freq - expected).max() < 0.03


def test_penalties_match_direct_computation():
    logits = _logits(1, seed=2)[0]
    params = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5,
                            frequency_penalty=0.25)
    prompt, output = [1, 2, 3, 3], [3, 7, 7, 7, 9]
    got = logits.clone()
    apply_penalties(got, params, np.array(prompt), np.array(output))
    want = logits.clone()
    for t in set(prompt) | set(output):
        want[t] = want[t] / 1.3 if want[t] > 0 else want[t] * 1.3
    for t in set(output):
        want[t] -= 0.5 + 0.25 * output.count(t)
    torch.testing.assert_close(got, want)
    metadata = _metadata([SamplingParams(temperature=0.0, repetition_penalty=1.3,
                                         presence_penalty=0.5, frequency_penalty=0.25)],
                         outputs=[output], prompt=tuple(prompt))
    assert Sampler(0, CPU).sample(logits[None], metadata)[0] == [int(want.argmax())]


def test_min_tokens_suppresses_stop_tokens():
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 10.0  # EOS would win
    logits[0, 8] = 9.0  # a stop token would be next
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[8])
    sampler = Sampler(0, CPU)
    assert sampler.sample(logits, _metadata([params], [[5]], eos=7))[0] == [0]
    assert sampler.sample(logits, _metadata([params], [[5, 5, 5]], eos=7))[0] == [7]
    ignore = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)
    assert sampler.sample(logits, _metadata([ignore], [[5]], eos=7))[0] == [7]


def test_logprobs_of_the_raw_distribution():
    logits = _logits(2, seed=9)
    metadata = _metadata([SamplingParams(temperature=0.0, logprobs=3), SamplingParams()])
    tokens, logprobs = Sampler(0, CPU).sample(logits, metadata)
    raw = torch.log_softmax(logits[0], -1)
    entry = logprobs[0]
    assert entry.token_ids[0] == tokens[0] and entry.rank == 1
    assert entry.token_ids[1:] == raw.topk(3).indices.tolist()
    np.testing.assert_allclose(entry.logprobs, [raw[t].item() for t in entry.token_ids],
                               rtol=1e-6)
    assert logprobs[1] is None


def test_filter_function_keeps_the_best_token():
    logits = _logits(3, seed=4)
    out = apply_top_k_top_p_min_p(logits, np.array([1, 0, 3]), np.array([1.0, 0.01, 1.0]),
                                  np.array([0.0, 0.0, 0.9]))
    assert (out.argmax(-1) == logits.argmax(-1)).all()
    assert torch.isfinite(out).sum(-1).tolist()[:2] == [1, 1]
