"""The whole engine on the CUDA kernel code without a GPU: `LLM(attention_backend="emulated")`
runs worker/kernels/*.cu in the CPU emulator inside the worker process (which builds the
emulator library itself) and must give Hugging Face's greedy tokens, on tiny models with
head_dim 64 and 128, GQA and MQA, through chunked prefills and prefix-cache hits."""
from __future__ import annotations

import random

import pytest
from model_utils import assert_greedy_matches, hf_greedy, make_tiny_model

from launch import LLM, SamplingParams
from worker.emulator import EmulatorUnavailable, cuda_include_dir
from worker.emulator.build import compiler

MODELS = {  # name -> (architecture, config overrides)
    "llama-d64-gqa": ("llama", {"hidden_size": 256, "num_attention_heads": 4,
                                "num_key_value_heads": 2}),
    "qwen3-d128-mqa": ("qwen3", {"hidden_size": 128, "num_attention_heads": 4,
                                 "num_key_value_heads": 1, "head_dim": 128}),
}
_rng = random.Random(5)
SHARED = [_rng.randrange(1, 250) for _ in range(40)]
WAVES = [  # the second wave runs after the first, so its shared prefix hits the cache
    [SHARED + [_rng.randrange(1, 250) for _ in range(n)] for n in (3, 30)]
    + [[_rng.randrange(1, 250) for _ in range(n)] for n in (90, 1, 5)],
    [SHARED + [7, 8, 9], SHARED[:33], SHARED[:16] + [11]],
]
NEW = 8
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _emulator_missing() -> str | None:
    try:
        compiler(), cuda_include_dir()
    except EmulatorUnavailable as e:
        return f"kernel emulator unavailable: {e}"
    return None


@pytest.mark.skipif(_emulator_missing() is not None, reason=str(_emulator_missing()))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_emulated_engine_matches_hf_greedy(name, tmp_path, monkeypatch):
    arch, overrides = MODELS[name]
    path = make_tiny_model(str(tmp_path / "model"), arch, tokenizer=True, **overrides)
    kemu_cache = tmp_path / "kemu"
    monkeypatch.setenv("DELTASERVE_KEMU_CACHE", str(kemu_cache))  # inherited by the worker
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    # A budget of 24 tokens chunks the 90- and 70-token prefills.
    with LLM(path, dtype="float32", attention_backend="emulated", block_size=16,
             max_num_batched_tokens=24, num_gpu_blocks_override=64, max_model_len=256) as llm:
        assert llm.engine.ready.attention_backend == "emulated"
        outs = [llm.generate([{"prompt_token_ids": p} for p in wave], params, use_tqdm=False)
                for wave in WAVES]
    for wave, wave_outs in zip(WAVES, outs):
        assert_greedy_matches([o.outputs[0].token_ids for o in wave_outs],
                              hf_greedy(path, wave, NEW))
    assert min(o.num_cached_tokens for o in outs[1]) >= 16, "the second wave should hit"
    built = [p.name for p in kemu_cache.glob("attention-float32-*.so")]
    assert len(built) == 1, f"the worker should have built its emulator library: {built}"
