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


def _answer_stream(parser, pieces: list[str]) -> dict:
    stream = parser.stream()
    got = {"reasoning": "", "content": "", "calls": []}
    for delta in [*(stream.feed(p) for p in pieces), stream.finish()]:
        got["reasoning"] += delta.reasoning
        got["content"] += delta.content
        for d in delta.tool_calls:
            if d.name is not None:
                got["calls"].append([d.name, d.arguments])
            else:
                got["calls"][d.index][1] += d.arguments
    return got


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time"}}]


@pytest.mark.parametrize("tool_choice,reasoning,text,want", [
    ("auto", "qwen3", f"<think>weather?</think>\n<tool_call>{WEATHER}</tool_call>",
     ("weather?", None, [["get_weather", '{"city": "Paris", "unit": "celsius"}']])),
    ("required", None, '[{"name": "get_time", "parameters": {}}, '
     '{"name": "get_weather", "parameters": {"city": "Oslo"}}]',
     (None, None, [["get_time", "{}"], ["get_weather", '{"city": "Oslo"}']])),
    ({"type": "function", "function": {"name": "get_weather"}}, None, '{"city":"Rome"}',
     (None, None, [["get_weather", '{"city":"Rome"}']])),
    ("none", "deepseek_r1", "hmm</think>It is sunny.", ("hmm", "It is sunny.", [])),
])
def test_chat_answers_whole_and_streamed(tool_choice, reasoning, text, want):
    from launch.entrypoints.openai.chat_answer import ChatAnswerParser
    from launch.entrypoints.openai.tool_choice import parse_tool_choice
    choice = parse_tool_choice(TOOLS, tool_choice, None)
    parser = ChatAnswerParser(choice, get_tool_parser("hermes"),
                              get_reasoning_parser(reasoning) if reasoning else None)
    answer = parser.parse(text)
    assert (answer.reasoning, answer.content,
            [[c.name, c.arguments] for c in answer.tool_calls]) == want
    rng = random.Random(7)
    for _ in range(30):
        got = _answer_stream(parser, _cuts(text, rng))
        assert (got["reasoning"] or None, got["content"] or None, got["calls"]) == want


def test_tool_choice_schema_and_refusals():
    from launch.entrypoints.openai.errors import APIError
    from launch.entrypoints.openai.tool_choice import parse_tool_choice
    required = parse_tool_choice(TOOLS, "required", False).schema()
    assert required["type"] == "array" and required["maxItems"] == 1
    names = [item["properties"]["name"]["const"] for item in required["items"]["anyOf"]]
    assert names == ["get_weather", "get_time"]
    named = parse_tool_choice(TOOLS, {"type": "function", "function": {"name": "get_time"}},
                              None)
    assert named.schema() == {"type": "object"}
    assert parse_tool_choice(None, None, None).mode == "none"
    assert parse_tool_choice(TOOLS, None, None).mode == "auto"
    for tools, choice in ((TOOLS, {"type": "function", "function": {"name": "nope"}}),
                          (None, "required"), (TOOLS, "sometimes"), ([{"type": "x"}], None),
                          (TOOLS + TOOLS[:1], None)):
        with pytest.raises(APIError) as e:
            parse_tool_choice(tools, choice, None)
        assert e.value.status == 400 and e.value.param in ("tools", "tool_choice")
