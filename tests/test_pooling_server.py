"""The pooling routes through a real `deltaserve serve --runner pooling`: the official
openai SDK's `embeddings.create`, LangChain's `OpenAIEmbeddings`, rerank and score, vLLM's
/pooling and /classify, and the front door (API key, limits, metrics, runner refusals)."""
from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
from model_utils import make_tiny_model
from pooling_utils import cosine, hf_hidden, hf_pooled
from server_utils import CHAT_TEMPLATE, Server

KEY = "pooling-test-key"
TEXTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b",
         "print('hello, world')"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = make_tiny_model(str(tmp_path_factory.mktemp("embedder")), "llama", tokenizer=True)
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    server = Server(model, "--runner", "pooling", "--pooler-config",
                    '{"pooling_type": "MEAN"}', "--max-model-len", "64",
                    "--served-model-name", "tiny-embed", "--chat-template", str(template),
                    api_key=KEY)
    yield model, server
    server.stop()


def _post(server: Server, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=server.headers, timeout=30,
                      **kwargs)


def test_openai_sdk_embeddings(served):
    import openai
    model, server = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY)
    default = client.embeddings.create(model="tiny-embed", input=TEXTS)  # base64 on the wire
    floats = client.embeddings.create(model="tiny-embed", input=TEXTS, encoding_format="float")
    assert [d.index for d in default.data] == [0, 1, 2]
    assert default.usage.prompt_tokens == default.usage.total_tokens > 0
    tokenize = httpx.post(server.url + "/tokenize", json={"prompt": TEXTS[0]},
                          headers=server.headers).json()["tokens"]
    want = hf_pooled(hf_hidden(model, tokenize), "MEAN", True)
    assert cosine(np.array(default.data[0].embedding), want) > 1 - 1e-5
    for a, b in zip(default.data, floats.data):
        assert np.abs(np.array(a.embedding) - np.array(b.embedding)).max() < 1e-6
    by_ids = client.embeddings.create(model="tiny-embed", input=[tokenize])
    assert np.abs(np.array(by_ids.data[0].embedding) - want).max() < 1e-5


def test_langchain_openai_embeddings(served):
    from langchain_openai import OpenAIEmbeddings
    _, server = served
    embeddings = OpenAIEmbeddings(model="tiny-embed", base_url=server.url + "/v1",
                                  api_key=KEY, check_embedding_ctx_length=False)
    docs = embeddings.embed_documents(TEXTS)
    query = embeddings.embed_query(TEXTS[0])
    assert len(docs) == 3 and len(query) == 64
    assert cosine(np.array(docs[0]), np.array(query)) > 1 - 1e-6


def test_rerank_score_and_pooling_routes(served):
    _, server = served
    vectors = [np.array(d["embedding"]) for d in _post(
        server, "/v1/embeddings", {"input": ["fox"] + TEXTS}).json()["data"]]
    expected = [cosine(vectors[0], v) for v in vectors[1:]]
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = _post(server, path, {"model": "tiny-embed", "query": "fox", "top_n": 2,
                                    "documents": [TEXTS[0], {"text": TEXTS[1]}, TEXTS[2]]})
        result = body.json()
        assert body.status_code == 200, result
        order = sorted(range(3), key=lambda i: -expected[i])[:2]
        assert [r["index"] for r in result["results"]] == order
        assert [round(r["relevance_score"], 5) for r in result["results"]] == \
            [round(expected[i], 5) for i in order]
        assert result["results"][0]["document"]["text"] == TEXTS[order[0]]
        assert result["usage"]["total_tokens"] > 0
    bare = _post(server, "/rerank", {"query": "fox", "documents": TEXTS,
                                     "return_documents": False}).json()
    assert len(bare["results"]) == 3 and "document" not in bare["results"][0]
    score = _post(server, "/score", {"text_1": "fox", "text_2": TEXTS}).json()
    assert [round(d["score"], 5) for d in score["data"]] == [round(e, 5) for e in expected]
    pooled = _post(server, "/pooling", {"input": "fox", "task": "token_embed",
                                        "encoding_format": "base64"}).json()["data"][0]
    rows = np.frombuffer(base64.b64decode(pooled["data"]), "<f4").reshape(-1, 64)
    assert np.allclose(np.linalg.norm(rows, axis=1), 1, atol=1e-5)
    half = _post(server, "/v1/embeddings", {"input": "fox", "encoding_format": "base64",
                                            "embed_dtype": "float16"}).json()["data"][0]
    assert np.abs(np.frombuffer(base64.b64decode(half["embedding"]), "<f2") - vectors[0]) \
        .max() < 1e-3


def test_chat_style_input(served):
    _, server = served
    messages = [{"role": "user", "content": "fox"}]
    rendered = httpx.post(server.url + "/tokenize", headers=server.headers, json={
        "messages": messages, "add_generation_prompt": False}).json()["tokens"]
    by_chat = _post(server, "/v1/embeddings", {"messages": messages}).json()
    by_ids = _post(server, "/v1/embeddings", {"input": [rendered]}).json()
    assert by_chat["data"][0]["embedding"] == by_ids["data"][0]["embedding"]
    assert by_chat["usage"]["prompt_tokens"] == len(rendered)
    both = _post(server, "/v1/embeddings", {"messages": messages, "input": "x"})
    assert both.status_code == 400 and both.json()["error"]["param"] == "input"


def test_the_front_door(served):
    model, server = served
    assert httpx.post(server.url + "/v1/embeddings", json={"input": "x"}).status_code == 401
    cases = [
        ({"input": "x", "dimensions": 8}, "dimensions", "Matryoshka"),
        ({"input": []}, "input", "input must be"),
        ({"input": [[5] * 65]}, None, "more than max_model_len=64"),
        ({"input": ["x"] * 1025}, "input", "at most 1024"),
        ({"input": "x", "encoding_format": "bytes"}, "encoding_format", "'float' or 'base64'"),
        ({"input": "x", "model": "other"}, "model", "does not exist"),
    ]
    for body, param, message in cases:
        response = _post(server, "/v1/embeddings", body)
        error = response.json()["error"]
        assert response.status_code in (400, 404) and message in error["message"], error
        assert error["param"] == param
    cut = _post(server, "/v1/embeddings", {"input": [[5] * 65], "truncate_prompt_tokens": 10})
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 10
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                "content": "hi"}]})):
        response = _post(server, path, body)
        assert response.status_code == 400 and "--runner pooling" in response.text
    assert _post(server, "/classify", {"input": "x"}).status_code == 400
    too_big = httpx.post(server.url + "/v1/embeddings", content=b"{" + b" " * (17 << 20),
                         headers={**server.headers, "content-type": "application/json"})
    assert too_big.status_code == 413
    metrics = server.metrics()
    assert metrics['vllm:request_success_total{finished_reason="stop"}'] > 0
    assert metrics["vllm:prompt_tokens_total"] > 0
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.slow
def test_a_generating_server_refuses_pooling_routes(tmp_path):
    model = make_tiny_model(str(tmp_path), "llama", tokenizer=True)
    server = Server(model, "--max-model-len", "64")
    try:
        for path, body in (("/v1/embeddings", {"input": "x"}), ("/pooling", {"input": "x"}),
                           ("/score", {"text_1": "a", "text_2": "b"}),
                           ("/rerank", {"query": "a", "documents": ["b"]})):
            response = httpx.post(server.url + path, json=body, timeout=30)
            assert response.status_code == 400 and "--runner generate" in response.text, \
                response.text
        ok = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200
    finally:
        server.stop()
