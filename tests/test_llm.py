"""The multi-process engine through `LLM`: greedy tokens equal Hugging Face, at TP=1 and TP=2."""
from __future__ import annotations

import os

import pytest
from engine_utils import engine_pids, wait_gone
from model_utils import assert_greedy_matches, hf_greedy, make_tiny_model

from launch import LLM, SamplingParams

pytestmark = pytest.mark.slow  # real engine processes

SHARED = "Pack my box with five dozen liquor jugs! The quick brown fox jumps. "
TEXTS = [SHARED + "def add(a, b):", "print('hello", SHARED + "return a + b", "The lazy dog",
         "x", SHARED * 2]
TOKEN_PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11]}, {"prompt_token_ids": [42]}]
NEW = 12


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny(request, tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp(request.param) / "m"), request.param,
                           tokenizer=True)


def _engine(path: str, tp: int, **engine_args) -> LLM:
    # A small token budget chunks the prefills; 20 blocks of 8 tokens force preemption.
    return LLM(path, tensor_parallel_size=tp, dtype="float32", block_size=8,
               max_num_batched_tokens=16, num_gpu_blocks_override=20, max_model_len=256,
               **engine_args)


@pytest.fixture(scope="module")
def llm(tiny):
    """One TP=1 engine per architecture, shared by the tests below."""
    with _engine(tiny, 1) as llm:
        yield llm


@pytest.mark.parametrize("tp,async_scheduling", [(1, False), (2, False), (2, True)],
                         ids=["tp1", "tp2", "tp2-async"])
def test_greedy_matches_hf(tiny, tp, async_scheduling):
    with _engine(tiny, tp, async_scheduling=async_scheduling) as llm:
        pids = engine_pids(llm)
        assert len(pids) == 1 + tp
        outs = llm.generate(TEXTS + TOKEN_PROMPTS,
                            SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True),
                            use_tqdm=False)
        stats = llm.engine.stats
        tokenizer = llm.tokenizer
    assert not wait_gone(pids, 5.0)
    assert [o.prompt for o in outs] == TEXTS + [None, None]
    assert outs[0].prompt_token_ids == tokenizer.encode(TEXTS[0])
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    refs = hf_greedy(tiny, [o.prompt_token_ids for o in outs], NEW)
    assert_greedy_matches([o.outputs[0].token_ids for o in outs], refs)
    for o in outs:
        assert o.outputs[0].text == tokenizer.decode(o.outputs[0].token_ids)
    assert stats.num_preemptions > 0, "the cache was meant to be small enough to preempt"
    assert max(o.num_cached_tokens for o in outs) >= 32, "shared prefixes should hit"


def test_stop_strings_end_the_request_in_the_engine(llm):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    (free,) = llm.generate("def add(a, b):", params, use_tqdm=False)
    text = free.outputs[0].text
    stop = text[len(text) // 3:len(text) // 3 + 2]
    assert stop.strip(), f"pick a visible stop string from {text!r}"
    cut = text.index(stop)
    (kept, dropped) = llm.generate(
        ["def add(a, b):"] * 2,
        [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop],
                        include_stop_str_in_output=True),
         SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=stop)],
        use_tqdm=False)
    llm.generate("x", SamplingParams(max_tokens=1), use_tqdm=False)  # after the aborts
    stats = llm.engine.stats
    assert dropped.outputs[0].text == text[:cut]
    assert kept.outputs[0].text == text[:cut + len(stop)]
    for out in (kept, dropped):
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
        assert len(out.outputs[0].token_ids) < 40
    assert stats.num_running == 0 and stats.num_waiting == 0  # aborted in the engine


def test_eos_and_sampling_options(llm):
    params = SamplingParams(temperature=0.0, max_tokens=30)
    eos = llm.stop_token_ids[0]
    (out,) = llm.generate({"prompt_token_ids": [3, 4, 5]}, params, use_tqdm=False)
    if eos in out.outputs[0].token_ids:
        assert out.outputs[0].finish_reason == "stop"
        assert out.outputs[0].token_ids[-1] == eos
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=10, n=3, logprobs=2)
    a, = llm.generate("The lazy dog", seeded, use_tqdm=False)
    b, = llm.generate("The lazy dog", seeded, use_tqdm=False)
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len(a.outputs) == 3 and [c.index for c in a.outputs] == [0, 1, 2]
    lp = a.outputs[0].logprobs
    assert len(lp) == len(a.outputs[0].token_ids)
    first = lp[0][a.outputs[0].token_ids[0]]
    assert first.logprob <= 0 and first.rank >= 1 and first.decoded_token is not None


def test_bad_requests_raise_before_scheduling_and_the_rest_still_run(llm):
    params = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(ValueError, match="max_model_len=256"):
        llm.generate(["ok", {"prompt_token_ids": [1] * 300}], params, use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": [10**6]}, params, use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        llm.generate("ok", SamplingParams(temperature=-1.0), use_tqdm=False)
    with pytest.raises(ValueError, match="KV cache"):
        llm.generate({"prompt_token_ids": [1] * 200}, params, use_tqdm=False)
    outs = llm.generate(["ok", "fine"], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)


def test_two_engines_at_once_do_not_collide(tiny, llm):
    a = llm
    with _engine(tiny, 1) as b:
        assert a.engine.runtime_dir != b.engine.runtime_dir
        assert oct(os.stat(a.engine.runtime_dir).st_mode & 0o777) == "0o700"
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        out_a = a.generate("def add", params, use_tqdm=False)
        out_b = b.generate("def add", params, use_tqdm=False)
    assert out_a[0].outputs[0].token_ids == out_b[0].outputs[0].token_ids


def test_tp2_with_an_odd_number_of_kv_heads_matches_hf(tmp_path):
    """3 KV heads over 2 ranks: whole GQA groups per rank (2 + 1), as SmolLM2 needs."""
    path = make_tiny_model(str(tmp_path / "m"), "llama", num_attention_heads=6,
                           num_key_value_heads=3, hidden_size=96)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": list(range(40, 70))}]
    with LLM(path, tensor_parallel_size=2, dtype="float32", max_model_len=128) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW,
                                                    ignore_eos=True), use_tqdm=False)
    refs = hf_greedy(path, [p["prompt_token_ids"] for p in prompts], NEW)
    assert_greedy_matches([o.outputs[0].token_ids for o in outs], refs)
