"""Whole vs streamed, for every route that answers chat, under random cuts of the model's
text: the chat message rebuilt from chunk deltas, the Responses output rebuilt from its typed
events and Anthropic's content blocks rebuilt from its stream events all equal the whole
answer; event order is what the APIs promise (an item added before its deltas, done after)."""
from __future__ import annotations

import json
import random

import msgspec
import pytest

from launch.entrypoints.openai.anthropic.serving import _block, _block_event
from launch.entrypoints.openai.chat_answer import ChatAnswerParser
from launch.entrypoints.openai.output_items import ItemBuilder, whole_items
from launch.entrypoints.openai.reasoning import get_reasoning_parser
from launch.entrypoints.openai.responses_output import ResponseEvents, item_json
from launch.entrypoints.openai.serving_chat import delta_fields
from launch.entrypoints.openai.tool_choice import parse_tool_choice
from launch.entrypoints.openai.tool_parsers import get_tool_parser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_time"}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CASES = [  # tool_choice, reasoning parser, model text
    ("auto", None, "Plain text, no call."),
    ("auto", None, f"Let me look.\n{CALL}\n{CALL.replace('Paris', 'Oslo')}"),
    ("auto", "qwen3", f"<think>The user wants weather.</think>\n{CALL} and then text"),
    ("auto", "qwen3", "<think>cut short in thought"),
    ("auto", None, '<tool_call>{"name": "get_weather", "arguments": {"city": "Ro'),
    ("required", None, '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", '
     '"parameters": {"city": "Lima"}}]'),
    ({"type": "function", "function": {"name": "get_weather"}}, "deepseek_r1",
     'hmm</think>{"city": "Kyiv"}'),
]


def _cuts(text: str, rng: random.Random) -> list[str]:
    points = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 15))))
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


def _parser(tool_choice, reasoning) -> ChatAnswerParser:
    return ChatAnswerParser(parse_tool_choice(TOOLS, tool_choice, None), get_tool_parser("hermes"),
                            get_reasoning_parser(reasoning) if reasoning else None)


def _deltas(parser: ChatAnswerParser, pieces: list[str]):
    stream = parser.stream()
    for piece in pieces:
        yield stream.feed(piece)
    yield stream.finish()


def _chat(parser: ChatAnswerParser, pieces: list[str]) -> dict:
    message: dict = {"role": "assistant", "content": None}
    for delta in _deltas(parser, pieces):
        fields = delta_fields(delta)
        for key in ("content", "reasoning", "reasoning_content"):
            if key in fields:
                message[key] = (message.get(key) or "") + fields[key]
        for entry in fields.get("tool_calls", []):
            calls = message.setdefault("tool_calls", [])
            if entry["index"] == len(calls):
                calls.append({k: entry[k] for k in ("id", "type", "function")})
            else:
                calls[entry["index"]]["function"]["arguments"] += entry["function"]["arguments"]
    return message


def _responses(parser: ChatAnswerParser, pieces: list[str]) -> list[dict]:
    events, builder, done = ResponseEvents(), ItemBuilder(), {}
    stream = []
    for delta in _deltas(parser, pieces):
        stream += [chunk for e in builder.feed(delta) for chunk in events.of_item(e)]
    stream += [chunk for e in builder.finish() for chunk in events.of_item(e)]
    added: set[int] = set()
    for chunk in stream:
        kind, data = chunk.split(b"\n")[:2]
        event = json.loads(data.removeprefix(b"data: "))
        assert kind == b"event: " + event["type"].encode()
        index = event.get("output_index")
        if event["type"] == "response.output_item.added":
            assert index == len(added) and index not in done
            added.add(index)
        else:
            assert index in added and index not in done  # nothing after an item is done
        if event["type"] == "response.output_item.done":
            done[index] = event["item"]
    assert [e for e in range(len(done))] == sorted(done)
    return [_anonymous(item) for _, item in sorted(done.items())]


