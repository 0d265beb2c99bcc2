"""External load balancing: two unchanged `deltaserve serve` processes behind a real Rust
router from PyPI (SMG, the SGLang model gateway, and vllm-router), driven by the official
`openai` client through the router, as the README's recipe runs them."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import httpx
import pytest
from server_utils import CHAT_TEMPLATE, Server

from common.process import free_port

openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                     "launch", "model_cache", "default_model")
BIN = os.path.dirname(sys.executable)


def _router_command(name: str, port: int, workers: list[str], policy: list[str]) -> list[str]:
    binary = shutil.which(name, path=BIN) or shutil.which(name)
    if binary is None:
        pytest.skip(f"{name} is not installed (pip install {name}; the test extra has it)")
    command = [binary, "launch"] if name == "smg" else [binary]
    command += ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
                "--policy", *policy]
    if name == "smg":  # its own metrics listener defaults to every interface
        command += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    return command


class Router:
    def __init__(self, name: str, workers: list[str],
                 policy: tuple[str, ...] = ("cache_aware",)) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(_router_command(name, self.port, workers, list(policy)),
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.skip(f"{name} cannot run on this machine:\n{self.output()}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise AssertionError(f"{name} did not come up:\n{self.output()}")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()[-4000:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    template = tmp_path_factory.mktemp("router") / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    started = []
    try:
        for _ in range(2):
            events = {"enable_kv_cache_events": True,
                      "endpoint": f"tcp://127.0.0.1:{free_port()}",
                      "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"}
            server = Server(MODEL, "--served-model-name", "default_model", "--chat-template",
                            str(template), "--kv-events-config",
                            json.dumps(events))
            server.kv_events = events
            started.append(server)
        yield started
    finally:
        for server in started:
            server.stop()


def _successes(server: Server) -> float:
    return sum(v for k, v in server.metrics().items()
               if k.startswith("vllm:request_success_total"))


@pytest.mark.parametrize("router", ["smg", "vllm-router"])
def test_openai_client_through_a_router(servers, router):
    proxy = Router(router, [s.url for s in servers])
    try:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", timeout=60,
                               max_retries=0)
        assert [m.id for m in client.models.list().data] == ["default_model"]
        before = [_successes(s) for s in servers]
        prefix = "def fibonacci(n):\n    if n < 2:\n        return n\n" * 4
        texts = []
        for i in range(6):  # one shared prefix: a cache-aware router keeps it on one server
            out = client.completions.create(model="default_model", prompt=prefix + f"# {i}",
                                            max_tokens=8, temperature=0)
            texts.append(out.choices[0].text)
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
            model="default_model", prompt=prefix + "# 0", max_tokens=8, temperature=0,
            stream=True) if chunk.choices)
        chat = client.chat.completions.create(
            model="default_model", messages=[{"role": "user", "content": "hi"}], max_tokens=6)
        after = [_successes(s) for s in servers]
        direct = httpx.post(servers[0].url + "/v1/completions", timeout=60, json={
            "model": "default_model", "prompt": prefix + "# 0", "max_tokens": 8,
            "temperature": 0}).json()["choices"][0]["text"]
    finally:
        proxy.stop()
    assert streamed == texts[0] == direct and all(texts)
    assert chat.choices[0].message.content is not None
    moved = sorted(a - b for a, b in zip(after, before))
    assert sum(moved) == 8, f"8 requests answered in all, got {moved}"
    assert moved[1] >= 7, f"the shared prefix should stick to one server, got {moved}"


def test_what_routers_read(servers):
    """vLLM's names: /health, /v1/models, the load gauges and vllm:cache_config_info."""
    server = servers[0]
    assert httpx.get(server.url + "/health").status_code == 200
    model = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert model["id"] == "default_model" and model["max_model_len"] == 1024
    m = server.metrics()
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running",
                 "vllm:kv_cache_usage_perc"):
        assert name in m
    info = [k for k in m if k.startswith("vllm:cache_config_info")]
    assert len(info) == 1 and m[info[0]] == 1.0
    for label in ('block_size="16"', 'enable_prefix_caching="True"', 'num_gpu_blocks="'):
        assert label in info[0], info[0]


def test_vllm_router_routes_by_our_kv_events(servers):
    """vllm-router's kv_aware policy subscribes to both servers' KV events: a prefix cached
    on a server (warmed there directly, past the router) draws its requests to that server."""
    sources = []
    for server in servers:
        sources += ["--kv-event-source", f"{server.url}={server.kv_events['endpoint']}",
                    "--kv-event-replay-source",
                    f"{server.url}={server.kv_events['replay_endpoint']}"]
    proxy = Router("vllm-router", [s.url for s in servers],
                   ("kv_aware", *sources, "--kv-event-block-size", "16",
                    "--kv-event-model", MODEL))
    prefixes = ["import numpy as np\nimport torch\n\nclass Model(torch.nn.Module):\n" * 3,
                "SELECT name, price FROM products WHERE price > 10 ORDER BY name;\n" * 3]
    try:
        for prefix, server in zip(prefixes, reversed(servers)):  # prefix i warm on server 1-i
            body = {"model": "default_model", "prompt": prefix + "# warm", "max_tokens": 2}
            assert httpx.post(server.url + "/v1/completions", json=body,
                              timeout=60).status_code == 200
        time.sleep(1.0)  # the events reach the router
        before = [_successes(s) for s in servers]
        for i in range(3):
            for prefix in prefixes:
                body = {"model": "default_model", "prompt": prefix + f"# {i}", "max_tokens": 2}
                assert httpx.post(proxy.url + "/v1/completions", json=body,
                                  timeout=60).status_code == 200
        moved = [_successes(s) - b for s, b in zip(servers, before)]
    finally:
        proxy.stop()
    assert moved == [3, 3], f"each prefix should go where it is cached, got {moved}"
