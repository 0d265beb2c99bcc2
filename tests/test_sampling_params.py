"""SamplingParams: vLLM's defaults, and a ValueError naming the field for bad values."""
from __future__ import annotations

import pytest

from protocol import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1, 1.0, 1.0, 0, 0.0, None)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.max_tokens, p.min_tokens) == (
        None, None, False, 16, 0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.logprobs, p.skip_special_tokens, p.include_stop_str_in_output) == (None, True, False)
    assert not p.greedy and not p.needs_penalties


def test_normalization():
    p = SamplingParams(stop="\n\n", temperature=0)
    assert p.stop == ["\n\n"] and p.greedy
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(top_k=-1).top_k == -1
    assert SamplingParams(repetition_penalty=1.2).needs_penalties


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
    ("min_p", -0.1), ("min_p", 1.1), ("max_tokens", 0), ("max_tokens", -3),
    ("min_tokens", -1), ("presence_penalty", 2.5), ("frequency_penalty", -2.1),
    ("repetition_penalty", 0.0), ("logprobs", -1), ("temperature", "hot"), ("seed", 1.5),
    ("n", True), ("stop", [""]), ("stop", [3]), ("stop_token_ids", [-1]),
    ("stop_token_ids", ["a"]), ("ignore_eos", 1),
])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_cannot_exceed_max_tokens():
    with pytest.raises(ValueError, match="min_tokens must be at most max_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)
    assert SamplingParams(min_tokens=5, max_tokens=None).min_tokens == 5
