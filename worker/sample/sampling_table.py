"""Per-row sampling settings of the persistent batch, as numpy columns.

A step's sampling metadata is then a gather by row, and a step where every request is greedy
with no penalties, min_tokens, seeds or logprobs needs no per-request Python at all.
"""
from __future__ import annotations

import numpy as np
import torch

from protocol.sampling_params import SamplingParams


class SamplingTable:
    def __init__(self, rows: int) -> None:
        self.temperature = np.ones(rows, np.float32)
        self.top_p = np.ones(rows, np.float32)
        self.top_k = np.zeros(rows, np.int64)  # 0: off
        self.min_p = np.zeros(rows, np.float32)
        self.min_tokens = np.zeros(rows, np.int64)
        self.logprobs = np.full(rows, -1, np.int64)  # -1: not asked
        self.penalties = np.zeros(rows, bool)
        self.params: list[SamplingParams | None] = [None] * rows
        self.eos: list[int | None] = [None] * rows
        # Per-request seeds: the same draws on every run and every tensor-parallel rank.
        self.generators: list[torch.Generator | None] = [None] * rows

    def set_row(self, row: int, params: SamplingParams, eos_token_id: int | None,
                device: torch.device) -> None:
        self.temperature[row] = params.temperature
        self.top_p[row] = params.top_p
        self.top_k[row] = max(params.top_k, 0)
        self.min_p[row] = params.min_p
        self.min_tokens[row] = params.min_tokens
        self.logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self.penalties[row] = params.needs_penalties
        self.params[row], self.eos[row] = params, eos_token_id
        self.generators[row] = None
        if params.seed is not None and not params.greedy:
            self.generators[row] = torch.Generator(device).manual_seed(params.seed)

    def clear_row(self, row: int) -> None:
        self.params[row] = self.generators[row] = None

    def grow(self, rows: int) -> None:
        old = len(self.params)
        for name, fill in (("temperature", 1.0), ("top_p", 1.0), ("top_k", 0), ("min_p", 0.0),
                           ("min_tokens", 0), ("logprobs", -1), ("penalties", False)):
            column = getattr(self, name)
            grown = np.full(rows, fill, column.dtype)
            grown[:old] = column
            setattr(self, name, grown)
        for name in ("params", "eos", "generators"):
            getattr(self, name).extend([None] * (rows - old))

    def stop_tokens(self, row: int) -> list[int]:
        """Tokens suppressed while a row is below min_tokens: its stop ids and EOS."""
        params = self.params[row]
        stops = list(params.stop_token_ids or ())
        if self.eos[row] is not None and not params.ignore_eos:
            stops.append(self.eos[row])
        return stops
