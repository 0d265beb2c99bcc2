"""Every message shape OpenAI's API accepts reaches a chat template the way vLLM normalizes it
(content null, absent, text or parts for every role; tool calls with and without content;
tool results as text or parts; names; reasoning), rendered by real Hugging Face-style
templates; what a template or the normalization refuses is a 400 naming the message, never
a 500, however deeply the arguments nest."""
from __future__ import annotations

import json

import msgspec
import pytest

from launch.entrypoints.openai.chat_messages import message_dicts, render
from launch.entrypoints.openai.errors import APIError
from launch.entrypoints.openai.protocol import ChatMessage
from launch.processing.chat_template import ChatTemplate

# SmolLM2's template concatenates content (the case that failed on "content": null), and a
# Qwen2.5-like one that renders tools, calls and tool results.
CONCAT = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\\n{% endif %}")
TOOLS = (
    "{% for m in messages %}{% if m.role == 'tool' %}<tool_response>{{ m.content }}"
    "</tool_response>{% elif m.tool_calls %}{{ m.content }}{% for c in m.tool_calls %}"
    "<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}"
    "</tool_call>{% endfor %}{% else %}[{{ m.role }}{% if m.name %}:{{ m.name }}{% endif %}]"
    "{{ m.content }}{% endif %}{% endfor %}")
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "add", "arguments": '{"a": 1, "b": [2]}'}}


def _messages(raw: list[dict]) -> list[ChatMessage]:
    return msgspec.convert(raw, list[ChatMessage])


SHAPES = [  # every role with content null, absent, text, parts; calls; tool results
    {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
    {"role": "developer", "content": "And kind."},
    {"role": "user", "content": [{"type": "text", "text": "Add"}, {"type": "text", "text": "1+2"}],
     "name": "ann"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "3"}]},
    {"role": "assistant", "tool_calls": [CALL, {**CALL, "id": "call_2"}]},
    {"role": "tool", "tool_call_id": "call_2", "content": "3"},
    {"role": "assistant", "content": "Both 3.", "tool_calls": []},
    {"role": "user"},
    {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}],
     "reasoning_content": "hmm"},
]


def test_every_shape_renders_normalized():
    dicts = message_dicts(_messages(SHAPES))
    assert [m["content"] for m in dicts] == [
        "Be brief.", "And kind.", "Add\n1+2", "", "3", "", "3", "Both 3.", "", "No."]
    assert dicts[2]["name"] == "ann" and dicts[4]["tool_call_id"] == "call_1"
    assert dicts[3]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": [2]}
    assert len(dicts[5]["tool_calls"]) == 2 and "tool_calls" not in dicts[7]
    assert dicts[9]["reasoning"] == dicts[9]["reasoning_content"] == "hmm"
    for source in (CONCAT, TOOLS):
        text = render(ChatTemplate(source), dicts, True, None)
        assert "Add\n1+2" in text
    assert '<tool_call>{"name": "add", "arguments": {"a": 1, "b": [2]}}</tool_call>' in \
        render(ChatTemplate(TOOLS), dicts, True, None)


@pytest.mark.parametrize("arguments, want", [
    ("not json", {}), ("[1, 2]", {}), ("", {}), ({"x": 1}, {"x": 1})])
def test_malformed_arguments_become_an_empty_object(arguments, want):
    """vLLM's rule: a malformed call in the history must not fail every later turn."""
    call = {**CALL, "function": {"name": "f", "arguments": arguments}}
    (message,) = message_dicts(_messages([{"role": "assistant", "tool_calls": [call]}]))
    assert message["tool_calls"][0]["function"]["arguments"] == want


def test_deep_arguments_and_bad_parts_are_400s_naming_the_message():
    deep = "[" * 100_000 + "]" * 100_000
    call = {**CALL, "function": {"name": "f", "arguments": f'{{"a": {deep}}}'}}
    with pytest.raises(APIError) as e:
        message_dicts(_messages([{"role": "user", "content": "x"},
                                 {"role": "assistant", "tool_calls": [call]}]))
    assert e.value.status == 400 and "messages[1].tool_calls[0]" in e.value.message
    with pytest.raises(APIError) as e:
        message_dicts(_messages([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:,"}}]}]))
    assert e.value.status == 400 and "messages[0]" in e.value.message


def test_a_failing_template_is_a_400_naming_the_first_message_it_fails_on():
    strict = ("{% for m in messages %}{% if m.role == 'tool' and not m.tool_call_id %}"
              "{{ raise_exception('a tool message needs its call id') }}{% endif %}"
              "{{ m.content }}{% endfor %}")
    messages = message_dicts(_messages([{"role": "user", "content": "a"},
                                        {"role": "assistant", "content": "b"},
                                        {"role": "tool", "content": "c"},
                                        {"role": "user", "content": "d"}]))
    with pytest.raises(APIError) as e:
        render(ChatTemplate(strict), messages, True, None)
    assert e.value.status == 400 and e.value.param == "messages"
    assert e.value.message.startswith("messages[2]: ") and "call id" in e.value.message
    deep: dict = {}
    for _ in range(5000):  # arguments that parse but are too deep for the template's tojson
        deep = {"a": deep}
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": deep}}
    with pytest.raises(APIError) as e:
        render(ChatTemplate(TOOLS), [{"role": "assistant", "content": "", "tool_calls": [call]}],
               True, None)
    assert e.value.status == 400


def test_the_tool_parser_never_fails_on_its_own_output_fed_back():
    """A call cut short (arguments as written) comes back next turn as {}: the loop goes on."""
    from launch.entrypoints.openai.tool_parsers import get_tool_parser
    (call,) = get_tool_parser("hermes").extract(
        '<tool_call>{"name": "f", "arguments": {"x": [1, ').tool_calls
    back = {"role": "assistant", "tool_calls": [call.to_openai()]}
    (message,) = message_dicts(_messages([back]))
    assert message["tool_calls"][0]["function"]["arguments"] == {}
    assert json.loads(json.dumps(message))  # what the template receives is plain JSON
