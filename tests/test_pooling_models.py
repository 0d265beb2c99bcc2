"""Pooling models in one process (the real scheduler and model runner): embeddings and
classifier outputs against transformers for the same checkpoints, chunked prefill, prefix
caching, preemption, and the resolution of --runner/--convert/--pooler-config."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from model_utils import make_tiny_model
from pooling_utils import (
    PoolingEngine,
    cosine,
    hf_classifier_logits,
    hf_hidden,
    hf_pooled,
    make_bare_decoder,
    make_classifier,
)

from engine_core import EngineCore
from protocol import AddRequest, EngineConfig, PoolerConfig, PoolingParams, SamplingParams
from protocol.pooler_config import resolve_runner
from protocol.scheduler_output import NewRequestData, SchedulerOutput
from worker.input_batch import StepProtocolError
from worker.pooling.pooler import Pooler, PoolerStateError

COSINE = 1 - 1e-5  # the issue asks for 1e-4; float32 against float32 does far better
PROMPTS = [[5, 9, 17, 33, 2, 8, 100, 41, 7, 3, 12, 60, 61, 62, 63, 64, 65, 66, 70, 71],
           [11, 12, 13], [200, 201, 202, 203, 204, 205, 206, 207, 208], [42]]


@pytest.fixture(scope="module")
def decoders(tmp_path_factory):
    return {arch: make_tiny_model(str(tmp_path_factory.mktemp(arch)), arch)
            for arch in ("llama", "qwen2", "qwen3")}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("pooling", ["LAST", "MEAN", "CLS"])
def test_embeddings_match_transformers(decoders, arch, pooling):
    """Each pooling, normalized and not, in one engine: chunks of 8 tokens (the 20-token
    prompt takes three steps), prefix caching on, against transformers' hidden states."""
    model = decoders[arch]
    engine = PoolingEngine(model, pooler_config={"pooling_type": pooling},
                           max_num_batched_tokens=8, enable_prefix_caching=True,
                           block_size=4)
    assert (engine.config.runner, engine.config.convert) == ("pooling", "embed")
    for normalize in (True, False):
        got = engine.vectors(PROMPTS, PoolingParams(task="embed", use_activation=normalize))
        for prompt, vector in zip(PROMPTS, got):
            want = hf_pooled(hf_hidden(model, prompt), pooling, normalize)
            assert vector.shape == want.shape
            assert cosine(vector, want) > COSINE
            assert np.abs(vector - want).max() < 1e-4 * max(1.0, np.abs(want).max())
            if normalize:
                assert abs(np.linalg.norm(vector) - 1) < 1e-5


