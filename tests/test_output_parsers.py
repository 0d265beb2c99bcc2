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


@pytest.mark.parametrize("tool_choice,reasoning,text,want,parallel", [
    ("auto", "qwen3", f"<think>weather?</think>\n<tool_call>{WEATHER}</tool_call>",
     ("weather?", None, [["get_weather", '{"city": "Paris", "unit": "celsius"}']]), None),
    ("auto", None, f"<tool_call>{WEATHER}</tool_call><tool_call>{TIME}</tool_call>",
     (None, None, [["get_weather", '{"city": "Paris", "unit": "celsius"}']]), False),
    ("required", None, '[{"name": "get_time", "parameters": {}}, '
     '{"name": "get_weather", "parameters": {"city": "Oslo"}}]',
     (None, None, [["get_time", "{}"], ["get_weather", '{"city": "Oslo"}']]), None),
    ({"type": "function", "function": {"name": "get_weather"}}, None, '{"city":"Rome"}',
     (None, None, [["get_weather", '{"city":"Rome"}']]), None),
    ("none", "deepseek_r1", "hmm</think>It is sunny.", ("hmm", "It is sunny.", []), None),
])
def test_chat_answers_whole_and_streamed(tool_choice, reasoning, text, want, parallel):
    from launch.entrypoints.openai.chat_answer import ChatAnswerParser
    from launch.entrypoints.openai.tool_choice import parse_tool_choice
    choice = parse_tool_choice(TOOLS, tool_choice, parallel)
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


@pytest.fixture(scope="module")
def guidance_tokenizer(tmp_path_factory):
    from model_utils import make_tiny_model

    from engine_core.structured_output.guidance_tokenizer import load
    path = make_tiny_model(str(tmp_path_factory.mktemp("reasoning") / "tiny"), tokenizer=True)
    from tokenizers import Tokenizer
    return load(path, None, 0), Tokenizer.from_file(f"{path}/tokenizer.json")


ANSWERS = [  # (constraint, texts it must accept after reasoning, texts it must refuse)
    ({"json": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}},
     ['{"a": 1}'], ['{"a": 1, "b": 2}', '{"a":1}', '{"a": 1}  ']),
    ({"regex": "ab+c/d"}, ["abbc/d"], ["ac/d"]),
    ({"choice": ["yes", "no"]}, ["no"], ["maybe"]),
    ({"grammar": 'root ::= "x" [0-9]+'}, ["x12"], ["y1"]),
    ({"grammar": 'start: "x" /[0-9]+/'}, ["x1"], ["x"]),
    ({"json_object": True}, ["{}"], ["[]"]),
]


@pytest.mark.parametrize("constraint, good, bad", ANSWERS)
@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_reasoning_leaves_thinking_free_and_constrains_the_answer(guidance_tokenizer, name,
                                                                  constraint, good, bad):
    """The grammar a reasoning parser makes from a constraint, run by llguidance on a real
    tokenizer: free text up to `</think>` (and at most 4 whitespace characters), then the
    answer under the constraint; qwen3 may skip the think block, deepseek_r1 may not."""
    import llguidance

    from engine_core.structured_output.grammar import check_grammar, grammar_text
    from protocol import StructuredOutputsParams
    tokenizer, encoder = guidance_tokenizer
    params = get_reasoning_parser(name).constrain(StructuredOutputsParams(**constraint))
    check_grammar(params)
    grammar = grammar_text(params)

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        ids = encoder.encode(text, add_special_tokens=False).ids
        return matcher.consume_tokens(ids) and matcher.is_accepting()
    for answer in good:
        assert accepts(f"<think>a </thin k> b</think>\n\n{answer}")
        assert accepts(answer) == (name == "qwen3")
        assert not accepts(f"<think>a</think>{' ' * 5}{answer}")
        assert not accepts(f"<think>a</think></think>{answer}")
    for answer in bad:
        assert not accepts(f"<think>a</think>{answer}")


def test_serve_parser_flags():
    import argparse

    from launch.cli.serve import chat_parsers
    args = argparse.Namespace(enable_auto_tool_choice=True, tool_call_parser=None,
                              reasoning_parser=None)
    with pytest.raises(ValueError, match="--tool-call-parser"):
        chat_parsers(args)
    args.tool_call_parser, args.reasoning_parser = "hermes", "deepseek_r1"
    parsers = chat_parsers(args)
    assert parsers.tool_parser.name == "hermes" and parsers.reasoning.name == "deepseek_r1"
    args.enable_auto_tool_choice = False  # a parser alone does not enable "auto"
    assert chat_parsers(args).tool_parser is None
