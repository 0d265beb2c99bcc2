"""What the sampler needs for one step's sampled rows, gathered from the persistent batch."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from protocol.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingMetadata:
    """Row i describes the step's i-th sampled request (row i of the logits). Per-request
    inputs of the logits processors are listed only for the rows that need them, in
    increasing row order, so a step of greedy rows without penalties carries none.
    min_tokens is not listed for constrained rows: their masks already hold it."""

    temperature: np.ndarray  # [n] float32; below GREEDY_EPS: greedy
    all_greedy: bool  # every row greedy: no random draw at all
    top_k: np.ndarray  # [n] int64; 0: off
    top_p: np.ndarray  # [n] float32
    min_p: np.ndarray  # [n] float32
    generators: dict[int, torch.Generator]  # row -> its seeded generator (random rows only)
    logprobs: np.ndarray  # [n] int64: top logprobs wanted; -1: none
    penalized: np.ndarray  # [p] rows with repetition/presence/frequency penalties
    penalty_params: list[SamplingParams]  # [p] their params
    prompt_tokens: list[np.ndarray]  # [p] their prompts (views of the batch: read, never keep)
    output_tokens: list[np.ndarray]  # [p] their outputs so far (likewise)
    below_min_tokens: np.ndarray  # [m] rows with fewer outputs than min_tokens
    stop_tokens: list[list[int]]  # [m] their stop tokens (stop ids, EOS unless ignored)
    # Constrained rows and their masks (None: no row is constrained in this step). Bit j of
    # word w of grammar_bitmask[k] allows token 32 * w + j in row grammar_rows[k].
    grammar_rows: np.ndarray | None = None  # [g] int64, increasing
    grammar_bitmask: np.ndarray | None = None  # [g, ceil(vocab / 32)] int32
    # Every row greedy, with no logprobs, penalties, min_tokens or grammar mask: the tokens
    # are the logits' argmax, nothing else to do (False: the sampler looks at each part).
    plain: bool = False
