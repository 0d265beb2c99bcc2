"""Scheduler + one ModelRunner in one process: greedy tokens equal Hugging Face `generate`."""
from __future__ import annotations

import random

import pytest
from model_utils import assert_greedy_matches, hf_greedy, model_dir_for

from engine_core import CacheConfig, Request, Scheduler, SchedulerConfig
from protocol import EngineConfig, SamplingParams
from worker.model_runner import ModelRunner

MAX_NEW = 10
_rng = random.Random(1)
SHARED = [_rng.randrange(256) for _ in range(40)]
PROMPTS = {
    "mixed": [[_rng.randrange(256) for _ in range(n)] for n in (3, 17, 40, 1, 64, 9)],
    "shared_prefix": [SHARED + [_rng.randrange(256) for _ in range(n)] for n in (1, 7, 20)]
    + [SHARED[:33], SHARED[:16]],
}


def generate(model_dir: str, prompts: list[list[int]], *, num_blocks: int = 200,
             block_size: int = 16, budget: int = 512, max_num_seqs: int = 16,
             caching: bool = True, params: SamplingParams | None = None,
             waves: int = 1, dtype: str = "float32", max_model_len: int = 256,
             quantization: str = "auto") -> tuple[list[list[int]], Scheduler]:
    """Run prompts through Scheduler + ModelRunner; `waves` > 1 submits them in turns, each
    after the previous finished, so later ones can hit the prefix cache of earlier ones."""
    runner = ModelRunner(EngineConfig(model=model_dir, dtype=dtype, block_size=block_size,
                                      num_gpu_blocks_override=num_blocks,
                                      max_model_len=max_model_len, quantization=quantization))
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                        max_model_len=max_model_len),
        CacheConfig(block_size, runner.num_blocks, caching,
                    tuple(runner.sliding_windows) or (0,)))
    scheduler.num_cached_tokens_seen = 0  # prefix-cache hits reported in the outputs
    params = params or SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    tokens: dict[str, list[int]] = {}
    per_wave = -(-len(prompts) // waves)
    for start in range(0, len(prompts), per_wave):
        for i in range(start, min(start + per_wave, len(prompts))):
            scheduler.add_request(Request(str(i), prompts[i], params, arrival_time=float(i)))
        while scheduler.has_unfinished_requests():
            so = scheduler.schedule()
            for out in scheduler.update_from_output(so, runner.execute_model(so)):
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finished:
                    scheduler.num_cached_tokens_seen += out.num_cached_tokens
    return [tokens[str(i)] for i in range(len(prompts))], scheduler


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "gemma3"])
def model(request, tmp_path_factory):
    path = model_dir_for(tmp_path_factory, request.param)
    refs = {name: hf_greedy(path, prompts, MAX_NEW) for name, prompts in PROMPTS.items()}
    return path, refs


def test_mixed_batch(model):
    path, refs = model
    ours, _ = generate(path, PROMPTS["mixed"])
    assert_greedy_matches(ours, refs["mixed"])


def test_chunked_prefill(model):
    path, refs = model
    ours, _ = generate(path, PROMPTS["mixed"], budget=8)
    assert_greedy_matches(ours, refs["mixed"])


def test_prefix_cache_hits(model):
    path, refs = model
    ours, scheduler = generate(path, PROMPTS["shared_prefix"], waves=2, block_size=8)
    # Same step: 40 + 40 (full SHARED blocks); 2nd wave: 32 of 33 and 8 of 16 (last token kept).
    assert scheduler.num_cached_tokens_seen == 40 + 40 + 32 + 8
    assert_greedy_matches(ours, refs["shared_prefix"])


def test_preemption_with_few_blocks(model):
    path, refs = model
    # Gemma 3's blocks hold one of its three layer groups each (one global, two local).
    num_blocks = 31 if "gemma3" in path else 14
    ours, scheduler = generate(path, PROMPTS["mixed"], num_blocks=num_blocks, block_size=8,
                               budget=64)
    assert scheduler.num_preemptions > 0
    assert_greedy_matches(ours, refs["mixed"])


@pytest.mark.parametrize("arch", ["llama3_rope", "mistral"])
def test_other_configs(arch, tmp_path_factory):
    path = model_dir_for(tmp_path_factory, arch)
    ours, _ = generate(path, PROMPTS["mixed"], budget=24)
    assert_greedy_matches(ours, hf_greedy(path, PROMPTS["mixed"], MAX_NEW))


def test_tied_embeddings_and_gqa_mqa(tmp_path_factory):
    for overrides in ({"tie_word_embeddings": True}, {"num_key_value_heads": 1},
                      {"num_key_value_heads": 4, "hidden_size": 128}):
        path = model_dir_for(tmp_path_factory, "llama", **overrides)
        ours, _ = generate(path, PROMPTS["mixed"][:3])
        assert_greedy_matches(ours, hf_greedy(path, PROMPTS["mixed"][:3], MAX_NEW))
