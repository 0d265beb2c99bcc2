"""The front-end's side of the engine-core process: start it, talk to it, notice its death."""
from __future__ import annotations

import shutil
import subprocess
import time

import msgspec
import zmq

from launch.errors import EngineDeadError
from common.process import POLL_MS, describe_exit, make_runtime_dir, spawn, stop_processes
from protocol import (AbortRequests, AddRequest, AddRequests, Channel, Codec, EngineConfig,
                      EngineCoreOutput, EngineCoreOutputs, EngineFailed, EngineReady,
                      SchedulerStats, ShutdownEngine)


class EngineClient:
    """Binds two ipc sockets in a fresh private runtime directory (PUSH requests, PULL outputs)
    and starts `python -m engine_core`; `wait_ready()` waits for its `EngineReady`.

    Once the engine is dead (it reported a failure, or its process exited), every call raises
    `EngineDeadError` naming the process that died.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runtime_dir = make_runtime_dir()
        self.context = zmq.Context()
        self.input = self.context.socket(zmq.PUSH)
        self.input.setsockopt(zmq.LINGER, 0)
        self.input.bind(f"ipc://{self.runtime_dir}/input")
        self.output = self.context.socket(zmq.PULL)
        self.output.setsockopt(zmq.LINGER, 0)
        self.output.bind(f"ipc://{self.runtime_dir}/output")
        self.encoder = Codec(Channel.FRONTEND_TO_CORE)
        self.decoder = Codec(Channel.CORE_TO_FRONTEND)
        self.dead: EngineDeadError | None = None
        self.stats = SchedulerStats()
        self.last_step = 0  # the step of the latest outputs received
        self.proc: subprocess.Popen | None = spawn("engine_core", [
            "--config", msgspec.json.encode(config).decode(),
            "--input", f"ipc://{self.runtime_dir}/input",
            "--output", f"ipc://{self.runtime_dir}/output", "--runtime-dir", self.runtime_dir])
        self.ready: EngineReady | None = None

    def wait_ready(self) -> EngineReady:
        """Block until the engine reports ready; on failure, stop everything and raise."""
        try:
            deadline = time.monotonic() + self.config.startup_timeout_s + 30
            while self.ready is None:
                if time.monotonic() > deadline:
                    raise EngineDeadError(f"the engine was not ready within "
                                          f"{self.config.startup_timeout_s:.0f} s")
                for message in self._receive(POLL_MS):
                    if isinstance(message, EngineReady):
                        self.ready = message
            return self.ready
        except BaseException:
            self.shutdown()
            raise

    def add_requests(self, requests: list[AddRequest]) -> None:
        """One frame for all of them: the engine sees the whole batch before its next step."""
        self._send(AddRequests(requests) if len(requests) != 1 else requests[0])

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.dead is None:
            self._send(AbortRequests(request_ids))

    def get_outputs(self, timeout_ms: int = POLL_MS) -> list[EngineCoreOutput]:
        """Outputs that arrived within the timeout (possibly none)."""
        outputs: list[EngineCoreOutput] = []
        for message in self._receive(timeout_ms):
            if isinstance(message, EngineCoreOutputs):
                outputs += message.outputs
                self.last_step = message.step
                if message.stats is not None:
                    self.stats = message.stats
        return outputs

    def _send(self, message: msgspec.Struct) -> None:
        self._check_alive()
        self.input.send(self.encoder.encode(message), copy=False)

    def _receive(self, timeout_ms: int) -> list[object]:
        """Every message waiting (waiting up to timeout_ms for the first). Raises
        EngineDeadError on a failure report or when the engine-core process is gone."""
        self._check_alive()
        messages = self.decoder.receive_all(self.output, timeout_ms)
        for message in messages:
            if isinstance(message, EngineFailed):
                self._die(message.message, message.process)
        if not messages:
            self._check_alive()
        return messages

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise self.dead
        if self.proc is not None and self.proc.poll() is not None:
            self._die(f"engine_core (pid {self.proc.pid}) {describe_exit(self.proc.returncode)}",
                      "engine_core")

    def _die(self, message: str, process: str) -> None:
        self.dead = EngineDeadError(message, process)
        self._stop_engine(grace_s=0.5)
        raise self.dead

    def _stop_engine(self, grace_s: float) -> None:
        if self.proc is not None:
            stop_processes([self.proc], grace_s)

    def shutdown(self) -> None:
        """Ask the engine core to stop its workers and exit; kill it if it does not."""
        if self.proc is None:
            return
        if self.proc.poll() is None and self.dead is None:
            try:
                self.input.send(self.encoder.encode(ShutdownEngine()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self._stop_engine(grace_s=5.0)
        self.proc = None
        self.input.close(linger=0)
        self.output.close(linger=0)
        self.context.term()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)
