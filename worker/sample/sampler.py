"""Turns logits into tokens: logits processors (penalties, min_tokens, grammar masks), greedy or
temperature/top-k/top-p/min-p sampling with per-request seeds, and top-n logprobs.

Every rank of a tensor-parallel group sees identical logits and identical generator states and
runs this same code, so all ranks sample the same tokens without communicating.
"""
from __future__ import annotations

import numpy as np
import torch

from protocol.model_runner_output import SampleLogprobs
from protocol.sampling_params import GREEDY_EPS
from worker.native.cpu_ops import native_ops
from worker.sample.grammar_bitmask import GrammarBitmaskLogitsProcessor
from worker.sample.logits_processors import (
    LogitsProcessor,
    MinTokensLogitsProcessor,
    PenaltiesLogitsProcessor,
)
from worker.sample.metadata import SamplingMetadata


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        # Draws for requests without their own seed; every rank advances it identically.
        self.generator = torch.Generator(device).manual_seed(seed)
        # Applied in this order to the logits of every step (logprobs see the raw ones); the
        # grammar masks come after penalties and before temperature, top-k and top-p, so a
        # greedy constrained row whose unconstrained argmax is allowed picks it.
        self.processors: tuple[LogitsProcessor, ...] = (PenaltiesLogitsProcessor(),
                                                        MinTokensLogitsProcessor(),
                                                        GrammarBitmaskLogitsProcessor())

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata,
               ) -> tuple[list[int], list[SampleLogprobs | None] | None]:
        """logits: [n, vocab] float32, row i for the metadata's row i -> one token per row,
        plus logprobs when any row asked for them."""
        if metadata.plain:  # greedy rows and nothing else (the usual decode step)
            return argmax(logits).tolist(), None
        want_logprobs = metadata.logprobs
        raw = torch.log_softmax(logits, dim=-1) if (want_logprobs >= 0).any() else None
        for processor in self.processors:
            logits = processor.apply(logits, metadata)
        tokens = argmax(logits)
        if not metadata.all_greedy:
            random = np.flatnonzero(metadata.temperature >= GREEDY_EPS)
            tokens[random] = self._sample_random(logits[random], metadata, random)
        token_list = tokens.tolist()
        if raw is None:
            return token_list, None
        return token_list, [sample_logprobs(raw[i], token_list[i], int(n)) if n >= 0 else None
                            for i, n in enumerate(want_logprobs)]

    def _sample_random(self, logits: torch.Tensor, metadata: SamplingMetadata,
                       rows: np.ndarray) -> torch.Tensor:
        """logits: [len(rows), vocab] of the metadata's (non-greedy) `rows`."""
        probs = probabilities(logits, metadata, rows)
        # Exponential race: argmax(p / q) with q ~ Exp(1) is a draw from p. Seeded requests
        # draw from their own generator, so their tokens do not depend on the batch.
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, row in enumerate(rows.tolist()):
            generator = metadata.generators.get(row)
            if generator is not None:
                noise[i].exponential_(generator=generator)
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        return argmax(probs / noise)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1) of rows [n, vocab] -> [n] int64: on the CPU the native kernel
    where the library is built (the same indices: a row's first maximum, NaN counting as the
    maximum), else torch's (~1 ms for 32 rows of a 32k vocabulary, the kernel ~0.1 ms)."""
    ops = native_ops() if logits.is_cpu else None
    if ops is not None and ops.argmax_supported(logits):
        return ops.argmax(logits)
    return logits.argmax(dim=-1)


def probabilities(logits: torch.Tensor, metadata: SamplingMetadata,
                  rows: np.ndarray) -> torch.Tensor:
    """The distribution random sampling draws from: logits [len(rows), vocab] (processed) of
    the metadata's (non-greedy) `rows`, at their temperature, within top-k, top-p and min-p."""
    temperature = torch.from_numpy(metadata.temperature[rows]).to(logits.device)
    logits = logits / temperature[:, None]
    logits = apply_top_k_top_p_min_p(logits, metadata.top_k[rows], metadata.top_p[rows],
                                     metadata.min_p[rows])
    return torch.softmax(logits, dim=-1)


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: np.ndarray, top_p: np.ndarray,
                            min_p: np.ndarray) -> torch.Tensor:
    """Mask (to -inf) every token outside each row's top-k (0: off), then outside its top-p
    nucleus, then below min_p times its most likely token's probability. Rows: [n, vocab]."""
    vocab = logits.shape[-1]
    k = torch.from_numpy(np.where((top_k > 0) & (top_k < vocab), top_k, vocab)).to(logits.device)
    p = torch.from_numpy(np.asarray(top_p, np.float32)).to(logits)
    if bool((k < vocab).any()) or bool((p < 1.0).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        drop = torch.arange(vocab, device=logits.device)[None, :] >= k[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches p (the first token always stays).
        drop |= (probs.cumsum(dim=-1) - probs) >= p[:, None]
        logits = torch.full_like(logits, float("-inf")).scatter(
            -1, order, sorted_logits.masked_fill(drop, float("-inf")))
    if (np.asarray(min_p) > 0).any():
        probs = torch.softmax(logits, dim=-1)
        floor = torch.from_numpy(np.asarray(min_p, np.float32)).to(logits)[:, None]
        logits = logits.masked_fill(probs < floor * probs.max(-1, keepdim=True).values,
                                    float("-inf"))
    return logits


def sample_logprobs(logprobs: torch.Tensor, token: int, n: int) -> SampleLogprobs:
    """The entry of one sampled `token`: logprobs [vocab] are the raw log-softmax."""
    top = torch.topk(logprobs, min(n, logprobs.shape[-1])) if n > 0 else None
    chosen = float(logprobs[token])
    rank = int((logprobs > chosen).sum()) + 1
    ids = [token] + (top.indices.tolist() if top is not None else [])
    values = [chosen] + (top.values.tolist() if top is not None else [])
    return SampleLogprobs(ids, values, rank)
