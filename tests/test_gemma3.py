"""Gemma 3 and sliding-window KV: the config reading, the KV layer groups, what the hybrid KV
manager keeps and what a prefix-cache hit is with windows, the native layer loop against the
Python one, and (slow) the whole engine against Hugging Face on a tiny random Gemma 3 with a
window of 8 tokens: TP 1 and 2, chunked prefill, prefix caching, preemption, n-gram
speculation, record and replay."""
from __future__ import annotations

import os
import re

import pytest
import torch
from model_utils import assert_greedy_matches, hf_greedy, make_tiny_model

from engine_core.kv_cache.kv_cache_manager import KVCacheManager
from engine_core.request import Request
from launch import LLM, SamplingParams
from protocol import EngineConfig
from replay import replay
from worker.attention.kv_cache_spec import KVCacheSpec
from worker.model_runner import ModelRunner
from worker.models.adapters import Gemma3Facts
from worker.models.config import UnsupportedModelError
from worker.models.registry import model_config

GEMMA_270M_LAYERS = tuple(512 if (i + 1) % 6 else 0 for i in range(18))


def _req(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=1000))


# --- configs and groups ---------------------------------------------------------------------

def test_facts_from_both_config_layouts():
    new = {"num_hidden_layers": 6, "sliding_window": 512, "layer_types": [
        "sliding_attention"] * 5 + ["full_attention"], "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}}
    old = {"num_hidden_layers": 6, "sliding_window": 512, "sliding_window_pattern": 6,
           "rope_theta": 1e6, "rope_local_base_freq": 10000.0,
           "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    a, b = Gemma3Facts.read(new), Gemma3Facts.read(old)
    assert a.sliding == b.sliding == (True,) * 5 + (False,)
    assert (a.local_rope_theta, a.global_rope_theta) == (b.local_rope_theta,
                                                         b.global_rope_theta) == (1e4, 1e6)
    assert a.global_rope_scaling["factor"] == b.global_rope_scaling["factor"] == 8.0


@pytest.mark.parametrize("change,message", [
    ({"hidden_activation": "relu"}, "hidden_activation"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn"}}}, "rope type"),
    ({"layer_types": ["chunked_attention"] * 4}, "layer_types")])
def test_what_gemma3_refuses_is_named(change, message):
    hf = {"architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 4, **change}
    with pytest.raises(UnsupportedModelError, match=message):
        model_config(hf)


def test_kv_groups_follow_vllms_uniform_grouping():
    spec = KVCacheSpec(18, 1, 256, torch.float32, GEMMA_270M_LAYERS)
    groups = spec.groups()
    assert [g.sliding_window for g in groups] == [0] + [512] * 5
    assert groups[0].layers == (5, 11, 17) and groups[1].layers == (0, 1, 2)
    assert spec.group_size() == 3 and spec.bytes_per_block(16) == 2 * 3 * 16 * 256 * 4
    full = KVCacheSpec(18, 1, 256, torch.float32, GEMMA_270M_LAYERS, hybrid=False)
    assert [(g.sliding_window, len(g.layers)) for g in full.groups()] == [(0, 18)]
    assert [len(g.layers) for g in KVCacheSpec(4, 1, 8, torch.float32).groups()] == [4]


# --- the hybrid KV manager ------------------------------------------------------------------

def test_a_window_group_holds_only_what_its_window_reads():
    kv = KVCacheManager(200, 4, sliding_windows=(0, 8), max_step_tokens=4)
    request = _req("0", list(range(10)))
    assert kv.allocate_slots(request, 10) is not None
    request.num_computed_tokens = 10
    for step in range(100):
        assert kv.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
        request.append_output_token_ids(1000 + step)
        full, window = kv.groups[0].req_to_blocks["0"], kv.groups[1].req_to_blocks["0"]
        live = [i for i, b in enumerate(window) if not b.is_null]
        # keys [n - 7, n] of the next token: 3 blocks of 4, one being filled, and one the
        # window left since the last new block
        assert len(live) <= 4 and live == list(range(live[0], len(window)))
        assert len(full) == len(window) and not any(b.is_null for b in full)
        kv.check_integrity()
    assert kv.blocks_for_sequence(110) == [28, 4]  # at most, with steps of 4 slots
    kv.free(request)
    kv.check_integrity()
    assert kv.block_pool.get_num_free_blocks() == 199


def test_a_hit_is_what_every_group_can_resume_from():
    """A prefix hit of k blocks needs the full-attention group's blocks [0, k) and a window
    group's blocks its next token reads, [first_needed(k * block_size), k): blocks before those
    are the null block. Evicting a block cuts the hit to the longest such k."""
    kv = KVCacheManager(100, 4, sliding_windows=(0, 8), max_step_tokens=64)
    first = _req("a", list(range(40)))
    assert kv.allocate_slots(first, 40) is not None
    first.num_computed_tokens = 40
    kv.free(first)  # its blocks stay cached (in the free list)
    again = _req("b", list(range(40)) + [7, 7, 7, 7, 7])
    hits, num_hit = kv.get_computed_blocks(again)
    assert num_hit == 40  # (45 - 1) // 4 = 11 blocks wanted, 10 cached
    assert not any(b.is_null for b in hits[0]) and len(hits[0]) == len(hits[1]) == 10
    assert [b.is_null for b in hits[1]] == [True] * 8 + [False] * 2  # keys 33..39

    def evict(block) -> None:
        pool = kv.block_pool
        pool.free_block_queue.remove(block)
        del pool.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None
        pool.free_block_queue.append(block)

    evict(hits[1][9])  # the window group's last block: a hit of 9 blocks reads 7 and 8
    hits, num_hit = kv.get_computed_blocks(again)
    assert num_hit == 36 and [b.is_null for b in hits[1]] == [True] * 7 + [False] * 2
    evict(hits[0][5])  # the full group's block 5: at most 5 blocks, whose window is 3, 4
    hits, num_hit = kv.get_computed_blocks(again)
    assert num_hit == 20 and [b.is_null for b in hits[1]] == [True] * 3 + [False] * 2
    assert kv.allocate_slots(again, 25, num_hit, hits) is not None
    kv.check_integrity()


def test_capacity_is_counted_per_group():
    """Gemma 3 270M's groups: an 8k-token sequence holds 512 blocks in the global group and,
    with steps of 1024 tokens, at most 97 per local group; 33 once it decodes."""
    hybrid = KVCacheManager(10_000, 16, sliding_windows=(0,) + (512,) * 5, max_step_tokens=1024)
    assert hybrid.blocks_for_sequence(8192) == [512] + [97] * 5
    decoding = KVCacheManager(10_000, 16, sliding_windows=(0,) + (512,) * 5, max_step_tokens=1)
    assert sum(decoding.blocks_for_sequence(8192)) == 512 + 5 * 33
    full = KVCacheManager(10_000, 16, sliding_windows=(0,), max_step_tokens=1024)
    assert full.max_sequence_tokens(10**6) == 9999 * 16
    assert hybrid.max_sequence_tokens(10**6) == (9999 - 5 * 97) * 16


# --- the model ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """Six layers (four local with a window of 8, two global), head_dim 64, a tokenizer."""
    return make_tiny_model(str(tmp_path_factory.mktemp("gemma3") / "m"), "gemma3",
                           tokenizer=True, head_dim=64)


def _run_runner(path: str, prompts: list[list[int]], native: bool, **config) -> list:
    from engine_core import CacheConfig, Scheduler, SchedulerConfig
    runner = ModelRunner(EngineConfig(model=path, block_size=8, max_model_len=256,
                                      num_gpu_blocks_override=200, **config))
    if not native:
        runner.model.model.native_loop = False
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=24,
                                          max_model_len=256),
                          CacheConfig(8, runner.num_blocks, True,
                                      tuple(runner.sliding_windows) or (0,)))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    for i, prompt in enumerate(prompts):
        scheduler.add_request(Request(str(i), prompt, params))
    outs: dict[str, list] = {}
    while scheduler.has_unfinished_requests():
        so = scheduler.schedule()
        for out in scheduler.update_from_output(so, runner.execute_model(so)):
            outs.setdefault(out.request_id, []).append((out.new_token_ids, out.logprobs))
    if native:
        assert runner.model.model.native_loop, "the native loop should take int8 Gemma 3"
    return [outs[str(i)] for i in range(len(prompts))]


def test_native_layer_loop_equals_the_python_loop(tiny):
    """int8 weights (native): decode steps and short chunks through one native call give the
    Python loop's tokens and logprobs exactly, windows and groups included."""
    prompts = [list(range(3, 40)), [5] * 17, list(range(100, 103))]
    assert (_run_runner(tiny, prompts, True, quantization="int8")
            == _run_runner(tiny, prompts, False, quantization="int8"))


# --- the engine (slow) ----------------------------------------------------------------------

SHARED = "Pack my box with five dozen liquor jugs! The quick brown fox jumps. "
TEXTS = [SHARED + "def add(a, b):", "print('hello", SHARED + "return a + b", "The lazy dog",
         "x", SHARED * 2]
NEW = 12


def _engine(path: str, tp: int = 1, **args) -> LLM:
    # 8-token blocks, a 16-token budget chunks the prefills; 36 blocks (three groups share
    # them) force preemption.
    args = {"num_gpu_blocks_override": 36, **args}
    return LLM(path, tensor_parallel_size=tp, dtype="float32", block_size=8,
               max_num_batched_tokens=16, max_model_len=256, **args)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp", [1, 2])
def test_engine_matches_hf_past_the_window(tiny, tp, tmp_path, capfd):
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    journal = str(tmp_path / "run.journal")
    with _engine(tiny, tp, record_path=journal if tp == 1 else None) as llm:
        assert llm.engine.ready.sliding_windows == [0, 8, 8]
        err = capfd.readouterr().err  # the engine core's lines: bytes, and per group
        assert re.search(rf"36 KV blocks of 8 tokens, \S+ \w?i?B \(\S+ \w?i?B a block"
                         rf"{' over 2 ranks' if tp == 2 else ''}\)\n", err)
        assert re.search(r"sequence holds \[\d+, \d+, \d+\] blocks "
                         r"\((\S+ \w?i?B(, )?){3}\)\n", err)
        outs = llm.generate(TEXTS, params, use_tqdm=False)
        again = llm.generate(TEXTS[:3], params, use_tqdm=False)  # prefix hits
        stats = llm.engine.stats
    refs = hf_greedy(tiny, [o.prompt_token_ids for o in outs], NEW)
    assert_greedy_matches([o.outputs[0].token_ids for o in outs], refs)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids
                                                         for o in outs[:3]]
    assert max(o.num_cached_tokens for o in again) >= 16, "shared prefixes should hit"
    assert stats.num_preemptions > 0, "the cache was meant to be small enough to preempt"
    if tp == 1:
        assert replay.replay_workers(journal) == 0 and replay.replay_scheduler(journal) == 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_speculation_and_the_full_allocation_keep_the_tokens(tiny):
    """n-gram speculative decoding and `disable_hybrid_kv_cache_manager` (every layer's KV
    kept, the window applied by the kernels) give the hybrid manager's greedy tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    texts = [t * 3 for t in TEXTS]
    results = []
    for extra in ({}, {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                              "prompt_lookup_min": 1, "prompt_lookup_max": 3}},
                  {"disable_hybrid_kv_cache_manager": True, "num_gpu_blocks_override": 80}):
        args = {"num_gpu_blocks_override": 60, **extra}
        with _engine(tiny, **args) as llm:
            results.append([o.outputs[0].token_ids for o in llm.generate(
                texts, params, use_tqdm=False)])
    assert results[0] == results[1] == results[2]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(os.environ.get("DELTASERVE_SKIP_EMULATED") == "1", reason="asked to")
def test_emulated_cuda_kernels_honour_the_window(tiny, tmp_path, monkeypatch):
    from worker.emulator import EmulatorUnavailable, cuda_include_dir
    from worker.emulator.build import compiler
    try:
        compiler(), cuda_include_dir()
    except EmulatorUnavailable as e:
        pytest.skip(f"kernel emulator unavailable: {e}")
    monkeypatch.setenv("DELTASERVE_KEMU_CACHE", str(tmp_path / "kemu"))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(tiny, dtype="float32", attention_backend="emulated", block_size=16,
             max_num_batched_tokens=24, num_gpu_blocks_override=64, max_model_len=256) as llm:
        outs = llm.generate(TEXTS[-2:], params, use_tqdm=False)
    assert_greedy_matches([o.outputs[0].token_ids for o in outs],
                          hf_greedy(tiny, [o.prompt_token_ids for o in outs], 8))
