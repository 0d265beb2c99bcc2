"""The front-end's side of the engine-core process: start it, talk to it, notice its death."""
from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import psutil
import zmq

from common.process import POLL_MS, describe_exit, make_runtime_dir, spawn, stop_processes
from launch.errors import EngineDeadError
from protocol import (
    AbortRequests,
    AddRequest,
    AddRequests,
    Channel,
    Codec,
    EngineConfig,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineFailed,
    EngineReady,
    SchedulerStats,
    ShutdownEngine,
)
from protocol.lora import AddLoRA, RemoveLoRA

# The engine core's largest legal frame (a step's outputs with logprobs) is far below this.
MAX_OUTPUT_FRAME = 64 << 20
MAX_REQUEST_FRAME = 1 << 30  # the engine core refuses bigger input frames
# While requests are pending, the engine core reports at least every second (a heartbeat)
# and each step it runs is bounded by step_timeout_s; silence beyond both is a hang.
SILENCE_MARGIN_S = 10.0


@dataclass(slots=True)
class OutputBatch:
    """What one replica sent: its outputs and latest stats; or, once it died, the requests it
    held (`lost`, engine request ids) and why (`error`)."""

    engine: int  # the replica's data-parallel rank (the metrics' `engine` label)
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats | None
    lost: list[str] = field(default_factory=list)
    error: EngineDeadError | None = None


