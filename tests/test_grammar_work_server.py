"""Costly constraints through `deltaserve serve` (issue 30): a flood of distinct costly
regexes, n x a costly regex, huge schemas beside small and cached ones, and every constraint
the grammar engine cannot run, each answered as it should be (a 400 naming the field, a 503
when the server is too busy to check, or finish reason "error" with what happened, never ""
with "stop") while another stream runs to its end and the engine lives on. Behaviour only:
timings are benchmarks/bench_constraint_load.py's."""
from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
from model_utils import make_tiny_model
from server_utils import Server

pytestmark = pytest.mark.slow
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_model(str(tmp_path_factory.mktemp("grammar_work") / "tiny"),
                           tokenizer=True)
    srv = Server(path, "--served-model-name", "tiny", "--dtype", "float32",
                 "--max-model-len", "512", "--structured-outputs-validation-timeout-s", "3",
                 "--structured-outputs-compile-timeout-s", "20")
    yield srv
    assert srv.stop() == 0, srv.output()


def _answers(server: Server, bodies: list[dict]) -> list[httpx.Response]:
    async def main() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=len(bodies) + 4)
        async with httpx.AsyncClient(base_url=server.url, timeout=300.0,
                                     limits=limits) as client:
            return await asyncio.gather(*(client.post("/v1/completions",
                                                      json={"model": "tiny", **b})
                                          for b in bodies))
    return asyncio.run(main())


class Stream:
    """A plain streaming request running beside the case; `check()` after it: it got every
    token and finished by length."""

    def __init__(self, server: Server, tokens: int = 120) -> None:
        self.tokens, self.chunks, self.finish = tokens, 0, None
        body = {"model": "tiny", "prompt": "x", "max_tokens": tokens, "ignore_eos": True,
                "stream": True, "temperature": 0.0}

        def run() -> None:
            with httpx.stream("POST", server.url + "/v1/completions", json=body,
                              timeout=300.0) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        self.chunks += 1
                        self.finish = httpx.Response(200, content=line[6:]).json()[
                            "choices"][0]["finish_reason"] or self.finish
        self.thread = threading.Thread(target=run)
        self.thread.start()

    def check(self) -> None:
        self.thread.join(300)
        assert self.finish == "length" and self.chunks >= 2


def _serving(server: Server) -> None:
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": "x", "max_tokens": 3})
    assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) > 0


def test_a_flood_of_distinct_costly_regexes_is_answered_and_others_flow(server):
    stream = Stream(server)
    answers = _answers(server, [{"prompt": PROMPT, "max_tokens": 4, "structured_outputs": {
        "regex": f"a{{{1_000_000 + j}}}"}} for j in range(32)])
    statuses = {r.status_code for r in answers}
    assert statuses <= {400, 503}, [r.text for r in answers if r.status_code not in (400, 503)]
    for r in answers:
        assert r.json()["error"]["param"] == "structured_outputs", r.text
    stream.check()
    _serving(server)


def test_n_sequences_of_a_costly_regex_end_and_others_flow(server):
    stream = Stream(server)
    (r,) = _answers(server, [{"prompt": PROMPT, "n": 16, "max_tokens": 6, "temperature": 1.0,
                              "structured_outputs": {"regex": "a{30000}"}}])
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "length" and set(choice["text"]) == {"a"}
    stream.check()
    _serving(server)


def test_huge_schemas_hold_up_neither_small_nor_cached_nor_plain_requests(server):
    def schema(prefix: str) -> dict:
        return {"type": "object", "properties": {f"{prefix}{i}": {} for i in range(5000)}}
    _answers(server, [{"prompt": PROMPT, "max_tokens": 2,
                       "response_format": {"type": "json_object"}}])  # now cached
    result: list[httpx.Response] = []
    big = threading.Thread(target=lambda: result.extend(_answers(server, [
        {"prompt": PROMPT, "max_tokens": 4, "response_format": {"type": "json_schema",
         "json_schema": {"name": "big", "schema": schema(chr(ord("a") + k))}}}
        for k in range(4)])))
    big.start()
    plain, small, cached = _answers(server, [
        {"prompt": PROMPT, "max_tokens": 4},
        {"prompt": PROMPT, "max_tokens": 8, "response_format": {"type": "json_schema",
         "json_schema": {"name": "small", "schema": {
             "type": "object", "properties": {"n": {"type": "integer"}}}}}},
        {"prompt": PROMPT, "max_tokens": 4, "response_format": {"type": "json_object"}}])
    big.join(300)
    assert plain.status_code == small.status_code == cached.status_code == 200
    for r in result:  # a refusal, busy, or an answer that says what happened
        assert r.status_code in (200, 400, 503), r.text
        if r.status_code == 200:
            assert r.json()["choices"][0]["finish_reason"] in ("length", "stop", "error")
    _serving(server)


@pytest.mark.parametrize("constraint, words", [
    ({"json": {"$ref": "#"}}, "admits no output at all"),
    ({"json": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
               "$ref": "#/$defs/a"}}, "admits no output at all"),
    ({"regex": r"[^\s\S]"}, "admits no output at all"),
    ({"grammar": 'start: "a" <|nonexistent|>'}, "unknown special token"),
    ({"grammar": "start: <[99999999]>"}, "Token range end too large"),
    ({"grammar": "start: x\nx: " + " | ".join(f'"w{i}"' for i in range(5500))},
     "--structured-outputs-max-items-in-row"),
])
def test_what_cannot_run_is_a_400_naming_the_field(server, constraint, words):
    for _ in range(2):  # the second answer comes from the cache: the same
        r = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": PROMPT, "max_tokens": 4,
            "structured_outputs": constraint})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "structured_outputs" and words in error["message"]
    _serving(server)