def test_prefix_hits_are_read_by_last_pooling_only(decoders):
    model = decoders["llama"]
    prompt = list(range(3, 40))
    last = PoolingEngine(model, convert="embed", block_size=4, enable_prefix_caching=True)
    first, again = last.run([prompt])[0], last.run([prompt])[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 36
    assert cosine(np.frombuffer(again.pooling_output, "<f4"),
                  hf_pooled(hf_hidden(model, prompt), "LAST", True)) > COSINE
    mean = PoolingEngine(model, block_size=4, enable_prefix_caching=True,
                         pooler_config={"pooling_type": "MEAN"})
    mean.run([prompt])
    (repeat,) = mean.run([prompt])
    assert repeat.num_cached_tokens == 0  # every position recomputed
    assert cosine(np.frombuffer(repeat.pooling_output, "<f4"),
                  hf_pooled(hf_hidden(model, prompt), "MEAN", True)) > COSINE


def test_preempted_chunked_prompts_start_over(decoders):
    """A KV cache too small for all prompts at once: requests are preempted mid-prefill,
    recomputed from position 0, and still pool exactly."""
    model = decoders["qwen2"]
    prompts = [[(7 * i + j) % 250 + 1 for j in range(60)] for i in range(6)]
    engine = PoolingEngine(model, pooler_config={"pooling_type": "MEAN"}, block_size=4,
                           num_gpu_blocks_override=40, max_num_batched_tokens=48,
                           long_prefill_token_threshold=8)
    got = engine.vectors(prompts)
    assert engine.engine.scheduler.num_preemptions > 0
    for prompt, vector in zip(prompts, got):
        assert cosine(vector, hf_pooled(hf_hidden(model, prompt), "MEAN", True)) > COSINE


def test_per_token_embeddings(decoders):
    model = decoders["qwen3"]
    engine = PoolingEngine(model, convert="embed", max_num_batched_tokens=8)
    (out,) = engine.run([PROMPTS[0]], PoolingParams(task="token_embed"))
    rows = np.frombuffer(out.pooling_output, "<f4").reshape(len(PROMPTS[0]), -1)
    want = torch.nn.functional.normalize(hf_hidden(model, PROMPTS[0]), dim=-1).numpy()
    assert np.abs(rows - want).max() < 1e-5


@pytest.mark.parametrize("arch,labels", [("llama", 3), ("qwen3", 1), ("qwen2", 2)])
def test_classifier_head_matches_transformers(tmp_path, arch, labels):
    model = make_classifier(str(tmp_path), arch, labels)
    engine = PoolingEngine(model, max_num_batched_tokens=8)
    assert (engine.config.runner, engine.config.convert) == ("pooling", "classify")
    for activation in (False, True):
        got = engine.vectors(PROMPTS, PoolingParams(task="classify", use_activation=activation))
        for prompt, values in zip(PROMPTS, got):
            logits = torch.from_numpy(hf_classifier_logits(model, prompt))
            want = (logits if not activation else torch.sigmoid(logits) if labels == 1
                    else logits.softmax(-1)).numpy()
            assert values.shape == (labels,)
            assert np.abs(values - want).max() < 1e-5


def test_bare_decoder_with_sentence_transformers_config(tmp_path):
    """A `Qwen3Model` checkpoint (no `model.` prefix, no LM head) with modules.json saying
    MEAN pooling and Normalize: --runner/--convert/--pooler-config all resolve from it."""
    model = make_bare_decoder(str(tmp_path), "qwen3", pooling="MEAN")
    engine = PoolingEngine(model)
    assert engine.config.pooler_config == PoolerConfig(pooling_type="MEAN",
                                                       use_activation=True)
    got = engine.vectors(PROMPTS)
    for prompt, vector in zip(PROMPTS, got):
        assert cosine(vector, hf_pooled(hf_hidden(model, prompt), "MEAN", True)) > COSINE


def test_runner_resolution(tmp_path, decoders):
    causal, plain = decoders["llama"], resolve_runner
    assert plain(causal, "auto", "auto", None).runner == "generate"
    assert plain(causal, "auto", "embed", None).pooler_config == PoolerConfig(
        pooling_type="LAST", use_activation=True)
    assert plain(causal, "auto", "auto", PoolerConfig(normalize=False)).pooler_config == \
        PoolerConfig(pooling_type="LAST", use_activation=False)
    assert plain(causal, "pooling", "auto", None).convert == "embed"
    classifier = make_classifier(str(tmp_path / "cls"))
    assert plain(classifier, "auto", "auto", None).convert == "classify"
    st = make_bare_decoder(str(tmp_path / "st"), "llama", pooling="CLS", normalize=False)
    assert plain(st, "auto", "auto", None).pooler_config == PoolerConfig(
        pooling_type="CLS", use_activation=False)
    with pytest.raises(ValueError, match="--runner pooling"):
        plain(causal, "generate", "embed", None)
    with pytest.raises(ValueError, match="--convert embed or --convert classify"):
        plain(causal, "pooling", "none", None)
    with pytest.raises(ValueError, match="pooling_type must be one of"):
        PoolerConfig.parse('{"pooling_type": "MAX"}')
    with pytest.raises(ValueError, match="async_scheduling does not apply"):
        EngineConfig.create(model=causal, runner="pooling", async_scheduling=True)
    with pytest.raises(ValueError, match="unknown field"):
        PoolerConfig.parse({"pooling": "MEAN"})
    with open(os.path.join(st, "modules.json")) as f:
        modules = json.load(f)
    with open(os.path.join(st, "modules.json"), "w") as f:
        json.dump(modules + [{"idx": 3, "name": "3", "path": "3_Dense",
                              "type": "sentence_transformers.models.Dense"}], f)
    with pytest.raises(ValueError, match="models.Dense .* not supported"):
        plain(st, "auto", "auto", None)


def test_requests_of_the_other_runner_are_refused(decoders):
    model = decoders["llama"]
    pooling = PoolingEngine(model, convert="embed")
    (refused,) = pooling.engine.handle(AddRequest("g", [1, 2], SamplingParams(), 0.0))
    assert refused.finish_reason == "error" and "--runner pooling" in refused.error
    config = EngineConfig.create(model=model, num_gpu_blocks_override=64, max_model_len=128)
    generating = EngineCore.from_config(config.with_runner(), None, 64, 128, 256)
    (refused,) = generating.handle(AddRequest("p", [1, 2], SamplingParams(), 0.0,
                                              pooling_params=PoolingParams(task="embed")))
    assert refused.finish_reason == "error" and "--runner generate" in refused.error
    # A pooling prompt may fill max_model_len (a generating one must leave room).
    (full,) = pooling.run([[3] * 256])
    assert full.finish_reason == "stop"


def test_pooler_refuses_a_continuation_it_never_saw():
    pooler = Pooler("MEAN", None)
    hidden = torch.ones(4, 8)
    params = [PoolingParams(task="embed")]
    with pytest.raises(PoolerStateError, match="earlier chunks"):
        pooler(hidden, [3], np.array([4]), np.array([4]), np.array([8]), np.array([True]),
               params)


def test_a_generation_request_in_a_pooling_step_is_a_protocol_error(decoders):
    engine = PoolingEngine(decoders["llama"], convert="embed")
    new = NewRequestData(0, "x", [1, 2, 3], SamplingParams(), [1])
    with pytest.raises(StepProtocolError, match="without pooling parameters"):
        engine.runner.execute_model(SchedulerOutput([new], num_scheduled_tokens={0: 3},
                                                    total_num_scheduled_tokens=3, step=1))


def test_matryoshka_config_is_read(tmp_path):
    from launch.processing.pooling import PoolingModelInfo
    model = make_tiny_model(str(tmp_path), "llama")
    with open(os.path.join(model, "config.json")) as f:
        hf = json.load(f)
    hf["matryoshka_dimensions"] = [16, 32, 64]
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(hf, f)
    info = PoolingModelInfo.of(EngineConfig(model=model, convert="embed").with_runner())
    assert info.resolve(PoolingParams(dimensions=32)).dimensions == 32
    with pytest.raises(ValueError, match=r"one of \[16, 32, 64\]"):
        info.resolve(PoolingParams(dimensions=20))
    with pytest.raises(ValueError, match="not supported by this model"):
        info.resolve(None, "classify")


@pytest.mark.parametrize("caching", [False, True])
def test_no_kv_is_kept_after_the_step(decoders, caching):
    """A pooling request finishes in the step that runs its prompt and frees its blocks then;
    only prefix caching keeps their (hashed, evictable) contents."""
    engine = PoolingEngine(decoders["llama"], convert="embed", block_size=4,
                           enable_prefix_caching=caching)
    pool = engine.engine.scheduler.kv_cache_manager.block_pool
    free = pool.get_num_free_blocks()
    for i, prompt in enumerate(PROMPTS):
        engine.engine.handle(AddRequest(f"k{i}", prompt, SamplingParams(max_tokens=1), 0.0,
                                        pooling_params=PoolingParams(task="embed")))
    finished = [out for out in engine.engine.step()[1] if out.finished]
    assert len(finished) == len(PROMPTS) and not engine.engine.has_work()
    assert pool.get_num_free_blocks() == free
    assert bool(pool.cached_block_hash_to_block) == caching
    engine.engine.scheduler.check_integrity()


def test_truncated_dimensions_are_normalized_after_truncation(decoders):
    """Matryoshka `dimensions`: the first d features of the pooled state, then normalized."""
    model = decoders["qwen3"]
    engine = PoolingEngine(model, convert="embed")
    for normalize in (True, False):
        (got,) = engine.vectors([PROMPTS[0]], PoolingParams(task="embed", dimensions=16,
                                                            use_activation=normalize))
        want = hf_pooled(hf_hidden(model, PROMPTS[0])[:, :16], "LAST", normalize)
        assert got.shape == (16,) and np.abs(got - want).max() < 1e-5


def test_last_pooling_runs_the_last_layer_on_pooled_rows_only(decoders):
    """With LAST pooling the model returns only each finishing prompt's last row (the last
    layer's MLP runs on those alone); a per-token request in the step makes it return every
    row. Either way the vectors are transformers'."""
    model = decoders["qwen3"]
    engine = PoolingEngine(model, convert="embed")
    asked = []
    forward = engine.runner.model.forward

    def spy(*args, out_rows=None):
        asked.append(None if out_rows is None else out_rows.tolist())
        return forward(*args, out_rows=out_rows)

    engine.runner.model.forward = spy
    got = engine.vectors(PROMPTS)
    assert asked == [[19, 22, 31, 32]]  # one step; each prompt's last token row
    for prompt, vector in zip(PROMPTS, got):
        assert cosine(vector, hf_pooled(hf_hidden(model, prompt), "LAST", True)) > COSINE
    asked.clear()
    for name, params in (("a", PoolingParams(task="token_embed")),
                         ("b", PoolingParams(task="embed"))):
        assert engine.engine.handle(AddRequest(name, PROMPTS[2], SamplingParams(max_tokens=1),
                                               1.0, pooling_params=params)) == []
    outs = {out.request_id: out for out in engine.engine.step()[1]}
    assert asked == [None]
    want = hf_hidden(model, PROMPTS[2])
    rows = np.frombuffer(outs["a"].pooling_output, "<f4").reshape(len(PROMPTS[2]), -1)
    assert np.abs(rows - torch.nn.functional.normalize(want, dim=-1).numpy()).max() < 1e-5
    assert cosine(np.frombuffer(outs["b"].pooling_output, "<f4"),
                  hf_pooled(want, "LAST", True)) > COSINE
