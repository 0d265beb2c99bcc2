"""A `deltaserve serve` process on loopback for tests, and what to check after it exits."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import psutil

from common.process import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def render_chat(messages: list[dict]) -> str:
    """CHAT_TEMPLATE by hand, with the generation prompt."""
    return "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages) + "<|assistant|>"


class Server:
    """`python -m launch serve ...` on a free loopback port; ready once /health answers."""

    def __init__(self, model: str, *args: str, api_key: str | None = None,
                 startup_s: float = 180.0, omp_threads: str | None = "1") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        env = dict(os.environ, PYTHONPATH=ROOT)
        if omp_threads is not None:  # tests: no oversubscription (conftest sets it too)
            env["OMP_NUM_THREADS"] = omp_threads
        env.pop("DELTASERVE_API_KEY", None)
        if api_key:
            env["DELTASERVE_API_KEY"] = api_key  # the flag's fallback
        self.log = tempfile.TemporaryFile("w+")  # its output, shown when a test fails
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "launch", "serve", "--model", model, "--port",
             str(self.port), "--log-level", "warning", *args],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready(startup_s)
        self.children = psutil.Process(self.proc.pid).children(recursive=True)
        self.runtime_dir = _runtime_dir(self.proc.pid)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server did not start:\n{self.output()}")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()[-5000:]

    def metrics(self, engine: str | None = "0") -> dict[str, float]:
        """Samples of /metrics as {'name{labels}': value}, model_name label dropped, and the
        `engine` label too when it is `engine` (None: every engine's, labelled)."""
        text = httpx.get(self.url + "/metrics", timeout=5.0).text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                key = re.sub(r',?model_name="[^"]*"', "", key).replace("{,", "{")
                if engine is not None:
                    key = key.replace(f'engine="{engine}"', "").replace("{,", "{")
                    key = key.replace(",}", "}")
                samples[key.replace("{}", "")] = float(value)
        return samples

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def _runtime_dir(pid: int) -> str | None:
    """The directory of the engine's ipc sockets, which the server process binds."""
    for conn in psutil.Process(pid).net_connections(kind="unix"):
        if conn.laddr and os.path.basename(os.path.dirname(conn.laddr)).startswith("deltaserve-"):
            return os.path.dirname(conn.laddr)
    return None
