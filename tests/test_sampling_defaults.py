"""Request defaults from the model's generation_config.json, as vLLM applies them
(launch/processing/sampling_defaults.py): read with `--generation-config auto|vllm|DIR`,
logged at startup, applied to the server's bodies, `LLM` and `AsyncLLM` calls without
SamplingParams; a request's own values always win."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys

import httpx
import msgspec
import pytest
from model_utils import make_tiny_model
from server_utils import CHAT_TEMPLATE

from launch import LLM, AsyncLLM, SamplingParams
from launch.entrypoints.openai.api_server import build_app
from launch.entrypoints.openai.errors import APIError
from launch.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    sampling_params,
)
from launch.processing.chat_template import ChatTemplate
from launch.processing.input_processor import per_prompt
from launch.processing.sampling_defaults import load_sampling_defaults

GREEDY3 = {"temperature": 0.0, "max_new_tokens": 3}
SMOLLM2 = {"temperature": 0.2, "top_p": 0.9}  # its card's recommended values


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


def test_a_cards_values_become_the_default_sampling_params(tmp_path):
    defaults = load_sampling_defaults(_dir_with(tmp_path / "card", {**SMOLLM2,
                                                                    "bos_token_id": 1}))
    assert defaults == SMOLLM2
    (params,) = per_prompt(None, 1, defaults)  # LLM.generate/chat without SamplingParams
    assert (params.temperature, params.top_p, params.top_k) == (0.2, 0.9, 0)
    given = SamplingParams(temperature=1.0)
    assert per_prompt(given, 2, defaults) == [given, given]  # the caller's own params win


def _completion(**fields) -> CompletionRequest:
    return msgspec.json.decode(msgspec.json.encode({"prompt": "x", **fields}),
                               type=CompletionRequest)


def test_a_bodys_values_win_over_the_models_over_the_routes():
    """What a body sets wins; what it leaves out or sends as null takes the model's
    generation_config value; what neither sets takes the route's default."""
    route = {"max_tokens": 16}
    left_out = sampling_params(_completion(), route, model_defaults=SMOLLM2)
    assert (left_out.temperature, left_out.top_p, left_out.max_tokens) == (0.2, 0.9, 16)
    nulls = sampling_params(_completion(temperature=None, top_p=None), route,
                            model_defaults=SMOLLM2)
    assert (nulls.temperature, nulls.top_p) == (0.2, 0.9)
    own = sampling_params(_completion(temperature=1.0, top_p=1.0, max_tokens=5), route,
                          model_defaults={**SMOLLM2, "max_tokens": 100})
    assert (own.temperature, own.top_p, own.max_tokens) == (1.0, 1.0, 5)
    assert sampling_params(_completion(), route,
                           model_defaults={"max_tokens": 100}).max_tokens == 100
    none = sampling_params(_completion(), route)  # --generation-config vllm
    assert (none.temperature, none.top_p) == (1.0, 1.0)
    chat = msgspec.json.decode(b'{"messages": [{"role": "user", "content": "hi"}], '
                               b'"temperature": 0}', type=ChatCompletionRequest)
    greedy = sampling_params(chat, route, model_defaults=SMOLLM2)
    assert (greedy.temperature, greedy.top_p) == (0.0, 0.9)
    with pytest.raises(APIError, match="temperature"):  # a bad body value is still refused
        sampling_params(_completion(temperature=-1), route, model_defaults=SMOLLM2)


def test_a_bad_generation_config_fails_before_the_engine_starts(model, tmp_path):
    with pytest.raises(ValueError, match="no generation_config.json"):
        LLM(model, generation_config=str(tmp_path / "missing"))
    bad = _dir_with(tmp_path / "bad", {"top_p": 2.0})
    with pytest.raises(ValueError, match="not valid"):
        LLM(model, generation_config=bad)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_model(str(tmp_path_factory.mktemp("defaults") / "tiny"), tokenizer=True)
    return _dir_with(path, GREEDY3)


@pytest.mark.slow
def test_llm_calls_without_params_get_the_models_defaults(model, caplog):
    prompt = "def add(a, b):"
    with caplog.at_level(logging.INFO, logger="deltaserve"), \
            LLM(model, max_model_len=256) as llm:
        assert llm.inputs.sampling_defaults == {"temperature": 0.0, "max_tokens": 3}
        assert any(r.message.startswith("sampling defaults from") for r in caplog.records)
        (chat,) = llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False,
                           chat_template=CHAT_TEMPLATE)
        assert 1 <= len(chat.outputs[0].token_ids) <= 3
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


def _generate(model: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch", "generate", "--model", model,
                           "--prompt", "x", "--ignore-eos", "--max-model-len", "256",
                           "--num-gpu-blocks-override", "32", *flags],
                          capture_output=True, text=True, timeout=180)


@pytest.mark.slow
def test_deltaserve_generate_logs_them_and_its_flags_win(model):
    """The startup line is on stderr (the front-end's log, as the engine's); flags left out
    take the model's values, flags given win, --generation-config vllm ignores the file."""
    default = _generate(model)
    assert default.returncode == 0, default.stderr
    assert "sampling defaults from" in default.stderr
    assert "temperature=0.0, max_tokens=3" in default.stderr
    assert "[3 tokens in" in default.stderr
    flag = _generate(model, "--max-tokens", "5")
    assert flag.returncode == 0, flag.stderr
    assert "[5 tokens in" in flag.stderr
    vllm = _generate(model, "--generation-config", "vllm")
    assert vllm.returncode == 0, vllm.stderr
    assert "sampling defaults from" not in vllm.stderr
    assert "[64 tokens in" in vllm.stderr  # deltaserve generate's own default
