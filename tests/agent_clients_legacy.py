"""Clients that cannot share the test venv, run by hand in their own venvs against a server
started as `deltaserve serve --model smollm2 --enable-auto-tool-choice --tool-call-parser
hermes --port 8771`:

    python3 -m venv /tmp/o1 && /tmp/o1/bin/pip install 'openai<2' && \
        /tmp/o1/bin/python tests/agent_clients_legacy.py openai1
    python3 -m venv /tmp/ins && /tmp/ins/bin/pip install instructor && \
        /tmp/ins/bin/python tests/agent_clients_legacy.py instructor

openai 1.x's `.stream()` helper built two calls (one nameless) from a chunk that repeated an
index; instructor's partial streaming in TOOLS mode lost the first `{"` of the arguments.
(instructor pins jiter<0.15, which the newest openai refuses, hence the separate venvs.)"""
from __future__ import annotations

import json
import sys

URL = "http://127.0.0.1:8771/v1"
TOOLS = [{"type": "function", "function": {"name": "Person", "parameters": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                     "age": {"type": "integer"}}, "required": ["name", "age"]}}}]
MESSAGES = [{"role": "user", "content": "John is 31."}]


def openai1() -> None:
    import openai
    client = openai.OpenAI(base_url=URL, api_key="x", max_retries=0)
    pinned = ('<tool_call>\n{"name": "Person", "arguments": {"name": "John", "age": 31}}\n'
              "</tool_call>")
    for kwargs in ({"tool_choice": {"type": "function", "function": {"name": "Person"}}},
                   {"tool_choice": "required"},
                   {"extra_body": {"structured_outputs": {"choice": [pinned]}}}):  # "auto"
        with client.beta.chat.completions.stream(model="smollm2", messages=MESSAGES,
                                                 tools=TOOLS, temperature=0, max_tokens=60,
                                                 **kwargs) as stream:
            calls = stream.get_final_completion().choices[0].message.tool_calls
        assert [(c.function.name, json.loads(c.function.arguments)["age"]) for c in calls] \
            == [("Person", 31)], calls
    print(f"openai {openai.__version__}: .stream() builds one whole call in every tool mode")


def instructor_partial() -> None:
    import instructor
    import openai
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=20)
        age: int
    client = instructor.from_openai(openai.OpenAI(base_url=URL, api_key="x", max_retries=0),
                                    mode=instructor.Mode.TOOLS)
    partials = list(client.chat.completions.create_partial(
        model="smollm2", response_model=Person, messages=MESSAGES, temperature=0,
        max_tokens=60))
    assert len(partials) > 1 and (partials[-1].name, partials[-1].age) == ("John", 31)
    print(f"instructor {instructor.__version__}: {len(partials)} partials, {partials[-1]}")


if __name__ == "__main__":
    {"openai1": openai1, "instructor": instructor_partial}[sys.argv[1]]()
