"""Hostile clients against a real `deltaserve serve` on loopback (the shipped demo model): no
request may kill or stall the engine, client mistakes are 4xx in OpenAI's shape (streamed or
not), memory stays bounded and the gauges tell the truth after the engine dies.

Stall checks measure, while the hostile request runs, the gaps between another stream's
chunks and the latency of /health. The bound asserted here is loose (this suite shares two
cores with everything else); `benchmarks/bench_front_door.py` reports the p99 figures.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx
import psutil
import pytest
from server_utils import Server

from launch.model_cache.cache import SHIPPED_MODEL

pytestmark = pytest.mark.slow
KEY = "sk-front-door"
STALL_S = 1.0  # the loosest gap or /health latency a test accepts (the goal is 0.1 s)


@pytest.fixture(scope="module")
def server():
    srv = Server(SHIPPED_MODEL, "--served-model-name", "demo", "--max-model-len", "1024",
                 "--request-header-timeout", "2", "--request-body-timeout", "2",
                 api_key=KEY)
    yield srv
    assert srv.stop() == 0, srv.output()


def _post(server: Server, body, path: str = "/v1/completions", **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers=server.headers,
                      timeout=60.0, **kw)


def _rss(server: Server) -> int:
    return psutil.Process(server.proc.pid).memory_info().rss


def _assert_serving(server: Server) -> None:
    r = _post(server, {"prompt": "def f(", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200


def _assert_error(r: httpx.Response, status: int = 400, param: str | None = None) -> dict:
    assert r.status_code == status, r.text[:500]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


class Watch:
    """Streams completions back to back and polls /health until stopped; records the gaps
    between chunks of a stream and each /health latency."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.gaps: list[float] = []
        self.health: list[float] = []
        self.done = threading.Event()
        self.threads = [threading.Thread(target=self._stream), threading.Thread(
            target=self._poll)]

    def __enter__(self) -> Watch:
        for t in self.threads:
            t.start()
        time.sleep(0.5)  # both are running before the hostile request starts
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        for t in self.threads:
            t.join(60)

    def _stream(self) -> None:
        body = {"prompt": "def f(", "max_tokens": 300, "ignore_eos": True, "stream": True,
                "temperature": 0}
        while not self.done.is_set():
            with httpx.stream("POST", self.server.url + "/v1/completions", json=body,
                              headers=self.server.headers, timeout=60) as r:
                last = None
                for line in r.iter_lines():
                    now = time.monotonic()
                    if line.startswith("data: {"):
                        if last is not None:
                            self.gaps.append(now - last)
                        last = now
                    if self.done.is_set():
                        break

    def _poll(self) -> None:
        while not self.done.is_set():
            start = time.monotonic()
            assert httpx.get(self.server.url + "/health", timeout=30).status_code == 200
            self.health.append(time.monotonic() - start)
            time.sleep(0.05)

    def check(self) -> None:
        assert self.gaps and self.health
        assert max(self.gaps) < STALL_S, f"a stream stalled {max(self.gaps):.2f} s"
        assert max(self.health) < STALL_S, f"/health took {max(self.health):.2f} s"


def test_a_huge_stop_string_is_refused_and_the_engine_lives(server):
    r = _post(server, {"prompt": "hi", "n": 128, "max_tokens": 2, "stop": ["z" * 5_000_000]})
    _assert_error(r, param="stop")
    r = _post(server, {"prompt": "hi", "n": 128, "max_tokens": 2, "stop": ["z" * 16000]})
    assert r.status_code == 200 and len(r.json()["choices"]) == 128  # not copied per child
    _assert_serving(server)


def test_many_stop_strings_are_refused_at_once(server):
    start = time.monotonic()
    stops = [f"stop{i}" for i in range(10_000)]
    _assert_error(_post(server, {"prompt": "hi", "n": 128, "stop": stops}), param="stop")
    assert time.monotonic() - start < 5
    _assert_serving(server)


def test_a_huge_prompt_is_refused_before_tokenizing_without_stalling(server):
    rss = _rss(server)
    with Watch(server) as watch:
        start = time.monotonic()
        r = _post(server, {"prompt": "hello world " * 1_300_000, "max_tokens": 1})
        elapsed = time.monotonic() - start
    _assert_error(r)
    assert "characters" in r.json()["error"]["message"] and elapsed < 5
    watch.check()
    assert _rss(server) - rss < 200 << 20
    _assert_serving(server)


def test_chat_with_huge_messages_is_refused_before_rendering(server):
    r = _post(server, {"messages": [{"role": "user", "content": "x" * 10_000_000}]},
              "/v1/chat/completions")
    _assert_error(r, param="messages")


