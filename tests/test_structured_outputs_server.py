"""Structured outputs through `deltaserve serve`: `response_format`, vLLM's `structured_outputs`
and `guided_*` extras, the official client's `beta.chat.completions.parse`, streaming, and a
400 naming the field for every bad constraint while other requests run on untouched."""
from __future__ import annotations

import asyncio
import json
import os
import re
import threading
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from json_schemas import SCHEMAS
from model_utils import make_tiny_model
from pydantic import BaseModel, Field
from server_utils import CHAT_TEMPLATE, Server

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "user", "content": "Answer in JSON."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_model(str(tmp_path_factory.mktemp("serve") / "tiny"), tokenizer=True)
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    srv = Server(path, "--served-model-name", "tiny", "--dtype", "float32",
                 "--max-model-len", "512")
    yield srv
    assert srv.stop() == 0, srv.output()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": "tiny", **body}, timeout=120.0)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_schema_is_met_through_chat(server, temperature):
    async def ask(http: httpx.AsyncClient, i: int, schema: dict) -> dict:
        response = await http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": MESSAGES, "max_tokens": 200, "seed": i,
            "temperature": temperature, "response_format": {
                "type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}})
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]

    async def main() -> list[dict]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300.0) as http:
            return await asyncio.gather(*(ask(http, i, s) for i, s in enumerate(SCHEMAS)))
    for schema, choice in zip(SCHEMAS, asyncio.run(main())):
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def test_every_way_of_asking_on_completions(server):
    cases = [({"guided_json": SCHEMAS[0]}, lambda t: jsonschema.validate(json.loads(t),
                                                                          SCHEMAS[0])),
             ({"structured_outputs": {"json": json.dumps(SCHEMAS[1]),
                                      "disable_any_whitespace": True}},
              lambda t: jsonschema.validate(json.loads(t), SCHEMAS[1]) or " " not in t),
             ({"guided_regex": "[0-9]{2}:[0-9]{2}"},
              lambda t: re.fullmatch("[0-9]{2}:[0-9]{2}", t)),
             ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
             ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
             ({"guided_grammar": 'root ::= "on" | "off"'}, lambda t: t in ("on", "off")),
             ({"response_format": {"type": "json_schema", "json_schema": {
                 "name": "x", "schema": SCHEMAS[2], "strict": True}}},
              lambda t: jsonschema.validate(json.loads(t), SCHEMAS[2])),
             ({"response_format": {"type": "text"}, "max_tokens": 3}, lambda t: True)]
    for extra, check in cases:
        response = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 60,
                                                     "temperature": 1.0, "seed": 1, **extra})
        assert response.status_code == 200, (extra, response.text)
        text = response.json()["choices"][0]["text"]
        assert check(text) is not False, (extra, text)


class Pet(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=30)
    kind: Literal["cat", "dog", "fish"]
    tags: list[Literal["cute", "old", "loud"]] = Field(max_length=2)


def test_the_openai_client_parses_into_a_pydantic_model(client):
    for temperature in (0.0, 1.0):
        completion = client.beta.chat.completions.parse(
            model="tiny", messages=MESSAGES, response_format=Pet, max_tokens=200,
            temperature=temperature, seed=5)
        parsed = completion.choices[0].message.parsed
        assert isinstance(parsed, Pet), completion.choices[0].message.content


def test_a_streamed_constrained_response_concatenates_to_valid_json(client):
    schema = SCHEMAS[-1]
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=200, temperature=0.0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), schema)


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nope"}}}}, "response_format",
     "response_format.json_schema.schema is not a valid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "response_format.json_schema.schema must be"),
    ({"response_format": {"type": "yaml"}}, "response_format", "response_format.type"),
    ({"guided_regex": "(a"}, "guided_regex", "guided_regex is not a valid regex"),
    ({"guided_json": "{not json"}, "guided_json", "guided_json is not valid JSON"),
    ({"guided_choice": []}, "guided_choice", "guided_choice must be a non-empty list"),
    ({"guided_grammar": "start: nothing_here"}, "guided_grammar", "not a valid grammar"),
    ({"guided_grammar": "x" * 70000}, "guided_grammar", "at most 65536 characters"),
    ({"structured_outputs": {"json": {"type": "object"}, "regex": "a"}}, "structured_outputs",
     "exactly one of"),
    ({"structured_outputs": {"regex": "a", "colour": 1}}, "structured_outputs",
     "unknown fields colour"),
    ({"structured_outputs": {"json": {"properties": {"a": {"$ref": "#/nowhere"}}}}},
     "structured_outputs", "structured_outputs.json is not a valid JSON schema"),
    ({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}},
     "guided_json", "only one structured-output constraint"),
]


def test_bad_constraints_are_400s_naming_the_field_and_others_run_on(server):
    results: dict[str, httpx.Response] = {}

    def long_request() -> None:  # in flight the whole time, constrained and not
        results["free"] = _post(server, "/v1/completions", {
            "prompt": "x", "max_tokens": 150, "ignore_eos": True, "temperature": 0.0})
    worker = threading.Thread(target=long_request)
    worker.start()
    for route, body in (("/v1/completions", {"prompt": "x"}),
                        ("/v1/chat/completions", {"messages": MESSAGES})):
        for extra, param, message in BAD:
            response = _post(server, route, {**body, "max_tokens": 20, **extra})
            assert response.status_code == 400, (extra, response.text)
            error = response.json()["error"]
            assert error["param"] == param and message in error["message"], (extra, error)
    ok = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 10,
                                           "guided_choice": ["fine"]})
    worker.join(120)
    assert ok.json()["choices"][0]["text"] == "fine"
    assert results["free"].status_code == 200
    assert len(results["free"].json()["choices"][0]["text"]) > 0
