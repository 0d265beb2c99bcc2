"""Tool-call parsers (hermes, llama3_json) and reasoning parsers (qwen3, deepseek_r1) on model
texts with 0, 1 and 2 calls, malformed, cut and deeply nested calls and cut tags: the
whole-text result, and the streamed parts under many random cuts adding up to exactly that
result, in the same order; a call's arguments stream as written once its name is known."""
from __future__ import annotations

import random

import pytest

from launch.entrypoints.openai.reasoning import get_reasoning_parser
from launch.entrypoints.openai.tool_parsers import get_tool_parser

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {"zone": "CET"}}'


def _cuts(text: str, rng: random.Random) -> list[str]:
    points = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12))))
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


def _streamed_tools(parser, pieces: list[str]) -> tuple[str, list[dict], list]:
    """(content, calls, the order of parts: "content" or a call's index, each once)."""
    stream = parser.stream()
    content, calls, order = "", [], []
    for out in [*(stream.feed(p) for p in pieces), stream.finish()]:
        for part in out:
            kind = "content" if isinstance(part, str) else part.index
            if not order or order[-1] != kind:
                order.append(kind)
            if isinstance(part, str):
                content += part
            elif part.name is not None:
                assert part.index == len(calls) and part.id.startswith("call_")
                calls.append({"name": part.name, "arguments": part.arguments})
            else:
                assert part.index == len(calls) - 1  # a call's pieces come together
                calls[part.index]["arguments"] += part.arguments
    return content, calls, order


def _check_streams(parser, text: str, content, want: list, order: list | None = None) -> None:
    result = parser.extract(text)
    assert result.content == content
    assert [(c.name, c.arguments) for c in result.tool_calls] == want
    assert len({c.id for c in result.tool_calls}) == len(want)
    orders = set()
    rng = random.Random(len(text))
    for _ in range(60):
        got_content, got_calls, got_order = _streamed_tools(parser, _cuts(text, rng))
        assert got_content == (content or "")
        assert [(c["name"], c["arguments"]) for c in got_calls] == want
        orders.add(tuple(got_order))
    assert len(orders) == 1  # the order of content and calls does not depend on the cut
    if order is not None:
        assert list(orders.pop()) == order


DEEP = "[" * 20_000 + "]" * 20_000  # far past the recursion limit
HERMES_CASES = [  # text, content, [(name, arguments as written)], order of parts
    ("The weather in Paris is mild.", "The weather in Paris is mild.", [], ["content"]),
    (f"<tool_call>\n{WEATHER}\n</tool_call>", None,
     [("get_weather", '{"city": "Paris", "unit": "celsius"}')], [0]),
    (f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>{TIME}</tool_call>\n",
     "Let me check.", [("get_weather", '{"city": "Paris", "unit": "celsius"}'),
                       ("get_time", '{"zone": "CET"}')], ["content", 0, 1]),
    (f"<tool_call>{WEATHER}", None,  # stopped before closing
     [("get_weather", '{"city": "Paris", "unit": "celsius"}')], [0]),
    # the name is known, so it is a call; cut arguments stay as written (OpenAI's shape)
    ('<tool_call>{"name": "f", "arguments": {"x": </tool_call> sorry', "sorry",
     [("f", '{"x": ')], [0, "content"]),
    (f"a <tool_call>not json</tool_call> b <tool_call>{TIME}</tool_call> c",
     "a <tool_call>not json</tool_call> bc", [("get_time", '{"zone": "CET"}')],
     ["content", 0, "content"]),
    ("ends with a partial tag <tool_c", "ends with a partial tag <tool_c", [], ["content"]),
    # other forms are held until the block ends, then parsed whole
    ('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>', None, [("f", '{"a": 1}')],
     [0]),
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": [1]}"}</tool_call>', None,
     [("f", '{"a": [1]}')], [0]),
    ('x<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
     'x<tool_call>{"name": "f", "arguments": [1]}</tool_call>', [], ["content"]),
    # nesting far past Python's recursion limit: as written, or content; never an error
    (f'<tool_call>{{"name": "f", "arguments": {{"a": {DEEP}}}}}</tool_call>', None,
     [("f", f'{{"a": {DEEP}}}')], [0]),
    (f'<tool_call>{{"arguments": {{"a": {DEEP}}}, "name": "f"}}</tool_call>',
     f'<tool_call>{{"arguments": {{"a": {DEEP}}}, "name": "f"}}</tool_call>', [],
     ["content"]),
]