def _raw(server: Server, data: bytes, read_s: float = 5.0) -> bytes:
    """Send `data` on a fresh connection; what comes back before it closes (or read_s)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=read_s) as s:
        try:
            s.sendall(data)
        except OSError:
            pass  # closed on us mid-send: what it answered is still readable or not needed
        chunks = []
        try:
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except OSError:
            pass
        return b"".join(chunks)


def test_header_bombs_are_cut_off(server):
    rss = _rss(server)
    bomb = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Bomb: " + b"a" * (8 << 20) + b"\r\n\r\n"
    threads = [threading.Thread(target=_raw, args=(server, bomb)) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert _rss(server) - rss < 100 << 20
    many = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(
        f"X-H{i}: v\r\n".encode() for i in range(300)) + b"\r\n"
    assert _raw(server, many).startswith(b"HTTP/1.1 431")
    _assert_serving(server)


def test_slow_and_idle_connections_are_closed(server):
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"GET /health HTTP/1.1\r\n")
        for _ in range(20):  # a header line every 0.5 s: never a whole head in 2 s
            try:
                s.sendall(b"X-Slow: 1\r\n")
                if s.recv(1, socket.MSG_DONTWAIT) == b"":
                    break
            except BlockingIOError:
                pass
            except OSError:
                break
            time.sleep(0.5)
    assert time.monotonic() - start < 6
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as idle:
        start = time.monotonic()
        assert idle.recv(1) == b""  # closed by the server, having sent nothing
        assert time.monotonic() - start < 6
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{")
    answer = _raw(server, head, read_s=10)
    assert b" 408 " in answer.split(b"\r\n")[0], answer[:200]


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "temperature": 2 ** 64}, "temperature"),
    ({"prompt": "x", "repetition_penalty": 10 ** 30 * 10 ** 30}, "repetition_penalty"),
    ({"prompt": "x", "temperature": 1e39}, "temperature"),
    ({"prompt": "x", "max_tokens": 10 ** 12}, "max_tokens"),
    ({"prompt": ["a", "b", "c", "d"], "n": 128, "logprobs": 20, "max_tokens": 1000},
     "logprobs"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_client_mistakes_are_400(server, body, param, stream):
    _assert_error(_post(server, {**body, "stream": stream}), param=param)


@pytest.mark.parametrize("stream", [False, True])
def test_invalid_utf8_is_400(server, stream):
    body = b'{"prompt": "a\xff\xfeb", "max_tokens": 2, "stream": %s}' % (
        b"true" if stream else b"false")
    assert "UTF-8" in _assert_error(_post(server, body))["message"]


def test_child_seeds_do_not_overflow(server):
    body = {"prompt": "x", "n": 2, "seed": 2 ** 63 - 1, "max_tokens": 3}
    r = _post(server, body)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                      headers=server.headers, timeout=30) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"
    assert not any('"error"' in line for line in lines)


def test_null_content_renders_and_a_failing_template_is_400(server, tmp_path):
    """Content null renders as "" (vLLM's normalization; issue 29); a template whose own code
    fails is a 400 naming the message it fails on."""
    template = tmp_path / "concat.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}"
                        "{% if m.get('name') %}{{ m['content'] + 1 }}{% endif %}\n"
                        "{% endfor %}")
    srv = Server(SHIPPED_MODEL, "--chat-template", str(template), "--max-model-len", "256")
    try:
        r = _post(srv, {"messages": [{"role": "user", "content": None}], "max_tokens": 2},
                  "/v1/chat/completions")
        assert r.status_code == 200, r.text
        r = _post(srv, {"messages": [{"role": "user", "content": "hi"},
                                     {"role": "user", "content": "x", "name": "n"}],
                        "max_tokens": 2}, "/v1/chat/completions")
        assert _assert_error(r, param="messages")["message"].startswith("messages[1]: ")
        r = _post(srv, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                  "/v1/chat/completions")
        assert r.status_code == 200, r.text
    finally:
        assert srv.stop() == 0


def test_only_monitoring_routes_are_open(server):
    for path in ("/health", "/version", "/metrics"):
        assert httpx.get(server.url + path).status_code == 200, path
    for path, body in (("/tokenize", {"prompt": "x" * 1000}), ("/detokenize", {"tokens": [1]}),
                       ("/v1/completions", {"prompt": "x"})):
        _assert_error(httpx.post(server.url + path, json=body), 401)
    huge = _post(server, {"prompt": "x" * 15_000_000}, "/tokenize")
    _assert_error(huge, param="prompt")


def test_api_key_from_a_file(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("sk-from-file\n")
    srv = Server(SHIPPED_MODEL, "--api-key-file", str(key_file), "--max-model-len", "256")
    try:
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        ok = httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer sk-from-file"})
        assert ok.status_code == 200
        assert "sk-from-file" not in " ".join(psutil.Process(srv.proc.pid).cmdline())
    finally:
        assert srv.stop() == 0


def test_gauges_read_zero_after_the_engine_dies():
    srv = Server(SHIPPED_MODEL, "--max-model-len", "1024")
    try:
        body = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        streams = [httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30)
                   for _ in range(8)]
        responses = [s.__enter__() for s in streams]
        readers = [r.iter_lines() for r in responses]  # alive: a collected one disconnects
        for lines in readers:
            while not next(lines).startswith("data: {"):
                pass
        deadline = time.monotonic() + 10
        while srv.metrics()["vllm:num_requests_running"] != 8:  # the gauge follows a step
            assert time.monotonic() < deadline
            time.sleep(0.02)
        worker = next(c for c in srv.children if "worker" in " ".join(c.cmdline()))
        os.kill(worker.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while httpx.get(srv.url + "/health").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for lines in readers:
            tail = [line for line in lines if line]
            assert tail[-1] == "data: [DONE]" and '"error"' in tail[-2]
        for s in streams:
            s.__exit__(None, None, None)
        m = srv.metrics()
        assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
        assert m["vllm:kv_cache_usage_perc"] == 0
        assert httpx.get(srv.url + "/health").status_code == 503
    finally:
        srv.stop()
