"""The Responses and Anthropic Messages routes, and tools beside an output schema, through a
real `deltaserve serve` (a tiny random model whose template renders tools, calls, results and
reasoning; the hermes tool parser, an API key, a store of 2 responses; reasoning items are
checked in test_answer_routes, since a reasoning parser leaves the reasoning free of any
constraint and a random model's reasoning never ends):
whole and streamed answers agree and validate as the official SDKs' types, the store chains,
evicts and says so, errors have each API's shape, and every route is behind the key and
counted in the metrics. The model's text is pinned with a choice constraint where it
matters."""
from __future__ import annotations

import json
import os

import anthropic
import httpx
import jsonschema
import openai
import pytest
from model_utils import make_tiny_model
from openai.types.responses import Response
from server_utils import Server

pytestmark = pytest.mark.slow

TEMPLATE = (
    "{% if tools %}<|system|>Tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
    "\n{% endif %}{% for m in messages %}{% if m['role'] == 'tool' %}<|tool|>"
    "{{ m['tool_call_id'] }}={{ m['content'] }}\n{% else %}<|{{ m['role'] }}|>"
    "{% if m.get('reasoning') %}<think>{{ m['reasoning'] }}</think>{% endif %}"
    "{{ m['content'] }}{% for c in m.get('tool_calls') or [] %}<tool_call>"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}"
    "</tool_call>{% endfor %}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
KEY = "sk-agents"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
           "required": ["city"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
RESP_TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
ANSWER = {"type": "object", "properties": {"verdict": {"enum": ["yes", "no"]}},
          "required": ["verdict"]}
PINNED = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
          '"Paris"}}\n</tool_call>')


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_model(str(tmp_path_factory.mktemp("agents") / "tiny"), tokenizer=True,
                           max_position_embeddings=2048)
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write(TEMPLATE)
    srv = Server(path, "--dtype", "float32", "--max-model-len", "1024", "--served-model-name",
                 "tiny", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                 "--responses-store-max-responses", "2",
                 api_key=KEY)
    yield srv
    assert srv.stop() == 0, srv.output()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def _items(response) -> list[dict]:
    return [{k: v for k, v in item.model_dump(exclude_none=True).items()
             if k not in ("id", "call_id")} for item in response.output]


def test_responses_whole_and_streamed_agree(client):
    kwargs = dict(model="tiny", input="Weather in Paris?", tools=RESP_TOOLS,
                  max_output_tokens=200, extra_body={"structured_outputs": {"choice": [PINNED]}})
    whole = client.responses.create(**kwargs)
    Response.model_validate(whole.model_dump(exclude_unset=True))  # the SDK's type, strictly
    assert [item.type for item in whole.output] == ["message", "function_call"]
    assert whole.output_text == "Let me check."
    assert json.loads(whole.output[1].arguments) == {"city": "Paris"}
    assert whole.status == "completed" and whole.output[1].call_id.startswith("call_")
    types = []
    with client.responses.stream(**kwargs) as stream:
        for event in stream:
            types.append(event.type)
        streamed = stream.get_final_response()
    assert _items(streamed) == _items(whole)
    assert (streamed.usage.input_tokens, streamed.usage.output_tokens) == \
        (whole.usage.input_tokens, whole.usage.output_tokens)
    assert streamed.usage.input_tokens_details.cached_tokens > 0  # the prefix cache's hits
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    for kind in ("response.output_text.delta",
                 "response.function_call_arguments.delta",
                 "response.function_call_arguments.done", "response.output_item.done"):
        assert kind in types


