"""Logits processors: per-request adjustments of the logits before a token is chosen.

The sampler applies them in one place, in order; each skips when no row needs it and never
modifies the tensor it is given (it returns a changed copy), so raw logits stay intact.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from protocol.sampling_params import SamplingParams
from worker.sample.metadata import SamplingMetadata


class LogitsProcessor(Protocol):
    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """logits [n, vocab] float32 -> adjusted logits (`logits` itself when no row needs
        this processor)."""


class PenaltiesLogitsProcessor:
    """Repetition, presence and frequency penalties of the rows that ask for them."""

    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        if not len(metadata.penalized):
            return logits
        logits = logits.clone()
        for i, params, prompt, output in zip(metadata.penalized, metadata.penalty_params,
                                             metadata.prompt_tokens, metadata.output_tokens):
            apply_penalties(logits[i], params, prompt, output)
        return logits


class MinTokensLogitsProcessor:
    """Stop tokens (and EOS) masked to -inf while a row has fewer outputs than min_tokens."""

    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        if not len(metadata.below_min_tokens):
            return logits
        logits = logits.clone()
        vocab = logits.shape[-1]
        for i, stops in zip(metadata.below_min_tokens, metadata.stop_tokens):
            logits[i, [t for t in stops if t < vocab]] = float("-inf")
        return logits


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt: np.ndarray,
                    output: np.ndarray) -> None:
    """vLLM's semantics, on one row [vocab] in place: repetition over prompt and output tokens
    (divide positive logits, multiply negative ones), presence and frequency over output
    tokens only."""
    vocab = logits.shape[-1]
    counts = torch.bincount(torch.from_numpy(output.astype(np.int64)),
                            minlength=vocab)[:vocab].to(logits)
    if params.repetition_penalty != 1.0:
        in_prompt = torch.bincount(torch.from_numpy(prompt.astype(np.int64)),
                                   minlength=vocab)[:vocab] > 0
        seen = in_prompt.to(logits.device) | (counts > 0)
        penalized = torch.where(logits > 0, logits / params.repetition_penalty,
                                logits * params.repetition_penalty)
        logits.copy_(torch.where(seen, penalized, logits))
    logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits)
