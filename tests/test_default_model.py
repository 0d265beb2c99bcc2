"""The shipped demo model loads through the normal path and matches Hugging Face."""
from __future__ import annotations

import json
import os

import pytest
from model_utils import assert_greedy_matches, hf_greedy

from launch import LLM, SamplingParams
from launch.model_cache.cache import SHIPPED_MODEL

PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef ", "class Stack:\n    def push(self, item):"]


@pytest.fixture(scope="module")
def shipped():
    if not os.path.isfile(os.path.join(SHIPPED_MODEL, "model.safetensors")):
        pytest.fail(f"the demo model is missing from {SHIPPED_MODEL}")
    return SHIPPED_MODEL


def test_checkpoint_is_small_and_described(shipped):
    size = sum(os.path.getsize(os.path.join(shipped, f)) for f in os.listdir(shipped))
    assert size <= 8.5 * 2**20
    with open(os.path.join(shipped, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    card = open(os.path.join(shipped, "README.md")).read()
    assert "train_demo_model.py" in card


@pytest.mark.slow
def test_greedy_matches_hugging_face(shipped):
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    with LLM(shipped, dtype="float32", max_model_len=512) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    refs = hf_greedy(shipped, [o.prompt_token_ids for o in outs], 32)
    assert_greedy_matches([o.outputs[0].token_ids for o in outs], refs)


@pytest.mark.slow
def test_completion_looks_like_python(shipped):
    with LLM(shipped, max_model_len=512) as llm:  # dtype auto: bfloat16, as shipped
        (out,) = llm.generate("def fibonacci(n):", SamplingParams(temperature=0.0,
                                                                  max_tokens=48),
                              use_tqdm=False)
    text = out.outputs[0].text
    assert "\n    " in text and ("return" in text or "if " in text or "for " in text), text
