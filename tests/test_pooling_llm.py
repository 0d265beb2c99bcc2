"""Pooling through the offline `LLM` (real processes): embed, encode, classify and score
against transformers, the front-end's checks, runner refusals, and record/replay."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from model_utils import make_tiny_model
from pooling_utils import cosine, hf_classifier_logits, hf_hidden, hf_pooled, make_classifier

from launch import LLM, PoolingParams
from launch.processing.tokenizer import JsonTokenizer
from replay import replay

TEXTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b",
         "print('hello, world')", "Pack my box with five dozen liquor jugs!"]
COSINE = 1 - 1e-5


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    model = make_tiny_model(str(tmp_path_factory.mktemp("embedder")), "qwen2", tokenizer=True)
    journal = str(tmp_path_factory.mktemp("journal") / "run.journal")
    llm = LLM(model, runner="pooling", pooler_config={"pooling_type": "MEAN"},
              max_model_len=64, max_num_batched_tokens=16, record_path=journal)
    yield model, llm, journal
    llm.shutdown()


def test_embed_matches_transformers(embedder):
    model, llm, _ = embedder
    outs = llm.embed(TEXTS, use_tqdm=False)
    assert llm.config.runner == "pooling" and llm.config.convert == "embed"
    for text, out in zip(TEXTS, outs):
        assert out.prompt == text and out.finished and out.error is None
        want = hf_pooled(hf_hidden(model, out.prompt_token_ids), "MEAN", True)
        assert cosine(np.array(out.outputs.embedding), want) > COSINE
    raw = llm.embed(TEXTS[0], pooling_params=PoolingParams(use_activation=False),
                    use_tqdm=False)[0]
    want = hf_pooled(hf_hidden(model, raw.prompt_token_ids), "MEAN", False)
    assert np.abs(np.array(raw.outputs.embedding) - want).max() < 1e-5


def test_encode_score_and_truncation(embedder):
    model, llm, _ = embedder
    (tokens,) = llm.encode([{"prompt_token_ids": [5, 6, 7, 8, 9]}], pooling_task="token_embed",
                           use_tqdm=False)
    assert tokens.outputs.data.shape == (5, 64)
    want = torch.nn.functional.normalize(hf_hidden(model, [5, 6, 7, 8, 9]), dim=-1).numpy()
    assert np.abs(tokens.outputs.data - want).max() < 1e-5
    scores = llm.score(TEXTS[0], TEXTS, use_tqdm=False)
    vectors = [np.array(o.outputs.embedding) for o in llm.embed(TEXTS, use_tqdm=False)]
    assert [round(s.outputs.score, 5) for s in scores] == \
        [round(cosine(vectors[0], v), 5) for v in vectors]
    (cut,) = llm.embed(TEXTS[0], truncate_prompt_tokens=3, use_tqdm=False)
    (full,) = llm.embed(TEXTS[0], use_tqdm=False)
    assert cut.prompt_token_ids == full.prompt_token_ids[:3]


def test_refusals_name_the_field_or_the_runner(embedder):
    _, llm, _ = embedder
    with pytest.raises(ValueError, match="--runner pooling"):
        llm.generate("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions must be unset"):
        llm.embed("hi", pooling_params=PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match="not supported by this model"):
        llm.classify("hi", use_tqdm=False)
    with pytest.raises(ValueError, match="more than max_model_len=64"):
        llm.embed({"prompt_token_ids": [3] * 65}, use_tqdm=False)
    with pytest.raises(ValueError, match="text_1 must hold one text or as many"):
        llm.score(["a", "b"], ["c", "d", "e"], use_tqdm=False)
    assert len(llm.embed({"prompt_token_ids": [3] * 64}, use_tqdm=False)[0]
               .outputs.embedding) == 64  # a pooling prompt may fill max_model_len


def test_prompts_are_tokenized_in_one_batch_as_one_by_one(embedder):
    """`embed` tokenizes its texts in one tokenizer call: the ids are each text's own, in
    order among token-id prompts, and a bad prompt anywhere is refused before any is sent."""
    _, llm, _ = embedder
    assert isinstance(llm.tokenizer, JsonTokenizer)
    mixed = [TEXTS[0], {"prompt_token_ids": [5, 6, 7]}, *TEXTS[1:]]
    outs = llm.embed(mixed, use_tqdm=False)
    assert outs[1].prompt_token_ids == [5, 6, 7] and outs[1].prompt is None
    for text, out in zip(TEXTS, outs[:1] + outs[2:]):
        assert out.prompt == text
        assert out.prompt_token_ids == llm.tokenizer.encode(text)
    with pytest.raises(ValueError, match="a prompt must be a string or a dict"):
        llm.embed([TEXTS[0], 7], use_tqdm=False)
    with pytest.raises(ValueError, match="characters, more than max_model_len"):
        llm.embed([TEXTS[0], "x" * 100_000], use_tqdm=False)
    (cut, _) = llm.embed([TEXTS[0], TEXTS[1]], truncate_prompt_tokens=3, use_tqdm=False)
    assert cut.prompt_token_ids == llm.tokenizer.encode(TEXTS[0])[:3]


def test_a_recorded_pooling_run_replays(embedder, capsys):
    _, llm, journal = embedder
    llm.embed(TEXTS, use_tqdm=False)
    llm.shutdown()  # closes the journal
    assert replay.replay_workers(journal) == 0
    assert replay.replay_scheduler(journal) == 0
    assert "steps match" in capsys.readouterr().out


def test_cross_encoder_scores_and_classify(tmp_path):
    from transformers import AutoTokenizer
    model = make_classifier(str(tmp_path), "qwen3", num_labels=1, tokenizer=True)
    tokenizer = AutoTokenizer.from_pretrained(model)
    with LLM(model, max_model_len=128) as llm:
        assert llm.config.convert == "classify"
        scores = llm.score("What is the capital of France?", TEXTS, use_tqdm=False)
        for text, out in zip(TEXTS, scores):
            ids = tokenizer(text="What is the capital of France?", text_pair=text)["input_ids"]
            assert out.prompt_token_ids == ids
            want = torch.sigmoid(torch.from_numpy(hf_classifier_logits(model, ids))).item()
            assert abs(out.outputs.score - want) < 1e-5
        probs = llm.classify(TEXTS, use_tqdm=False)
        assert all(len(p.outputs.probs) == 1 for p in probs)
        with pytest.raises(ValueError, match="--runner pooling"):
            llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)


@pytest.mark.slow
def test_tensor_parallel_embeddings(tmp_path):
    model = make_tiny_model(str(tmp_path), "llama", tokenizer=True)
    with LLM(model, runner="pooling", tensor_parallel_size=2, max_model_len=64) as llm:
        outs = llm.embed(TEXTS, use_tqdm=False)
    for out in outs:
        want = hf_pooled(hf_hidden(model, out.prompt_token_ids), "LAST", True)
        assert cosine(np.array(out.outputs.embedding), want) > COSINE

