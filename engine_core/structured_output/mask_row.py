"""One matcher's next-token mask, computed apart from any step, and the probe that follows a
grammar a few tokens to find what only shows once it runs."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine_core.structured_output.grammar_limits import PROBE_TOKENS, empty_language, explain


@dataclass(slots=True)
class MaskRow:
    """The tokens the matcher allows next, as llguidance writes them: bit `t & 31` of word
    `t >> 5` (uint32, [ceil(vocab / 32)]), before the stop-token rules a step applies
    (BitmaskBuilder). `error` is the matcher's error if computing it failed ("" otherwise);
    `seconds` what it took."""

    words: np.ndarray
    accepting: bool
    stopped: bool
    error: str
    seconds: float


def fill_row(matcher: Any, num_words: int) -> MaskRow:
    """The matcher's next mask (llguidance releases the GIL while it computes it). Run on
    one thread at a time per matcher: llguidance refuses concurrent use of one."""
    words = np.empty(num_words, np.uint32)
    started = time.perf_counter()
    matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
    seconds = time.perf_counter() - started
    error = matcher.get_error() if matcher.is_error() else ""
    return MaskRow(words, matcher.is_accepting(), matcher.is_stopped(), error, seconds)


def first_row_problem(row: MaskRow) -> str:
    """Why a grammar's first mask makes it unusable (the end of a sentence naming its field),
    "" if it does not: the grammar engine failed, or nothing at all can be written."""
    if row.error:
        return explain(row.error, at_start=True)
    if row.stopped and not row.accepting:
        return empty_language()
    return ""


def probe(matcher: Any, num_words: int, stop_tokens: set[int],
          steps: int = PROBE_TOKENS) -> str:
    """Follow a copy of `matcher` along `steps` tokens (each time the lowest allowed id that
    is not a stop token) and say what goes wrong ("" if nothing does): an empty language, or
    a limit the grammar exceeds on its first tokens (a rule with more alternatives than a row
    may hold shows on the first token that enters it)."""
    matcher = matcher.deep_copy()
    row = fill_row(matcher, num_words)
    problem = first_row_problem(row)
    for _ in range(steps):
        if problem or row.stopped:
            return problem
        token = _lowest_allowed(row.words, stop_tokens)
        if token is None:
            return ""
        if not matcher.consume_token(token):
            return explain(matcher.get_error(), at_start=False)
        row = fill_row(matcher, num_words)
        problem = explain(row.error, at_start=False) if row.error else ""
    return problem


def _lowest_allowed(words: np.ndarray, stop_tokens: set[int]) -> int | None:
    for index in np.flatnonzero(words).tolist():
        word = int(words[index])
        while word:
            bit = (word & -word).bit_length() - 1
            token = index * 32 + bit
            if token not in stop_tokens:
                return token
            word &= word - 1
    return None