@pytest.mark.parametrize("text,content,calls,order", HERMES_CASES,
                         ids=[str(i) for i in range(len(HERMES_CASES))])
def test_hermes(text, content, calls, order):
    _check_streams(get_tool_parser("hermes"), text, content, calls, order)


LLAMA_CASES = [
    ('{"name": "get_time", "parameters": {"zone": "CET"}}', None,
     [("get_time", '{"zone": "CET"}')]),
    ('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}',
     None, [("a", '{"x": 1}'), ("b", "{}")]),
    ("Hello {there}", "Hello {there}", []),
    ('{"name": "a", "parameters": {"x": ', None, [("a", '{"x": ')]),  # cut: as written
    ("  plain answer", "  plain answer", []),
    ('  {"answer": 42} tail', '  {"answer": 42} tail', []),  # JSON content, not a call
    ('{"name": "a", "parameters": {}} and more', " and more", [("a", "{}")]),
    ('{"parameters": {"x": 1}, "name": "a"}', None, [("a", '{"x": 1}')]),
    ("<|python_t", "<|python_t", []),
    (f'{{"name": "a", "parameters": {{"d": {DEEP}}}}}', None, [("a", f'{{"d": {DEEP}}}')]),
]


@pytest.mark.parametrize("text,content,calls", LLAMA_CASES,
                         ids=[str(i) for i in range(len(LLAMA_CASES))])
def test_llama3_json(text, content, calls):
    _check_streams(get_tool_parser("llama3_json"), text, content, calls)


@pytest.mark.parametrize("name", ["hermes", "llama3_json"])
def test_arguments_stream_as_written(name):
    """Once a call's name is known, each new piece of its arguments is sent at once, before
    the call (or the block) ends."""
    head = '{"name": "get_weather", "%s": ' % ("arguments" if name == "hermes" else "parameters")
    stream = get_tool_parser(name).stream()
    assert stream.feed(("<tool_call>\n" if name == "hermes" else "") + head) == []
    first = stream.feed('{"city"')  # the value has begun: the name is known
    assert [(d.name, d.arguments) for d in first] == [("get_weather", ""), (None, '{"city"')]
    for piece in [': "Pa', 'ris"', "}"]:
        assert [(d.name, d.arguments) for d in stream.feed(piece)] == [(None, piece)]


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
    # forced answers cut by max_tokens: the calls as written so far, never the grammar's text
    ("required", None, '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", '
     '"parameters": {"ci', (None, None, [["get_time", "{}"], ["get_weather", '{"ci']]), None),
    ("required", None, '[{"name": "get_w', (None, "", []), None),
    ({"type": "function", "function": {"name": "get_weather"}}, "qwen3",
     '<think>x</think>{"city": "Ro', ("x", None, [["get_weather", '{"city": "Ro']]), None),
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
        assert (got["reasoning"] or None, got["content"] or None, got["calls"]) == \
            (want[0], want[1] or None, want[2])


