"""Weight-only int8 (`--quantization int8`) on a tiny random model: perplexity on a fixed text
within 1 % of float32's, and the engine serves it end to end."""
from __future__ import annotations

import pytest
from model_utils import CORPUS, make_tiny_model
from quant_utils import perplexity, prompt_logits, runner

from launch import LLM, SamplingParams
from launch.processing.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("int8") / "model"), tokenizer=True,
                           hidden_size=128, intermediate_size=256)


def test_perplexity_within_one_percent_of_float32(tiny):
    ids = load_tokenizer(tiny).encode(CORPUS)[:240]
    dense, int8 = runner(tiny, "none"), runner(tiny, "int8")
    assert int8.weights_summary.startswith("int8 (int8 x")
    assert int8.model.model.layers[0].mlp.down_proj.weight.dtype.itemsize == 1
    base = perplexity(prompt_logits(dense, ids), ids)
    quantized = perplexity(prompt_logits(int8, ids), ids)
    assert abs(quantized / base - 1) < 0.01, (base, quantized)


@pytest.mark.slow
def test_engine_serves_int8(tiny):
    with LLM(tiny, quantization="int8", max_model_len=128, num_gpu_blocks_override=16) as llm:
        assert llm.inputs.ready.quantization.startswith("int8")
        (out,) = llm.generate("def add(a, b):", SamplingParams(temperature=0.0, max_tokens=8,
                                                              ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 8
