"""The rejection sampler on its own: greedy verification is exact, and random verification
with a deliberately bad draft still draws from the target's distribution (chi-square)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from worker.sample.metadata import SamplingMetadata
from worker.sample.rejection_sampler import RejectionSampler
from worker.sample.sampler import Sampler
from worker.sample.spec_decode_metadata import SpecDecodeMetadata

VOCAB = 8
DRAWS = 12_000


def _metadata(n: int, temperature: float = 1.0, logprobs: int = -1,
              generators: dict | None = None) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=np.full(n, temperature, np.float32), all_greedy=temperature == 0.0,
        top_k=np.zeros(n, np.int64), top_p=np.ones(n, np.float32),
        min_p=np.zeros(n, np.float32), generators=generators or {},
        logprobs=np.full(n, logprobs, np.int64), penalized=np.zeros(0, np.int64),
        penalty_params=[], prompt_tokens=[], output_tokens=[],
        below_min_tokens=np.zeros(0, np.int64), stop_tokens=[])


def _chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of observed `counts` under `probs` (Pearson's chi-square)."""
    expected = probs * counts.sum()
    stat = float(((counts - expected) ** 2 / expected).sum())
    df = torch.tensor((len(counts) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, torch.tensor(stat / 2, dtype=torch.float64)))


def test_greedy_accepts_while_drafts_match_the_argmax():
    logits = torch.full((7, VOCAB), -5.0)
    for row, token in enumerate([3, 4, 5, 6, 1, 2, 7]):
        logits[row, token] = 5.0
    # Request 0: drafts [3, 4, 0] vs argmax [3, 4, 5, 6]: 2 accepted, then the target's 5.
    # Request 1: no drafts (argmax 1). Request 2: draft [2] accepted, then the bonus 7.
    spec = SpecDecodeMetadata(np.array([3, 0, 1]), np.array([3, 4, 0, 2]))
    tokens, logprobs = RejectionSampler(Sampler(0, torch.device("cpu")))(
        logits, _metadata(7, 0.0, logprobs=1), spec)
    assert tokens == [[3, 4, 5], [1], [2, 7]]
    assert [[entry.token_ids[0] for entry in row] for row in logprobs] == tokens
    assert logprobs[0][2].rank == 1


def _target() -> tuple[torch.Tensor, np.ndarray]:
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(3, VOCAB, generator=generator) * 1.5  # positions 0, 1 and the bonus
    return logits, torch.softmax(logits, dim=-1).numpy().astype(np.float64)


@pytest.mark.parametrize("proposer", ["draft_model", "ngram"])
def test_random_verification_keeps_the_target_distribution(proposer):
    """DRAWS requests verify 2 drafts each against the same target rows. The draft model is
    deliberately bad (its q is far from p); the n-gram drafts are always the same tokens,
    each the target's second most likely.
    Every emitted position must follow the target: the first token always, the second where
    the first draft was accepted, the bonus where both were."""
    logits, p = _target()
    generator = torch.Generator().manual_seed(11)
    q = torch.softmax(torch.randn(2, VOCAB, generator=generator) * 3.0 - 2.0 * logits[:2],
                      dim=-1)
    if proposer == "draft_model":
        drafts = torch.stack([torch.multinomial(q[j], DRAWS, replacement=True,
                                                generator=generator) for j in range(2)], 1)
        draft_probs = [q] * DRAWS
    else:
        second = [int(np.argsort(p[0])[-2]), int(np.argsort(p[1])[-2])]
        drafts, draft_probs = torch.tensor([second] * DRAWS), None
    spec = SpecDecodeMetadata(np.full(DRAWS, 2), drafts.reshape(-1).numpy(), draft_probs)
    sampler = Sampler(1234, torch.device("cpu"))
    tokens, _ = RejectionSampler(sampler)(logits.repeat(DRAWS, 1), _metadata(3 * DRAWS), spec)
    for position in range(3):
        emitted = [t[position] for t in tokens if len(t) > position]
        assert len(emitted) > 200, (position, len(emitted))
        counts = np.bincount(emitted, minlength=VOCAB).astype(np.float64)
        assert _chi_square_p(counts, p[position]) > 1e-3, (position, counts)


def test_seeded_requests_are_reproducible():
    logits, _ = _target()
    spec = SpecDecodeMetadata(np.array([2]), np.array([1, 2]))
    runs = []
    for _ in range(2):
        generators = {0: torch.Generator().manual_seed(7)}
        sampler = RejectionSampler(Sampler(0, torch.device("cpu")))
        runs.append([sampler(logits, _metadata(3, generators=generators), spec)[0]
                     for _ in range(20)])
    assert runs[0] == runs[1]
    assert len({str(r) for r in runs[0]}) > 1  # and they do vary from draw to draw
