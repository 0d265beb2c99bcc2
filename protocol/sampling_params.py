"""Sampling parameters: vLLM's field names and defaults, validated on construction and decode."""
from __future__ import annotations

from protocol.structured_outputs import StructuredOutputsParams
from protocol.wire_struct import WireStruct

# Below this temperature sampling is greedy (argmax), as in vLLM.
GREEDY_EPS = 1e-5
# Stop strings are matched in the front-end on every new piece of text of every sequence, so
# their number and total length are bounded (OpenAI's API allows 4).
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 16384
MAX_STOP_TOKEN_IDS = 1024
# The engine computes in float32: a float parameter must be finite there.
FLOAT32_MAX = 3.4028234663852886e38


class SamplingParams(WireStruct):
    """How to sample one request's tokens.

    `max_tokens=None` means "up to max_model_len"; the front-end resolves it per prompt.
    `top_k` of 0 or -1 disables top-k. A `seed` makes sampling reproducible per request,
    independent of batch composition and identical on every tensor-parallel rank.
    `structured_outputs` constrains the output to a JSON schema, a regex, a choice or a
    grammar (see `StructuredOutputsParams`).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # The constraint the output must match (None: free text; one byte on the wire, sent
    # once with the request).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check_types(self)
        _check_ranges(self)
        _to_floats(self)
        _check_sizes(self)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


_INT_FIELDS = ("n", "top_k", "min_tokens")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty")
_OPTIONAL_INT_FIELDS = ("seed", "max_tokens", "logprobs")
_INT64 = 1 << 63


def _check_types(p: SamplingParams) -> None:
    for name in _INT_FIELDS:
        _expect(name, getattr(p, name), int)
    for name in _FLOAT_FIELDS:
        _expect(name, getattr(p, name), (int, float))
    for name in _OPTIONAL_INT_FIELDS:
        value = getattr(p, name)
        if value is not None:
            _expect(name, value, int)
    for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
        _expect(name, getattr(p, name), bool)
    if p.stop is not None and not all(isinstance(s, str) and s for s in p.stop):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {_short(p.stop)}")
    if p.structured_outputs is not None and not isinstance(p.structured_outputs,
                                                           StructuredOutputsParams):
        raise ValueError(f"structured_outputs must be StructuredOutputsParams, got "
                         f"{_short(p.structured_outputs)}")
    if p.stop_token_ids is not None and not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p.stop_token_ids):
        raise ValueError(f"stop_token_ids must be non-negative ints, got {_short(p.stop_token_ids)}")


def _to_floats(p: SamplingParams) -> None:
    """Float fields given as ints become floats (an int too large for a float, or for the
    wire, is refused here rather than when the request is sent)."""
    for name in _FLOAT_FIELDS:
        value = getattr(p, name)
        if type(value) is int and not -_INT64 <= value < 2 * _INT64:
            raise ValueError(f"{name} must be a finite float32 number, got {_short(value)}")
        as_float = float(value)
        if not -FLOAT32_MAX <= as_float <= FLOAT32_MAX:  # also refuses NaN
            raise ValueError(f"{name} must be a finite float32 number, got {_short(value)}")
        if type(value) is not float:
            setattr(p, name, as_float)


def _check_sizes(p: SamplingParams) -> None:
    if p.stop is not None:
        if len(p.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop must hold at most {MAX_STOP_STRINGS} strings, "
                             f"got {len(p.stop)}")
        chars = sum(len(s) for s in p.stop)
        if chars > MAX_STOP_CHARS:
            raise ValueError(f"stop must total at most {MAX_STOP_CHARS} characters, "
                             f"got {chars}")
    if p.stop_token_ids is not None and len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"stop_token_ids must hold at most {MAX_STOP_TOKEN_IDS} ids, "
                         f"got {len(p.stop_token_ids)}")


def _expect(name: str, value: object, kind: type | tuple[type, ...]) -> None:
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        raise ValueError(f"{name} must be of type {getattr(kind, '__name__', 'number')}, "
                         f"got {_short(value)}")


def _check_ranges(p: SamplingParams) -> None:
    rules = (
        ("n", p.n >= 1, "at least 1"),
        ("temperature", p.temperature >= 0.0, "non-negative"),
        ("top_p", 0.0 < p.top_p <= 1.0, "in (0, 1]"),
        ("top_k", p.top_k >= -1, "-1 or 0 (disabled), or at least 1"),
        ("min_p", 0.0 <= p.min_p <= 1.0, "in [0, 1]"),
        ("max_tokens", p.max_tokens is None or p.max_tokens >= 1, "at least 1"),
        ("min_tokens", p.min_tokens >= 0, "non-negative"),
        ("min_tokens", p.max_tokens is None or p.min_tokens <= p.max_tokens,
         f"at most max_tokens ({p.max_tokens})"),
        ("presence_penalty", -2.0 <= p.presence_penalty <= 2.0, "in [-2, 2]"),
        ("frequency_penalty", -2.0 <= p.frequency_penalty <= 2.0, "in [-2, 2]"),
        ("repetition_penalty", p.repetition_penalty > 0.0, "positive"),
        ("logprobs", p.logprobs is None or p.logprobs >= 0, "non-negative"),
    ) + tuple((name, -_INT64 <= value < _INT64, "a 64-bit integer")
              for name in _INT_FIELDS + _OPTIONAL_INT_FIELDS
              if (value := getattr(p, name)) is not None)
    for name, ok, expected in rules:
        if not ok:
            raise ValueError(f"{name} must be {expected}, got {_short(getattr(p, name))}")


def _short(value: object) -> str:
    """A value for an error message: huge ints and long strings abbreviated."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"
