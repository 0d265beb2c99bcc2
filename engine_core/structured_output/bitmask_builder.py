"""One step's token masks: a packed row per constrained request that samples, and one more
per draft token it verifies (the mask after its known tokens and each prefix of its drafts).

Stop tokens follow the grammar: a request's stop tokens (EOS unless ignored, its stop token
ids, the model's other end-of-generation ids) are allowed exactly when its grammar accepts
what was generated so far. `min_tokens` holds them (and EOS) back while the output is shorter
and the grammar allows any other token; once the grammar allows nothing but its end, it is
waived (`Request.min_tokens = 0`) and the request stops there. Every row allows at least one
token, so no logits row is ever all -inf.
"""
from __future__ import annotations

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

    def build(self, rows: list[tuple[Request, StructuredOutputRequest, list[int]]],
              handle_bound: int) -> GrammarBitmask:
        """Rows in the step's request order (a request with d drafts: d + 1 rows, the k-th
        after its first k drafts); `handle_bound` exceeds every handle. Each request's own
        row is its `row`, computed ahead (MaskPipeline); draft rows are computed here."""
        starts = np.cumsum([0] + [len(drafts) + 1 for _, _, drafts in rows])
        mask = np.empty((int(starts[-1]), self.num_words), np.int32)
        words = mask.view(np.uint32)
        for (request, state, drafts), start in zip(rows, starts.tolist()):
            if drafts:
                self._fill_drafts(words, mask, start, request, state.matcher, drafts)
            else:
                row = state.row
                words[start] = row.words
                self._fix_row(words[start], request, row.accepting, row.stopped, 0)
        if sys.byteorder != "little":
            mask = mask.byteswap()
        handles = [r.req_id for r, _, drafts in rows for _ in range(len(drafts) + 1)]
        return GrammarBitmask(IntColumn.for_bound(handles, handle_bound), mask.tobytes())

    def _fill_drafts(self, words: np.ndarray, mask: np.ndarray, start: int, request: Request,
                     matcher: Any, drafts: list[int]) -> None:
        """Rows start..start + len(drafts): the mask after each prefix of the drafts; the
        matcher ends as it began. Past a draft the grammar refuses (the core cuts those, so
        only a defence) the rows repeat the last one: nothing after it can be accepted."""
        import llguidance.numpy as ll_numpy
        valid = matcher.validate_tokens(drafts)  # consuming a refused token would break it
        for k in range(valid + 1):
            ll_numpy.fill_next_token_bitmask(matcher, mask, start + k)
            self._fix_row(words[start + k], request, matcher.is_accepting(),
                          matcher.is_stopped(), k)
            if k < valid and not matcher.consume_token(drafts[k]):
                raise RuntimeError("the grammar refused a draft it had validated")
        mask[start + valid + 1:start + len(drafts) + 1] = mask[start + valid]
        matcher.rollback(valid)

    def _fix_row(self, row: np.ndarray, request: Request, accepting: bool, stopped: bool,
                 ahead: int) -> None:
        """Stop tokens and min_tokens, as the module docstring says, for the position `ahead`
        drafts past the request's known tokens (only known tokens waive min_tokens), given
        whether the grammar accepts there and whether it allows nothing but its end."""
        stops = [t for t in request.stop_tokens if t < self.vocab_size]
        _set_bits(row, stops, accepting)
        if request.num_output_tokens + ahead < request.min_tokens:
            if stopped:
                if not ahead:
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
