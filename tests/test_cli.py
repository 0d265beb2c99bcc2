"""The `deltaserve` command line."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from model_utils import make_tiny_model

pytestmark = pytest.mark.slow  # real engine processes


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("cli") / "m"), "qwen2", tokenizer=True)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch", *args], capture_output=True,
                          text=True, timeout=120)


def test_generate(tiny):
    result = _run("generate", "--model", tiny, "--prompt", "def add(a, b):", "--prompt", "The",
                  "--max-tokens", "6", "--num-gpu-blocks-override", "32", "--dtype", "float32",
                  "--no-enable-prefix-caching", "--max-num-seqs", "4", "--ignore-eos")
    assert result.returncode == 0, result.stderr
    assert "--- prompt 0 ---\ndef add(a, b):" in result.stdout
    assert "--- prompt 1 ---\nThe" in result.stdout
    assert "12 tokens in" in result.stderr


def test_console_script_and_errors(tiny, tmp_path):
    script = os.path.join(os.path.dirname(sys.executable), "deltaserve")
    result = subprocess.run([script, "generate", "--model", str(tmp_path / "missing"),
                             "--prompt", "x"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "Hugging Face style directory" in result.stderr
    result = _run("generate", "--model", tiny, "--prompt", "x", "--temperature", "-1")
    assert result.returncode == 2 and "temperature must be non-negative" in result.stderr
    assert _run("--help").returncode == 0 and _run("worker", "--help").returncode == 0
