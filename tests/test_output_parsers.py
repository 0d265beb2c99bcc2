"""Tool-call parsers (hermes, llama3_json) and reasoning parsers (qwen3, deepseek_r1) on model
texts with 0, 1 and 2 calls, malformed calls and cut tags: the whole-text result, and the
streamed deltas under many random cuts adding up to exactly that result."""
from __future__ import annotations

import json
import random

import pytest

from launch.entrypoints.openai.reasoning import get_reasoning_parser
from launch.entrypoints.openai.tool_parsers import get_tool_parser

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {"zone": "CET"}}'


def _cuts(text: str, rng: random.Random) -> list[str]:
    points = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12))))
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


def _streamed_tools(parser, pieces: list[str]) -> tuple[str, list[dict]]:
    stream = parser.stream()
    content, calls = "", []
    for out in [*(stream.feed(p) for p in pieces), stream.finish()]:
        content += out[0]
        for delta in out[1]:
            if delta.name is not None:
                assert delta.index == len(calls) and delta.id.startswith("call_")
                calls.append({"name": delta.name, "arguments": delta.arguments})
            else:
                calls[delta.index]["arguments"] += delta.arguments
    return content, calls


HERMES_CASES = [  # text, content, [(name, arguments)]
    ("The weather in Paris is mild.", "The weather in Paris is mild.", []),
    (f"<tool_call>\n{WEATHER}\n</tool_call>", None, [("get_weather", WEATHER)]),
    (f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>{TIME}</tool_call>\n",
     "Let me check.", [("get_weather", WEATHER), ("get_time", TIME)]),
    (f"<tool_call>{WEATHER}", None, [("get_weather", WEATHER)]),  # stopped before closing
    ('<tool_call>{"name": "f", "arguments": {"x": </tool_call> sorry',
     '<tool_call>{"name": "f", "arguments": {"x": </tool_call> sorry', []),
    (f"a <tool_call>not json</tool_call> b <tool_call>{TIME}</tool_call> c",
     "a <tool_call>not json</tool_call> bc", [("get_time", TIME)]),
    ("ends with a partial tag <tool_c", "ends with a partial tag <tool_c", []),
]


@pytest.mark.parametrize("text,content,calls", HERMES_CASES)
def test_hermes(text, content, calls):
    parser = get_tool_parser("hermes")
    result = parser.extract(text)
    assert result.content == content
    want = [(name, json.dumps(json.loads(args)["arguments"])) for name, args in calls]
    assert [(c.name, c.arguments) for c in result.tool_calls] == want
    assert len({c.id for c in result.tool_calls}) == len(calls)
    rng = random.Random(len(text))
    for _ in range(50):
        streamed_content, streamed_calls = _streamed_tools(parser, _cuts(text, rng))
        assert streamed_content == (content or "")
        assert [(c["name"], c["arguments"]) for c in streamed_calls] == want


LLAMA_CASES = [
    ('{"name": "get_time", "parameters": {"zone": "CET"}}', None, [("get_time", {"zone": "CET"})]),
    ('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}',
     None, [("a", {"x": 1}), ("b", {})]),
    ("Hello {there}", "Hello {there}", []),
    ('{"name": "a", "parameters": {"x": ', '{"name": "a", "parameters": {"x": ', []),
    ("  plain answer", "  plain answer", []),
]


@pytest.mark.parametrize("text,content,calls", LLAMA_CASES)
def test_llama3_json(text, content, calls):
    parser = get_tool_parser("llama3_json")
    result = parser.extract(text)
    assert result.content == content
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == calls
    rng = random.Random(len(text))
    for _ in range(50):
        streamed_content, streamed_calls = _streamed_tools(parser, _cuts(text, rng))
        assert streamed_content == (content or "")
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed_calls] == calls


REASONING_CASES = [  # parser, text, reasoning, content
    ("qwen3", "<think>\nLet me think.\n</think>\n\nParis.", "\nLet me think.\n", "\n\nParis."),
    ("qwen3", "Paris.", None, "Paris."),
    ("qwen3", "  <think>still thinking", "still thinking", None),
    ("qwen3", "<thin", None, "<thin"),
    ("deepseek_r1", "I recall it.</think>Paris.", "I recall it.", "Paris."),
    ("deepseek_r1", "<think>I recall it.</think>Paris.", "I recall it.", "Paris."),
    ("deepseek_r1", "thinking, cut off by max_tokens", "thinking, cut off by max_tokens", None),
]


@pytest.mark.parametrize("name,text,reasoning,content", REASONING_CASES)
def test_reasoning(name, text, reasoning, content):
    parser = get_reasoning_parser(name)
    assert parser.extract(text) == (reasoning, content)
    rng = random.Random(len(text))
    for _ in range(50):
        stream = parser.stream()
        got = ["", ""]
        for out in [*(stream.feed(p) for p in _cuts(text, rng)), stream.finish()]:
            got[0] += out[0]
            got[1] += out[1]
        assert got == [reasoning or "", content or ""]


def test_unknown_parser_names():
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("mistral_v9")
    with pytest.raises(ValueError, match="qwen3"):
        get_reasoning_parser("o1")
