"""`deltaserve serve` through real HTTP on loopback: the official `openai` client (sync, async,
streaming) and raw httpx for errors and disconnects; results against `LLM.generate`."""
from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import httpx
import openai
import pytest
from model_utils import make_tiny_model
from server_utils import CHAT_TEMPLATE, Server, render_chat

from launch import LLM, SamplingParams

pytestmark = pytest.mark.slow
KEY = "sk-test-key"
ENGINE = ["--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "128"]
PROMPTS = ["def add(a, b):", "The quick brown fox", "print('hello", "Pack my box with"]
GREEDY = dict(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = make_tiny_model(str(tmp_path_factory.mktemp("serve") / "tiny"), tokenizer=True,
                           max_position_embeddings=1024)
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(model):
    srv = Server(model, "--served-model-name", "tiny", *ENGINE, api_key=KEY)
    yield srv
    assert srv.stop() == 0, srv.output()


@pytest.fixture(scope="module")
def llm(model):
    with LLM(model, dtype="float32", max_model_len=1024) as llm:
        yield llm


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def _post(server: Server, path: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers=server.headers,
                      timeout=60.0, **kw)


def _reference(llm: LLM, prompts: list, **params) -> list:
    return [o.outputs[0] for o in llm.generate(prompts, SamplingParams(**params),
                                               use_tqdm=False)]


def test_routes_and_api_key(server):
    models = httpx.get(server.url + "/v1/models", headers=server.headers).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert models["data"][0]["quantization"].startswith("none (")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(server.url + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200  # not a /v1 route
    assert httpx.get(server.url + "/version").json()["version"]
    tokens = _post(server, "/tokenize", {"prompt": PROMPTS[0]}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 1024
    back = _post(server, "/detokenize", {"tokens": tokens["tokens"]}).json()
    assert back["prompt"] == PROMPTS[0]


def test_greedy_completions_equal_llm(server, client, llm):
    ref = _reference(llm, PROMPTS, **GREEDY)
    out = client.completions.create(model="tiny", prompt=PROMPTS, temperature=0.0,
                                    max_tokens=24, extra_body={"ignore_eos": True,
                                                               "return_token_ids": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.token_ids for c in out.choices] == [r.token_ids for r in ref]
    assert [c.text for c in out.choices] == [r.text for r in ref]
    assert all(c.finish_reason == "length" for c in out.choices)
    prompt_tokens = sum(len(llm.tokenizer.encode(p)) for p in PROMPTS)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (prompt_tokens, 4 * 24)


def test_prompt_forms_n_echo_and_logprobs(server, client, llm):
    ids = llm.tokenizer.encode(PROMPTS[0])
    text = client.completions.create(model="tiny", prompt=PROMPTS[0], **GREEDY_ARGS)
    for prompt in (ids, [ids, ids]):
        out = client.completions.create(model="tiny", prompt=prompt, **GREEDY_ARGS)
        assert all(c.text == text.choices[0].text for c in out.choices)
    out = client.completions.create(model="tiny", prompt=PROMPTS[:2], n=3, seed=7,
                                    max_tokens=5, temperature=1.0)
    assert sorted(c.index for c in out.choices) == list(range(6))
    assert out.usage.completion_tokens == sum(1 for _ in out.choices) * 5 or all(
        c.finish_reason == "stop" for c in out.choices if c.finish_reason != "length")
    echo = client.completions.create(model="tiny", prompt=PROMPTS[0], echo=True, **GREEDY_ARGS)
    assert echo.choices[0].text == PROMPTS[0] + text.choices[0].text
    lp = client.completions.create(model="tiny", prompt=PROMPTS[0], logprobs=2, **GREEDY_ARGS)
    logprobs = lp.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 24
    assert "".join(logprobs.tokens) == lp.choices[0].text
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)


GREEDY_ARGS = dict(temperature=0.0, max_tokens=24, extra_body={"ignore_eos": True})


def test_streamed_text_equals_non_streamed(server, client):
    whole = client.completions.create(model="tiny", prompt=PROMPTS, **GREEDY_ARGS)
    stop = whole.choices[0].text[8:10]
    for extra in ({}, {"stop": [stop]}):
        whole = client.completions.create(model="tiny", prompt=PROMPTS, **GREEDY_ARGS, **extra)
        texts, finish, usage = ["", "", "", ""], [None] * 4, None
        for chunk in client.completions.create(model="tiny", prompt=PROMPTS, stream=True,
                                               stream_options={"include_usage": True},
                                               **GREEDY_ARGS, **extra):
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                assert finish[c.index] is None, "text after the last chunk"
                texts[c.index] += c.text
                finish[c.index] = c.finish_reason
        assert texts == [c.text for c in whole.choices]
        assert finish == [c.finish_reason for c in whole.choices]
        assert usage.completion_tokens == whole.usage.completion_tokens
    assert whole.choices[0].finish_reason == "stop"


def test_chat_uses_the_template(server, client, llm):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    rendered = llm.tokenizer.encode(render_chat(messages))
    (ref,) = _reference(llm, [{"prompt_token_ids": rendered}], **GREEDY)
    tokens = _post(server, "/tokenize", {"messages": messages}).json()["tokens"]
    assert tokens == rendered
    out = client.chat.completions.create(model="tiny", messages=messages, logprobs=True,
                                         top_logprobs=2, **GREEDY_ARGS)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text
    assert out.usage.prompt_tokens == len(rendered)
    content = out.choices[0].logprobs.content
    assert len(content) == 24 and all(len(c.top_logprobs) == 2 for c in content)
    deltas = list(client.chat.completions.create(model="tiny", messages=messages, stream=True,
                                                 **GREEDY_ARGS))
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(d.choices[0].delta.content or "" for d in deltas) == ref.text
    assert deltas[-1].choices[0].finish_reason == "length"


def test_128_concurrent_streams(server, client):
    expected = [c.text for c in client.completions.create(
        model="tiny", prompt=PROMPTS, temperature=0.0, max_tokens=16).choices]

    async def one(aclient, i):
        text, finish = "", None
        stream = await aclient.completions.create(model="tiny", prompt=PROMPTS[i % 4],
                                                  temperature=0.0, max_tokens=16, stream=True)
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY,
                                      max_retries=0, timeout=120.0) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(128)))
    results = asyncio.run(all_of_them())
    assert [t for t, _ in results] == [expected[i % 4] for i in range(128)]
    assert all(f in ("length", "stop") for _, f in results)


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "n": 1000}, "n"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "top_p": "high"}, "top_p"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[1, 2], "x"]}, "prompt"),
    ({"prompt": [1, 2, 10 ** 6]}, None),
    ({"prompt": "x " * 2000}, None),
    ({"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    ({"messages": []}, None),
])
def test_bad_requests_are_400(server, body, param):
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param, error