def test_responses_store_chains_evicts_and_says_so(server, client):
    first = client.responses.create(model="tiny", input="Hello", max_output_tokens=4,
                                    instructions="Be brief.")
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    second = client.responses.create(model="tiny", previous_response_id=first.id,
                                     input=[{"type": "message", "role": "user",
                                             "content": [{"type": "input_text", "text": "More"}]}],
                                     max_output_tokens=4)
    # the history (first's input and output) reached the prompt; first's instructions did not
    assert second.usage.input_tokens > first.usage.input_tokens
    items = httpx.get(f"{server.url}/v1/responses/{second.id}/input_items",
                      headers=server.headers).json()["data"]
    assert [i.get("role", i.get("type")) for i in items] == ["user", "assistant", "user"]
    assert client.responses.retrieve(second.id).output == second.output
    third = client.responses.create(model="tiny", input="x", max_output_tokens=2, store=True)
    client.responses.create(model="tiny", input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError) as e:  # evicted: the store keeps 2
        client.responses.retrieve(first.id)
    assert "evicted" in str(e.value) and "2 most recently used" in str(e.value)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="tiny", previous_response_id=first.id, input="again")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(third.id)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="tiny", input="x", background=True)
    client.responses.delete(third.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(third.id)


def test_responses_refusals_name_the_field(client):
    for kwargs, param in [
            ({"tools": [{"type": "web_search"}]}, "tools"),
            ({"input": [{"type": "image_generation_call"}]}, "input"),
            ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {
                "type": "string", "pattern": "(?<=a)b"}}}}, "text"),
            ({"input": [{"type": "function_call", "call_id": "c", "name": "f",
                         "arguments": "[" * 100_000 + "]" * 100_000}]}, "input")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(**{"model": "tiny", "input": "x", **kwargs})
        assert e.value.body["param"] == param, e.value.body


def test_messages_whole_and_streamed_agree(server):
    client = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    tools = [{"name": "get_weather", "input_schema": WEATHER}]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    kwargs = dict(model="tiny", max_tokens=60, messages=messages, tools=tools,
                  tool_choice={"type": "tool", "name": "get_weather"},
                  extra_body={"temperature": 0.0})
    whole = client.messages.create(**kwargs)
    assert whole.stop_reason == "tool_use" and [b.type for b in whole.content] == ["tool_use"]
    jsonschema.validate(whole.content[0].input, WEATHER)
    with client.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    assert [b.input for b in streamed.content] == [b.input for b in whole.content]
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    # the loop's next turn: tool_use and tool_result blocks render, the answer is text
    follow = messages + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in whole.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": whole.content[0].id,
                                      "content": [{"type": "text", "text": "Sunny"}]}]}]
    plain = client.messages.create(model="tiny", max_tokens=5, messages=follow, tools=tools,
                                   tool_choice={"type": "none"}, stop_sequences=["zzz"])
    assert plain.stop_reason == "max_tokens" and plain.content[0].type == "text"
    counted = client.messages.count_tokens(model="tiny", messages=follow, tools=tools)
    assert counted.input_tokens == plain.usage.input_tokens + \
        plain.usage.cache_read_input_tokens


def test_messages_errors_have_anthropics_shape(server):
    for body, status, kind in [
            ({"model": "nope"}, 404, "not_found_error"),
            ({"tool_choice": {"type": "sometimes"}}, 400, "invalid_request_error"),
            ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
             400, "invalid_request_error")]:
        response = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY}, json={
            "model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
            **body})
        assert response.status_code == status
        assert response.json()["type"] == "error"
        assert response.json()["error"]["type"] == kind


def test_every_route_is_behind_the_key_and_counted(server, client):
    for path, shape in [("/v1/responses", "openai"), ("/v1/messages", "anthropic"),
                        ("/v1/messages/count_tokens", "anthropic"),
                        ("/v1/responses/resp_x", "openai")]:
        response = httpx.post(server.url + path, json={})
        assert response.status_code == 401, path
        error = response.json()["error"]
        assert (error["type"] == "authentication_error") == (shape == "anthropic")
    before = server.metrics()
    client.responses.create(model="tiny", input="x", max_output_tokens=2)
    anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0).messages.create(
        model="tiny", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    after = server.metrics()
    key = 'vllm:request_success_total{finished_reason="length"}'
    assert after[key] - before.get(key, 0) == 2


def test_auto_tools_beside_a_response_format_take_either_branch(client):
    """One grammar with both branches: across seeds, answers are valid calls or
    schema-valid content, never anything else; a forced call takes the schema too."""
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    kinds = set()
    for seed in range(8):
        out = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=CHAT_TOOLS, response_format=fmt, temperature=1.0, seed=seed,
            parallel_tool_calls=False, max_tokens=200).choices[0]
        if out.message.tool_calls:
            kinds.add("call")
            assert out.finish_reason == "tool_calls" and len(out.message.tool_calls) == 1
            for call in out.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), WEATHER)
        elif out.finish_reason == "stop":
            kinds.add("content")
            jsonschema.validate(json.loads(out.message.content), ANSWER)
    assert kinds == {"call", "content"}, kinds
    forced = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], tools=CHAT_TOOLS,
        response_format=fmt, tool_choice="required", max_tokens=60).choices[0]
    assert forced.finish_reason == "tool_calls"