class EngineClient:
    """Binds two ipc sockets in a fresh private (0700) runtime directory, one for requests and
    one for outputs, and starts `python -m engine_core`, which connects to both; `wait_ready()`
    waits for its `EngineReady`. Both are PAIR sockets: each holds exactly one peer, and
    ZeroMQ drops any later connection, so no other process can inject frames into, flood or
    steal from the link once the engine core is attached.

    Once the engine is dead (it reported a failure, or its process exited), every call raises
    `EngineDeadError` naming the process that died.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runtime_dir = make_runtime_dir()
        self.context = zmq.Context()
        self.input = self.context.socket(zmq.PAIR)
        self.input.setsockopt(zmq.LINGER, 0)
        self.input.bind(f"ipc://{self.runtime_dir}/input")
        self.output = self.context.socket(zmq.PAIR)
        self.output.setsockopt(zmq.LINGER, 0)
        self.output.setsockopt(zmq.MAXMSGSIZE, MAX_OUTPUT_FRAME)
        self.output.setsockopt(zmq.RCVHWM, 0)  # the engine core never blocks on us
        self.output.bind(f"ipc://{self.runtime_dir}/output")
        self.encoder = Codec(Channel.FRONTEND_TO_CORE)
        self.decoder = Codec(Channel.CORE_TO_FRONTEND)
        self.dead: EngineDeadError | None = None
        self.stats = SchedulerStats()
        self.rank = config.data_parallel_rank
        self.last_step = 0  # the step of the latest outputs received
        self.proc: subprocess.Popen | None = spawn("engine_core", [
            "--config", msgspec.json.encode(config).decode(),
            "--input", f"ipc://{self.runtime_dir}/input",
            "--output", f"ipc://{self.runtime_dir}/output", "--runtime-dir", self.runtime_dir])
        self.ready: EngineReady | None = None
        self.pending: set[str] = set()  # request ids sent and not yet finished
        self.last_heard = time.monotonic()
        self.next_hang_check = 0.0  # monotonic time; _check_hang reads /proc at most every POLL_MS

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

    @property
    def output_sockets(self) -> list[zmq.Socket]:
        return [self.output]

    @property
    def readies(self) -> list[EngineReady]:
        return [self.ready] if self.ready is not None else []

    @property
    def ranks(self) -> list[int]:
        return [self.rank]

    def engine_of(self, request_id: str) -> int:
        return self.rank

    def add_requests(self, requests: list[AddRequest],
                     group_sizes: Sequence[int] | None = None) -> None:
        """One frame for all of them: the engine sees the whole batch before its next step.
        (`group_sizes`, how many consecutive requests share a prompt, matter only to a
        data-parallel client.)"""
        message = AddRequests(requests) if len(requests) != 1 else requests[0]
        frame = self.encoder.encode(message)
        if len(frame) > MAX_REQUEST_FRAME:
            raise ValueError(f"{len(requests)} requests make a {len(frame) >> 20} MiB frame, "
                             f"over the engine's {MAX_REQUEST_FRAME >> 20} MiB: send fewer at "
                             "a time")
        if not self.pending:
            self.last_heard = time.monotonic()
        self._send_frame(frame)
        self.pending.update(r.request_id for r in requests)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.dead is None:
            self._send(AbortRequests(request_ids))

    def send_lora(self, message: AddLoRA | RemoveLoRA) -> None:
        """Register (or unregister) a LoRA adapter with the engine core."""
        self._send(message)

    def get_outputs(self, timeout_ms: int = POLL_MS) -> list[EngineCoreOutput]:
        """Outputs that arrived within the timeout (possibly none)."""
        outputs: list[EngineCoreOutput] = []
        for message in self._receive(timeout_ms):
            if isinstance(message, EngineCoreOutputs):
                outputs += message.outputs
                self.last_step = message.step
                if message.stats is not None:
                    self.stats = message.stats
        for out in outputs:
            if out.finish_reason is not None:
                self.pending.discard(out.request_id)
        return outputs

    def get_output_batches(self, timeout_ms: int = POLL_MS) -> list[OutputBatch]:
        """`get_outputs` as the batch of this one engine (none if nothing arrived)."""
        outputs = self.get_outputs(timeout_ms)
        return [OutputBatch(self.rank, outputs, self.stats)] if outputs else []

    def _send(self, message: msgspec.Struct) -> None:
        self._send_frame(self.encoder.encode(message))

    def _send_frame(self, frame: bytes | bytearray) -> None:
        """Send once the engine core can take it; a core that dies meanwhile (a PAIR send to a
        gone peer would wait for ever) is an EngineDeadError."""
        while True:
            self._check_alive()
            if self.input.poll(POLL_MS, zmq.POLLOUT):
                try:
                    self.input.send(frame, zmq.NOBLOCK, copy=False)
                    return
                except zmq.Again:
                    continue

    def _receive(self, timeout_ms: int) -> list[object]:
        """Every message waiting (waiting up to timeout_ms for the first). Raises
        EngineDeadError on a failure report or when the engine-core process is gone."""
        self._check_alive()
        messages = self.decoder.receive_all(self.output, timeout_ms)
        for message in messages:
            if isinstance(message, EngineFailed):
                self._die(message.message, message.process)
        if messages:
            self.last_heard = time.monotonic()
        else:
            self._check_alive()
            self._check_hang()
        return messages

    def _check_alive(self) -> None:
        """Raise EngineDeadError if the engine core is gone (cheap: every call checks). A core
        that exited after reporting a failure (e.g. a worker died between two calls) is blamed
        in its own words: its EngineFailed is read before the exit is acted on."""
        if self.dead is not None:
            raise self.dead
        if self.proc is None:
            return
        if self.proc.poll() is not None:
            for message in self.decoder.receive_all(self.output, 0):
                if isinstance(message, EngineFailed):
                    self._die(message.message, message.process)
            self._die(f"engine_core (pid {self.proc.pid}) {describe_exit(self.proc.returncode)}",
                      "engine_core")

    def _check_hang(self) -> None:
        """Only when nothing arrived, and at most every POLL_MS (reading the process state costs
        a /proc read, and a caller polling with a short timeout would pay it every few
        milliseconds): raise if the engine core is stopped, or silent past its step timeout
        with requests pending."""
        now = time.monotonic()
        if self.proc is None or now < self.next_hang_check:
            return
        self.next_hang_check = now + POLL_MS / 1000
        state = _state(self.proc.pid)
        if state in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
            self._die(f"engine_core (pid {self.proc.pid}) is {state} and cannot make progress",
                      "engine_core")
        silent = time.monotonic() - self.last_heard
        if self.pending and silent > self.config.step_timeout_s + SILENCE_MARGIN_S:
            self._die(f"engine_core (pid {self.proc.pid}) sent nothing for {silent:.0f} s with "
                      f"{len(self.pending)} requests pending (state: {_state(self.proc.pid)})",
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


def _state(pid: int) -> str:
    try:
        return psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return "gone"
