"""One step's token masks: a packed row per constrained request that samples.

Stop tokens follow the grammar: a request's stop tokens (EOS unless ignored, its stop token
ids, the model's other end-of-generation ids) are allowed exactly when its grammar accepts
what was generated so far. `min_tokens` holds them (and EOS) back while the output is shorter
and the grammar allows any other token; once the grammar allows nothing but its end, it is
waived (`Request.min_tokens = 0`) and the request stops there. Every row allows at least one
token, so no logits row is ever all -inf.
"""
from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

from engine_core.request import Request
from engine_core.structured_output.structured_output_request import StructuredOutputRequest
from protocol.int_column import IntColumn
from protocol.scheduler_output import GrammarBitmask


class BitmaskBuilder:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self._executor: Any = None  # llguidance's thread pool for filling rows in parallel

    def build(self, rows: list[tuple[Request, StructuredOutputRequest]],
              handle_bound: int) -> GrammarBitmask:
        """Rows in the step's request order; `handle_bound` exceeds every handle."""
        import llguidance
        import llguidance.numpy as ll_numpy
        if self._executor is None:
            self._executor = llguidance.LLExecutor(min(4, os.cpu_count() or 1))
        mask = np.empty((len(rows), self.num_words), np.int32)
        ll_numpy.fill_next_token_bitmask_par(
            self._executor, [(state.matcher, i) for i, (_, state) in enumerate(rows)], mask)
        words = mask.view(np.uint32)
        for i, (request, state) in enumerate(rows):
            self._fix_row(words[i], request, state.matcher)
        if sys.byteorder != "little":
            mask = mask.byteswap()
        return GrammarBitmask(IntColumn.for_bound((r.req_id for r, _ in rows), handle_bound),
                              mask.tobytes())

    def _fix_row(self, row: np.ndarray, request: Request, matcher: Any) -> None:
        """Stop tokens and min_tokens, as the module docstring says."""
        stops = [t for t in request.stop_tokens if t < self.vocab_size]
        _set_bits(row, stops, matcher.is_accepting())
        if request.num_output_tokens < request.min_tokens:
            if matcher.is_stopped():
                request.min_tokens = 0
            else:
                eos = request.eos_token_id
                _set_bits(row, stops + ([eos] if eos is not None and eos < self.vocab_size
                                        else []), False)
        if not row.any():  # never expected; an empty row would make NaN logits
            if request.eos_token_id is not None and request.eos_token_id < self.vocab_size:
                _set_bits(row, [request.eos_token_id], True)
            else:
                row[:] = 0xFFFFFFFF


def _set_bits(row: np.ndarray, tokens: list[int], value: bool) -> None:
    for token in tokens:
        bit = np.uint32(1 << (token & 31))
        if value:
            row[token >> 5] |= bit
        else:
            row[token >> 5] &= ~bit
