"""`deltaserve serve` without a chat template, and its exit on SIGTERM with a stream in
flight: the stream ends with an error event, the process exits 0, no child process and no
runtime directory is left."""
from __future__ import annotations

import os
import signal
import threading

import httpx
import pytest
from engine_utils import wait_gone
from model_utils import make_tiny_model
from server_utils import CHAT_TEMPLATE, Server

pytestmark = pytest.mark.slow


def test_no_template_then_sigterm_with_a_stream_in_flight(tmp_path):
    model = make_tiny_model(str(tmp_path / "tiny"), tokenizer=True)
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    server = Server(model, "--dtype", "float32", "--max-model-len", "512")
    try:
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = httpx.post(server.url + "/v1/chat/completions", json=chat)
        assert r.status_code == 400 and "--chat-template" in r.json()["error"]["message"]
        events: list[str] = []
        started = threading.Event()

        def stream() -> None:
            body = {"prompt": "x", "max_tokens": 500, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", server.url + "/v1/completions", json=body,
                              timeout=30.0) as response:
                for line in response.iter_lines():
                    if line:
                        events.append(line)
                        started.set()
        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(30.0)
        children = [c.pid for c in server.children]
        assert server.runtime_dir and os.path.isdir(server.runtime_dir)
        assert server.stop(signal.SIGTERM, timeout_s=15.0) == 0, server.output()
        reader.join(10.0)
    finally:
        server.stop(signal.SIGKILL)
    assert events[-1] == "data: [DONE]" and '"error"' in events[-2], events[-3:]
    assert "shutting down" in events[-2]
    assert not wait_gone(children, 5.0)
    assert not os.path.exists(server.runtime_dir)
    # the same model with --chat-template FILE renders chat
    server = Server(model, "--dtype", "float32", "--max-model-len", "512",
                    "--chat-template", str(template))
    try:
        r = httpx.post(server.url + "/v1/chat/completions", json=chat)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(
            httpx.post(server.url + "/tokenize", json={"messages": chat["messages"]}
                       ).json()["tokens"])
    finally:
        assert server.stop() == 0
