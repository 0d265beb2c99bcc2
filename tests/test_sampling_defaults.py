"""Request defaults from the model's generation_config.json, as vLLM applies them
(launch/processing/sampling_defaults.py): read with `--generation-config auto|vllm|DIR`,
logged at startup, applied to the server's bodies, `LLM` and `AsyncLLM` calls without
SamplingParams; a request's own values always win."""
from __future__ import annotations

import asyncio
import json
import logging
import os

import httpx
import pytest
from model_utils import make_tiny_model
from server_utils import CHAT_TEMPLATE

from launch import LLM, AsyncLLM, SamplingParams
from launch.entrypoints.openai.api_server import build_app
from launch.processing.chat_template import ChatTemplate
from launch.processing.sampling_defaults import load_sampling_defaults

GREEDY3 = {"temperature": 0.0, "max_new_tokens": 3}


def _dir_with(path, config: dict) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


def test_the_sampling_fields_vllm_takes(tmp_path, caplog):
    model = _dir_with(tmp_path / "m", {"temperature": 0.2, "top_p": 0.9, "top_k": 20,
                                       "min_p": 0.05, "repetition_penalty": 1.1,
                                       "max_new_tokens": 100, "do_sample": True,
                                       "eos_token_id": 2, "top_a": None})
    with caplog.at_level(logging.INFO, logger="deltaserve"):
        defaults = load_sampling_defaults(model)
    assert defaults == {"temperature": 0.2, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                        "repetition_penalty": 1.1, "max_tokens": 100}
    assert any("sampling defaults from" in r.message and "temperature=0.2" in r.message
               for r in caplog.records)
    assert load_sampling_defaults(model, "vllm") == {}
    other = _dir_with(tmp_path / "other", {"temperature": 0.7})
    assert load_sampling_defaults(model, other) == {"temperature": 0.7}
    assert load_sampling_defaults(str(tmp_path / "none")) == {}  # auto: no file, no defaults


def test_bad_generation_configs_are_refused(tmp_path):
    with pytest.raises(ValueError, match="no generation_config.json"):
        load_sampling_defaults(str(tmp_path), str(tmp_path / "missing"))
    bad = _dir_with(tmp_path / "bad", {"temperature": -1})
    with pytest.raises(ValueError, match="not valid"):
        load_sampling_defaults(bad)
    (tmp_path / "list").mkdir()
    (tmp_path / "list" / "generation_config.json").write_text("[1]")
    with pytest.raises(ValueError, match="not a JSON object"):
        load_sampling_defaults(str(tmp_path / "list"))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_model(str(tmp_path_factory.mktemp("defaults") / "tiny"), tokenizer=True)
    return _dir_with(path, GREEDY3)


@pytest.mark.slow
def test_llm_calls_without_params_get_the_models_defaults(model):
    prompt = "def add(a, b):"
    with LLM(model, max_model_len=256) as llm:
        assert llm.inputs.sampling_defaults == {"temperature": 0.0, "max_tokens": 3}
        (default,) = llm.generate(prompt, use_tqdm=False)
        (explicit,) = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=3),
                                   use_tqdm=False)
        (longer,) = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6,
                                                        min_tokens=6), use_tqdm=False)
    tokens = default.outputs[0].token_ids
    assert 1 <= len(tokens) <= 3 and tokens == explicit.outputs[0].token_ids
    assert len(longer.outputs[0].token_ids) == 6  # the request's own values win
    assert longer.outputs[0].token_ids[:len(tokens)] == tokens
    with LLM(model, max_model_len=256, generation_config="vllm") as llm:
        assert llm.inputs.sampling_defaults == {}


@pytest.mark.slow
def test_the_server_and_async_llm_apply_them_under_the_request(model):
    async def main():
        engine = AsyncLLM(model, max_model_len=256)
        try:
            outs = [out async for out in engine.generate("x", None, "no-params")]
            app = build_app(engine, "tiny", owns_engine=False,
                            chat_template=ChatTemplate(CHAT_TEMPLATE))
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                         base_url="http://t") as client:
                bodies = [{"prompt": "x", "min_tokens": 3},
                          {"prompt": "x", "min_tokens": 5, "max_tokens": 5},
                          {"prompt": "x", "min_tokens": 3, "max_tokens": 3,
                           "temperature": 0.0}]
                replies = [(await client.post("/v1/completions", json={"model": "tiny", **b}))
                           .json() for b in bodies]
                chat = (await client.post("/v1/chat/completions", json={
                    "model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                    "min_tokens": 3})).json()
            return outs[-1], replies, chat
        finally:
            engine.shutdown()
    final, (default, longer, explicit), chat = asyncio.run(main())
    assert 1 <= len(final.outputs[0].token_ids) <= 3
    assert default["usage"]["completion_tokens"] == 3  # max_new_tokens: 3
    assert longer["usage"]["completion_tokens"] == 5  # the body's max_tokens wins
    assert default["choices"][0]["text"] == explicit["choices"][0]["text"]  # greedy default
    assert chat["usage"]["completion_tokens"] == 3
