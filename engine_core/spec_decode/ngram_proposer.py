"""Prompt lookup: draft tokens copied from where a request's latest tokens occurred before."""
from __future__ import annotations

import numpy as np


class NgramProposer:
    """Proposes from a request's own tokens `t[0:L]` (prompt, then output).

    It finds the largest n in [min_n, max_n] for which the suffix `t[L-n:L]` also occurs
    ending at some e < L (`t[e-n:e] == t[L-n:L]`), takes the most recent such e, and
    proposes the tokens that followed it, `t[e:e+k]` (fewer where e + k > L). Without such an
    n it proposes nothing. Deterministic: a replayed scheduler proposes alike.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, tokens: np.ndarray, k: int) -> list[int]:
        """tokens: [L] int32, the request's tokens so far -> at most k draft tokens."""
        length = len(tokens)
        if length <= self.min_n or k < 1:
            return []
        # Candidate ends e (exclusive) of earlier occurrences, narrowed one token further
        # back at a time while some still match: those left match the longest suffix.
        ends = np.flatnonzero(tokens[:length - 1] == tokens[length - 1]) + 1
        n = 1
        while len(ends) and n < self.max_n:
            back = ends - 1 - n
            keep = back >= 0
            keep[keep] = tokens[back[keep]] == tokens[length - 1 - n]
            if not keep.any():
                break
            ends, n = ends[keep], n + 1
        if not len(ends) or n < self.min_n:
            return []
        end = int(ends[-1])
        return tokens[end:end + k].tolist()