def test_error_shapes(server):
    r = _post(server, "/v1/completions", {"prompt": "x", "model": "gpt-4"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    with pytest.raises(Exception):
        SamplingParams(temperature=-1)
    r = _post(server, "/v1/completions", {"prompt": "x", "temperature": -1})
    assert r.json()["error"]["message"] == "temperature must be non-negative, got -1"
    assert _post(server, "/v1/completions", b"{not json").status_code == 400
    assert _post(server, "/v1/completions", b"[1, 2]").status_code == 400
    deep = b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}"
    assert _post(server, "/v1/completions", deep).status_code == 400
    assert _post(server, "/v1/completions", b"x" * (17 << 20)).status_code == 413
    ok = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "unknown": [1]})
    assert ok.status_code == 200  # unknown fields are ignored, as OpenAI's API does
    r = _post(server, "/detokenize", {"tokens": [-1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_bad_requests_do_not_disturb_a_stream(server, client):
    (expected,) = [c.text for c in client.completions.create(
        model="tiny", prompt=PROMPTS[0], temperature=0.0, max_tokens=200,
        extra_body={"ignore_eos": True}).choices]
    text = ""
    stream = client.completions.create(model="tiny", prompt=PROMPTS[0], temperature=0.0,
                                       max_tokens=200, stream=True,
                                       extra_body={"ignore_eos": True})
    for i, chunk in enumerate(stream):
        text += chunk.choices[0].text
        if i < 3:
            assert _post(server, "/v1/completions", {"prompt": "x", "top_k": -5}).status_code \
                == 400
    assert text == expected


def _wait_idle(server: Server, timeout_s: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        if m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.05)


def test_disconnects_abort_and_free_blocks(server):
    before = _wait_idle(server)['vllm:request_success_total{finished_reason="abort"}']
    body = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body,
                      headers=server.headers, timeout=30.0) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
        assert server.metrics()["vllm:num_requests_running"] == 1
    body["stream"] = False
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers=server.headers,
                   timeout=0.5)
    m = _wait_idle(server)
    assert m['vllm:request_success_total{finished_reason="abort"}'] == before + 2


def test_metrics(server):
    assert _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 3}).status_code == 200
    m = server.metrics()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total"):
        assert name in m
    assert m["vllm:prompt_tokens_total"] > 0 and m["vllm:generation_tokens_total"] > 0
    assert m['vllm:request_success_total{finished_reason="length"}'] > 0
    for name in ("time_to_first_token", "inter_token_latency", "e2e_request_latency",
                 "request_queue_time"):
        assert m[f"vllm:{name}_seconds_count"] > 0, name
    text = httpx.get(server.url + "/metrics").text
    assert 'vllm:num_requests_running{engine="0",model_name="tiny"}' in text


def test_llm_generate_from_two_threads(llm):
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    results: dict[int, list] = {}

    def run(i: int) -> None:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        results[i] = [o.outputs[0].token_ids for o in outs]
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {0: expected, 1: expected}


def test_bench_serve_against_the_server(server, tmp_path, capsys):
    from launch.cli.main import main
    out = tmp_path / "result.json"
    assert main(["bench", "serve", "--base-url", server.url, "--num-prompts", "8",
                 "--random-input-len", "16", "--random-output-len", "8", "--max-concurrency",
                 "4", "--request-rate", "50", "--api-key", KEY, "--result-json", str(out),
                 "--disable-tqdm"]) == 0
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"]) == (8, 0)
    assert result["total_output_tokens"] == 64 and result["total_input_tokens"] == 128
    for key in ("request_throughput", "output_throughput", "median_ttft_ms", "p99_tpot_ms",
                "mean_itl_ms"):
        assert result[key] > 0, key
    assert "Output token throughput (tok/s):" in capsys.readouterr().out
