"""Structured outputs on the worker: the step's grammar masks applied to the logits.

The engine core computes the masks; a worker only applies them, so it needs no grammar
library, and every tensor-parallel rank applies the same bits to the same logits.
"""
from __future__ import annotations

import numpy as np
import torch

from worker.sample.metadata import SamplingMetadata

_NEG_INF = np.float32(-np.inf)


class GrammarBitmaskLogitsProcessor:
    """Disallowed tokens of constrained rows to -inf (float32); other rows untouched."""

    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        if metadata.grammar_rows is None:
            return logits
        rows, vocab = metadata.grammar_rows, logits.shape[-1]
        if logits.device.type == "cpu":
            disallowed = torch.from_numpy(unpack_disallowed(metadata.grammar_bitmask, vocab))
        else:
            disallowed = _unpack_on_device(metadata.grammar_bitmask, vocab, logits.device)
        if len(rows) == logits.shape[0]:  # every sampled row is constrained (rows: 0..n-1)
            return _masked(logits, disallowed)
        out = logits.clone()
        index = torch.from_numpy(rows).to(logits.device)
        out[index] = _masked(logits[index], disallowed)
        return out


def unpack_disallowed(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    """[g, words] int32 (bit j of word w: token 32w+j allowed) -> [g, vocab] bool,
    True where the token is not allowed."""
    inverted = np.ascontiguousarray(~bitmask.astype("<i4", copy=False))
    return np.unpackbits(inverted.view(np.uint8), axis=1, count=vocab,
                         bitorder="little").view(np.bool_)


def _masked(logits: torch.Tensor, disallowed: torch.Tensor) -> torch.Tensor:
    if logits.device.type == "cpu":  # numpy's where is ~4x faster than masked_fill here
        return torch.from_numpy(np.where(disallowed.numpy(), _NEG_INF, logits.numpy()))
    return logits.masked_fill(disallowed, float("-inf"))


def _unpack_on_device(bitmask: np.ndarray, vocab: int, device: torch.device) -> torch.Tensor:
    words = torch.from_numpy(np.ascontiguousarray(bitmask)).to(device)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    bits = (words.unsqueeze(-1) >> shifts) & 1
    return (bits.reshape(words.shape[0], -1)[:, :vocab] == 0)
