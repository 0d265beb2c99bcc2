"""A real worker process, driven through its socket by the test in the engine core's place."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import zmq
from model_utils import make_tiny_model

from common.process import make_runtime_dir
from common.worker_auth import SECRET_ENV
from protocol import (
    HEADER,
    Channel,
    Codec,
    EngineConfig,
    ModelRunnerOutput,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
    WorkerError,
    WorkerHello,
    WorkerInit,
    WorkerReady,
    WorkerShutdown,
)
from worker.models import footprint
from worker.models.registry import load_model_config

pytestmark = pytest.mark.slow  # real engine processes


class FakeEngineCore:
    def __init__(self) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.runtime_dir = make_runtime_dir()
        self.address = f"ipc://{self.runtime_dir}/workers"
        self.socket.bind(self.address)
        self.encoder, self.decoder = Codec(Channel.CORE_TO_WORKER), Codec(Channel.WORKER_TO_CORE)
        self.peer = b""

    def receive(self, timeout_ms: int = 60_000):
        assert self.socket.poll(timeout_ms), "the worker did not answer"
        self.peer, frame = self.socket.recv_multipart()
        return self.decoder.decode(frame)

    def send(self, message) -> None:
        self.send_raw(self.encoder.encode(message))

    def send_raw(self, frame: bytes) -> None:
        self.socket.send_multipart([self.peer, frame])

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)


@pytest.fixture
def worker(tmp_path):
    model = make_tiny_model(str(tmp_path / "m"), "llama")
    core = FakeEngineCore()
    proc = subprocess.Popen([sys.executable, "-m", "worker", "--connect", core.address,
                             "--rank", "0"], env=dict(os.environ, **{SECRET_ENV: "s" * 32}))
    hello = core.receive()
    assert isinstance(hello, WorkerHello) and hello.rank == 0 and hello.pid == proc.pid
    core.send(WorkerInit(EngineConfig(model=model, dtype="float32", max_model_len=64,
                                      num_gpu_blocks_override=8)))
    ready = core.receive()
    assert isinstance(ready, WorkerReady) and ready.num_blocks == 8 and ready.vocab_size == 256
    # a block's keys and values in every layer (one layer group), float32
    assert ready.block_bytes == footprint.kv_block_bytes(load_model_config(model), 16, 1, 4)
    yield core, proc
    proc.kill()
    core.close()


def _step(step: int) -> SchedulerOutput:
    new = NewRequestData(0, "r", [5, 6, 7], SamplingParams(temperature=0.0), [1])
    return SchedulerOutput([new], num_scheduled_tokens={0: 3}, total_num_scheduled_tokens=3,
                           step=step)


def test_malformed_frames_are_dropped_then_steps_run(worker):
    core, proc = worker
    for frame in (b"garbage", bytes([HEADER[0], 42]) + b"\x90", HEADER + b"\x91\x7f"):
        core.send_raw(frame)
    core.send(_step(1))
    out = core.receive()
    assert isinstance(out, ModelRunnerOutput) and out.step == 1 and len(out.sampled_token_ids[0]) == 1
    core.send(WorkerShutdown())
    assert proc.wait(timeout=10) == 0


def test_a_step_gap_is_reported_not_guessed(worker):
    core, proc = worker
    core.send(_step(1))
    assert isinstance(core.receive(), ModelRunnerOutput)
    core.send(SchedulerOutput(step=3))
    error = core.receive()
    assert isinstance(error, WorkerError) and "expected step 2, got step 3" in error.message
    assert error.step == 3 and proc.wait(timeout=10) == 1