def test_chat_deltas_carry_one_entry_per_call_and_both_reasoning_names():
    """OpenAI's stream shape: a chunk never holds two entries with the same index; a call's
    first entry has index, id, type, name and its first arguments, later ones index and
    arguments only."""
    from launch.entrypoints.openai.chat_answer import ChatAnswerParser
    from launch.entrypoints.openai.serving_chat import delta_fields
    from launch.entrypoints.openai.tool_choice import parse_tool_choice
    for choice, text in [("required", '[{"name": "get_time", "parameters": {}}, '
                          '{"name": "get_weather", "parameters": {"city": "Oslo"}}]'),
                         ("auto", f"<think>hm</think><tool_call>{WEATHER}</tool_call>"),
                         ({"type": "function", "function": {"name": "get_time"}}, "{}")]:
        parser = ChatAnswerParser(parse_tool_choice(TOOLS, choice, None),
                                  get_tool_parser("hermes"), get_reasoning_parser("qwen3"))
        rng = random.Random(3)
        for cut in [[text], *(_cuts(text, rng) for _ in range(20))]:
            stream, seen = parser.stream(), set()
            for delta in [*(stream.feed(p) for p in cut), stream.finish()]:
                fields = delta_fields(delta)
                assert fields.get("reasoning") == fields.get("reasoning_content")
                entries = fields.get("tool_calls", [])
                assert len({e["index"] for e in entries}) == len(entries)
                for e in entries:
                    if e["index"] in seen:
                        assert set(e) == {"index", "function"} and set(e["function"]) == \
                            {"arguments"}
                    else:
                        seen.add(e["index"])
                        assert e["id"].startswith("call_") and e["type"] == "function"
                        assert set(e["function"]) == {"name", "arguments"}


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
    not_object = [{"type": "function", "function": {"name": "n", "parameters": {
        "type": "integer"}}}]
    for tools, choice in ((TOOLS, {"type": "function", "function": {"name": "nope"}}),
                          (None, "required"), (TOOLS, "sometimes"), ([{"type": "x"}], None),
                          (TOOLS + TOOLS[:1], None), (not_object, "required")):
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


@pytest.mark.parametrize("parser_name", ["hermes", "llama3_json"])
def test_auto_tools_beside_a_schema_is_one_grammar_of_two_branches(guidance_tokenizer,
                                                                   parser_name):
    """tool_choice "auto" with a response_format: the answer is calls in the parser's format
    (each valid for its tool) or content matching the schema, and the parser reads the calls
    back; with a reasoning parser, after the reasoning."""
    import llguidance

    from engine_core.structured_output.grammar import check_grammar, grammar_text
    from launch.entrypoints.openai.chat_constraint import after_reasoning, chat_constraint
    from launch.entrypoints.openai.structured_outputs import StructuredFields
    from launch.entrypoints.openai.tool_choice import parse_tool_choice
    tokenizer, encoder = guidance_tokenizer
    parser = get_tool_parser(parser_name)
    body = StructuredFields(response_format={"type": "json_schema", "json_schema": {
        "name": "answer", "schema": {"type": "object", "properties": {
            "verdict": {"enum": ["yes", "no"]}}, "required": ["verdict"]}}})
    key = parser.arguments_key
    call = '{"name": "get_weather", "%s": {"city": "Oslo"}}' % key
    calls = {"hermes": f"<tool_call>\n{call}\n</tool_call>\n<tool_call>\n"
             f'{{"name": "get_time", "arguments": {{}}}}\n</tool_call>',
             "llama3_json": f'{call}; {{"name": "get_time", "parameters": {{}}}}'}[parser_name]
    for reasoning in (None, "qwen3"):
        constraints = chat_constraint(body, parse_tool_choice(TOOLS, "auto", None), parser)
        assert [c.param for c in constraints.checks] == ["response_format"]
        params = after_reasoning(constraints.answer,
                                 get_reasoning_parser(reasoning) if reasoning else None).params
        check_grammar(params)
        grammar = grammar_text(params)

        def accepts(text: str) -> bool:
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            ids = encoder.encode(text, add_special_tokens=False).ids
            return matcher.consume_tokens(ids) and matcher.is_accepting()
        prefix = "<think>hm</think>\n" if reasoning else ""
        assert accepts(prefix + calls) and accepts(prefix + '{"verdict": "no"}')
        assert not accepts(prefix + '{"verdict": "maybe"}')
        assert not accepts(prefix + calls.replace('"Oslo"', "3"))  # the tool's schema holds
        assert not accepts(prefix + "Just text.")
        extracted = parser.extract(calls)
        assert [c.name for c in extracted.tool_calls] == ["get_weather", "get_time"]
    # forced calls: the schema is accepted (checked on its own), the call is what is enforced
    forced = chat_constraint(body, parse_tool_choice(TOOLS, "required", None), parser)
    assert forced.answer.param == "tools" and forced.checks[0].param == "response_format"
