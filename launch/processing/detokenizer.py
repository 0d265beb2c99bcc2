"""Incremental detokenization and stop strings, in the front-end."""
from __future__ import annotations

# Prompt tokens kept as context, so the first output tokens decode with the right spacing.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, emitting only complete characters.

    Decodes the window `ids[prefix_offset:]` and compares it with the text already emitted for
    `ids[prefix_offset:read_offset]`: the difference is new text, unless it ends in an
    incomplete UTF-8 sequence (U+FFFD), in which case more tokens are awaited.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; returns the text they completed (possibly empty)."""
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end: whatever is still held back, incomplete characters included."""
        if self.read_offset == len(self.ids):
            return ""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        delta = self._decode(self.ids[self.prefix_offset:])[len(prefix):]
        self.read_offset = len(self.ids)
        self.text += delta
        return delta


def find_stop_string(text: str, new_chars: int, stops: list[str],
                     include_stop: bool) -> tuple[str, int] | None:
    """The first stop string completed by the last `new_chars` characters, and the length the
    text is cut to (keeping or dropping the stop string)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, len(text) - new_chars - len(stop) + 1)
        i = text.find(stop, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    if best is None:
        return None
    i, stop = best
    return stop, i + len(stop) if include_stop else i


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `marker`: what a
    stream must hold back because the next piece may complete the marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
