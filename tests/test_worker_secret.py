"""Worker secret files: text or raw bytes, read alike by every process; bad ones refused in
one line."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from common.process import free_port
from common.worker_auth import read_secret_file
from launch import LLM, SamplingParams

MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                     "launch", "model_cache", "default_model")
RAW = b"\xff\xfe" + bytes(range(30))  # 32 bytes, not UTF-8 (as from /dev/urandom)


def test_raw_bytes_and_text_read_the_same_everywhere(tmp_path):
    raw = tmp_path / "raw"
    raw.write_bytes(RAW)
    assert read_secret_file(str(raw)) == "hex:" + RAW.hex()
    text = tmp_path / "text"
    text.write_text("  a-long-enough-secret\n")
    assert read_secret_file(str(text)) == "a-long-enough-secret"


@pytest.mark.parametrize("content, message", [
    (b"\xff" * 8, "too short (at least 16 bytes)"),
    (b"short\n", "too short (at least 16 characters)"),
    (None, "cannot read the worker secret file"),
])
def test_bad_secret_files_are_one_clear_line(tmp_path, content, message):
    path = tmp_path / "secret"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=re.escape(message)):
        read_secret_file(str(path))
    worker = subprocess.run([sys.executable, "-m", "launch", "worker", "--connect",
                             f"tcp://127.0.0.1:{free_port()}", "--rank", "1",
                             "--worker-secret-file", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert worker.returncode == 2 and message in worker.stderr
    assert "Traceback" not in worker.stderr
    generate = subprocess.run([sys.executable, "-m", "launch", "generate", "--model", MODEL,
                               "--prompt", "x", "--worker-address",
                               f"tcp://127.0.0.1:{free_port()}", "--worker-secret-file",
                               str(path)], capture_output=True, text=True, timeout=60)
    assert generate.returncode == 2 and message in generate.stderr
    assert "Traceback" not in generate.stderr


def test_a_raw_byte_secret_links_the_engine_and_a_remote_worker(tmp_path):
    """The engine core, its local rank and a `deltaserve worker` all read one binary file."""
    secret = tmp_path / "secret"
    secret.write_bytes(RAW)
    address = f"tcp://127.0.0.1:{free_port()}"
    worker = subprocess.Popen([sys.executable, "-m", "launch", "worker", "--connect", address,
                               "--rank", "1", "--worker-secret-file", str(secret)])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    try:
        with LLM(MODEL, tensor_parallel_size=2, worker_address=address, local_ranks=[0],
                 worker_secret_file=str(secret)) as llm:
            out = llm.generate("def add", params, use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 6
        assert worker.wait(timeout=30) == 0
    finally:
        worker.kill()
