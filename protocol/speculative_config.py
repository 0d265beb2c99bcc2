"""Speculative decoding options: vLLM's `speculative_config`, with its field names."""
from __future__ import annotations

from typing import Any

import msgspec

from protocol.json_option import parse_json_option

METHODS = ("ngram", "draft_model")
# The most draft tokens one request verifies in one step (vLLM's MAX_SPEC_LEN).
MAX_SPEC_LEN = 32
_NGRAM_DEFAULT = 5  # vLLM's prompt_lookup_min and _max when neither is given


class SpeculativeConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """`method="ngram"`: prompt lookup in the engine core. The proposals are the tokens that
    followed the most recent earlier occurrence of the request's last n tokens (n from
    `prompt_lookup_max` down to `prompt_lookup_min`; neither given: 5 and 5, one given: both
    it) in its own prompt and output.
    `method="draft_model"`: `model`, a smaller Hugging Face directory with the target's
    vocabulary, runs in the worker processes at the target's tensor-parallel size.
    Either proposes at most `num_speculative_tokens` tokens per request and step."""

    method: str  # one of METHODS (checked here, for a clearer error than a Literal's)
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of "
                             f"{', '.join(METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPEC_LEN:
            raise ValueError(f"speculative_config: num_speculative_tokens must be in "
                             f"[1, {MAX_SPEC_LEN}], got {k!r}")
        lookup = (self.prompt_lookup_min, self.prompt_lookup_max)
        if self.method == "draft_model":
            if not self.model:
                raise ValueError("speculative_config: method 'draft_model' needs `model`, "
                                 "the draft model's directory")
            if lookup != (None, None):
                raise ValueError("speculative_config: prompt_lookup_min/max belong to "
                                 "method 'ngram'")
            return
        if self.model is not None:
            raise ValueError("speculative_config: `model` belongs to method 'draft_model'")
        if any(n is not None and (not isinstance(n, int) or n < 1) for n in lookup):
            raise ValueError(f"speculative_config: prompt_lookup_min/max must be at least 1, "
                             f"got {lookup}")
        if self.lookup_min > self.lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({self.lookup_min}) is "
                             f"above prompt_lookup_max ({self.lookup_max})")

    @property
    def lookup_min(self) -> int:
        return self.prompt_lookup_min or self.prompt_lookup_max or _NGRAM_DEFAULT

    @property
    def lookup_max(self) -> int:
        return self.prompt_lookup_max or self.prompt_lookup_min or _NGRAM_DEFAULT

    @staticmethod
    def parse(value: Any) -> SpeculativeConfig:
        """From a JSON object (a str), a dict or a SpeculativeConfig; ValueError if invalid."""
        return parse_json_option(value, SpeculativeConfig, "speculative_config")
