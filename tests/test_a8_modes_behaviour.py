"""Issue 34's contract for the 8-bit-activation modes (`gguf_a8`, `w8a8`), beyond accuracy:
structured outputs and speculative decoding behave as in any mode. Real engine processes on
the demo model (w8a8 on its dense checkpoint, gguf_a8 on it written as a GGUF file):

- a JSON-schema request ends by itself (finish "stop") with text the schema accepts;
- greedy decoding with n-gram speculation gives exactly the tokens it gives without, in the
  same mode (speculation verifies the drafts with the same products a plain step runs).
"""
from __future__ import annotations

import json

import pytest
from test_gguf_a8_model import DEMO, demo_gguf  # noqa: F401 (a fixture)

from launch import LLM, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.slow  # real engine processes

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
# Prompts that repeat themselves (prompt lookup finds drafts) and one that does not.
PROMPTS = ["def add(a, b):\n    return a + b\n\n\ndef add(",
           "for i in range(10):\n    print(i)\nfor i in range(",
           "import os\nimport sys\nimport os\nimport ",
           "class Stack:\n    def __init__(self):\n"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "ok", "kind"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "ok": {"type": "boolean"},
                         "kind": {"enum": ["function", "class", "module"]}}}


@pytest.fixture(scope="module", params=["w8a8", "gguf_a8"])
def mode(request) -> tuple[str, str]:
    """(model directory, quantization)."""
    quantization = request.param
    model = DEMO if quantization == "w8a8" else request.getfixturevalue("demo_gguf")
    return model, quantization


def _llm(model: str, quantization: str, **engine) -> LLM:
    return LLM(model, quantization=quantization, max_model_len=256, block_size=8,
               num_gpu_blocks_override=96, max_num_batched_tokens=64, **engine)


def _valid(obj: object) -> bool:
    return (isinstance(obj, dict) and set(obj) == {"name", "ok", "kind"}
            and isinstance(obj["name"], str) and len(obj["name"]) <= 12
            and isinstance(obj["ok"], bool) and obj["kind"] in ("function", "class", "module"))


@pytest.mark.timeout(300)
def test_speculation_and_structured_outputs_behave_as_in_any_mode(mode):
    model, quantization = mode
    constrained = SamplingParams(temperature=0.0, max_tokens=96, structured_outputs=(
        StructuredOutputsParams(json=SCHEMA)))
    sampled = SamplingParams(temperature=0.8, seed=5, max_tokens=96,
                             structured_outputs=StructuredOutputsParams(json=SCHEMA))
    with _llm(model, quantization) as llm:
        plain = [list(o.outputs[0].token_ids)
                 for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        json_outs = llm.generate(["# describe this code as JSON\n"] * 2, [constrained, sampled],
                                 use_tqdm=False)
    with _llm(model, quantization, speculative_config=NGRAM) as llm:
        spec = [list(o.outputs[0].token_ids)
                for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert spec == plain, quantization
    for out in json_outs:
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", (quantization, text)
        assert _valid(json.loads(text)), (quantization, text)