def _anonymous(item: dict) -> dict:
    """Without the ids each answer draws anew."""
    return {k: v for k, v in item.items() if k not in ("id", "call_id")}


def _anthropic(parser: ChatAnswerParser, pieces: list[str]) -> list[dict]:
    blocks: list[dict] = []
    partial: dict[int, str] = {}
    builder = ItemBuilder()
    events = [e for d in _deltas(parser, pieces) for e in builder.feed(d)] + builder.finish()
    for event in (json.loads(_block_event(e).split(b"data: ")[1]) for e in events):
        if event["type"] == "content_block_start":
            assert event["index"] == len(blocks)
            blocks.append(event["content_block"])
        elif event["type"] == "content_block_delta":
            block, delta = blocks[event["index"]], event["delta"]
            if delta["type"] == "input_json_delta":
                partial[event["index"]] = partial.get(event["index"], "") + delta["partial_json"]
            else:
                key = {"text_delta": "text", "thinking_delta": "thinking"}[delta["type"]]
                block[key] += delta[key]
        elif event["index"] in partial:  # content_block_stop: what the SDK parses
            from launch.entrypoints.openai.anthropic.serving import tool_input
            blocks[event["index"]]["input"] = tool_input(partial[event["index"]])
    return blocks


@pytest.mark.parametrize("tool_choice, reasoning, text", CASES,
                         ids=[str(i) for i in range(len(CASES))])
def test_every_route_streams_what_it_answers_whole(tool_choice, reasoning, text):
    parser = _parser(tool_choice, reasoning)
    whole = parser.parse(text).message()
    items = whole_items(parser.parts(text))
    whole_responses = [_anonymous(item_json(item, "x", "completed")) for item in items]
    whole_blocks = [_block(item) for item in items]
    msgspec.json.encode(whole_blocks)  # plain JSON
    rng = random.Random(len(text))
    for _ in range(40):
        pieces = _cuts(text, rng)
        streamed = _chat(parser, pieces)
        assert {k: v for k, v in streamed.items() if k != "tool_calls"} == \
            {k: v for k, v in whole.items() if k != "tool_calls"}
        assert [c["function"] for c in streamed.get("tool_calls", [])] == \
            [c["function"] for c in whole.get("tool_calls", [])]
        assert _responses(parser, pieces) == whole_responses
        got = _anthropic(parser, pieces)
        assert [_anonymous(b) for b in got] == [_anonymous(b) for b in whole_blocks]


def test_reasoning_tokens_count_up_to_the_end_of_the_reasoning(tmp_path):
    from model_utils import make_tiny_model

    from launch.entrypoints.openai.responses_output import reasoning_tokens
    from launch.processing.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(make_tiny_model(str(tmp_path / "tiny"), tokenizer=True))
    thought = tokenizer.encode("<think>a b c d</think>", add_special_tokens=False)
    answer = tokenizer.encode(" yes", add_special_tokens=False)
    text = tokenizer.decode(thought + answer)
    assert reasoning_tokens(tokenizer, thought + answer, text, True, "</think>") == len(thought)
    assert reasoning_tokens(tokenizer, thought[:3], "<thi", True, "</think>") == 3
    assert reasoning_tokens(tokenizer, answer, " yes", False, "</think>") == 0


def test_tool_input_of_any_arguments_is_an_object():
    """Anthropic's `input` from a call's arguments as written: whole, cut, or nested past any
    recursion limit, never an error."""
    from launch.entrypoints.openai.anthropic.serving import tool_input
    deep = "[" * 100_000 + "]" * 100_000
    assert tool_input('{"city": "Paris"}') == {"city": "Paris"}
    assert tool_input('{"n": 1, "city": "Pa') == {"n": 1}  # as the SDK parses partial JSON
    assert tool_input('{"a": ' + deep + "}") == {}
    assert tool_input("[1]") == {} and tool_input("") == {}
