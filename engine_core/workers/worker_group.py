"""The engine core's side of its workers: broadcast steps, collect rank 0's answer, notice
failures while idle (start-up: group_startup.py; failure reports: failure_triage.py)."""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Protocol

import zmq

from common.process import POLL_MS
from common.worker_auth import new_secret, read_secret_file
from engine_core.workers.failure_triage import FailureTriage
from engine_core.workers.group_startup import GroupStartup
from engine_core.workers.process_launcher import ProcessLauncher
from engine_core.workers.worker_failure import WorkerFailure
from engine_core.workers.worker_socket import FrameTap, Unreachable, WorkerSocket
from protocol import (
    EngineConfig,
    ModelRunnerOutput,
    SchedulerOutput,
    WorkerError,
    WorkerHello,
    WorkerInit,
    WorkerShutdown,
)
from protocol.lora import LoadLoRA, UnloadLoRA

if TYPE_CHECKING:
    from engine_core.workers.ray_launcher import RayLauncher

logger = logging.getLogger("deltaserve")


class WorkerGroup(GroupStartup, FailureTriage):
    """Implements `ModelExecutor` over a `WorkerSocket`.

    Every step message is encoded once and sent to every rank, in step order, over ordered
    connections, so each worker sees each step exactly once. Only rank 0 answers. Only peers
    that proved they hold the engine's worker secret are believed; a stranger's comings and
    goings are not worker deaths.
    """

    def __init__(self, config: EngineConfig, context: zmq.Context, runtime_dir: str,
                 tap: FrameTap | None = None) -> None:
        self.config = config
        self.world_size = config.tensor_parallel_size
        self.runtime_dir = runtime_dir
        self.secret = (read_secret_file(config.worker_secret_file)
                       if config.worker_secret_file else new_secret())
        self.launcher = _launcher(config)
        address = config.worker_address or self.launcher.default_address(runtime_dir)
        self.socket = WorkerSocket(context, address, self.secret,
                                   encrypt=address.startswith("tcp://"), tap=tap)
        self.address = self.socket.address
        self.local: dict[int, Watched] = {}  # the ranks we started, by rank
        self.in_flight: deque[tuple[int, float]] = deque()  # (step, sent at), not collected
        self.started = False  # every rank has reported WorkerReady

    @property
    def peers(self) -> dict[int, bytes]:
        return self.socket.peers

    # --- steps ------------------------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.submit(scheduler_output)
        return self.collect()

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        self.submit_frame(self.socket.encoder.encode(scheduler_output), scheduler_output.step)

    def execute_frame(self, frame: bytes | bytearray, step: int) -> ModelRunnerOutput:
        """Broadcast one encoded step (e.g. a recorded one) and wait for rank 0's answer."""
        self.submit_frame(frame, step)
        return self.collect()

    def submit_frame(self, frame: bytes | bytearray, step: int) -> None:
        """Broadcast one encoded step without waiting for its answer."""
        try:
            self.socket.broadcast(frame, step)
        except Unreachable as e:
            raise self._blame(WorkerFailure("worker", f"cannot reach a worker: {e}")) from None
        self.in_flight.append((step, time.monotonic()))

    def send_control(self, message: LoadLoRA | UnloadLoRA) -> None:
        """A message every rank applies between steps, in order with them; no answer."""
        try:
            self.socket.broadcast(self.socket.encoder.encode(message), self.socket.step)
        except Unreachable as e:
            raise self._blame(WorkerFailure("worker", f"cannot reach a worker: {e}")) from None

    def collect(self) -> ModelRunnerOutput:
        """Rank 0's answer to the oldest step submitted and not yet collected. A step with no
        answer for `step_timeout_s` means a hung worker."""
        step, sent = self.in_flight.popleft()
        deadline = sent + self.config.step_timeout_s
        while True:
            message, identity = self._receive(POLL_MS)
            if isinstance(message, ModelRunnerOutput) and identity == self.peers[0]:
                if message.step != step:
                    raise WorkerFailure("worker_0", f"answered step {message.step} to step "
                                                    f"{step}")
                return message
            if isinstance(message, WorkerError):
                raise self._blame(self._failure_of(message, identity))
            if message is None and time.monotonic() > deadline:
                raise self._blame(self._stall(step))

    def _stall(self, step: int) -> WorkerFailure:
        states = ", ".join(f"{w.name}: {w.state()}" for w in self.local.values())
        return WorkerFailure("worker_0", f"step {step} made no progress for "
                                         f"{self.config.step_timeout_s:g} s; worker_0 owes "
                                         f"the answer ({states or 'no local workers'})")

    def poll_idle(self) -> None:
        """While no step is in flight: read everything peers sent (a stranger's flood must not
        pile up in buffers), and raise if a worker failed, died or hangs."""
        while True:
            waiting, disconnected = self.socket.poll(0)
            if disconnected:
                self._on_disconnect()
            if not waiting:
                break
            message, identity = self.socket.read()
            if isinstance(message, WorkerError):
                raise self._blame(self._failure_of(message, identity))
            if isinstance(message, WorkerHello):
                self._greet(message, identity, WorkerInit(self.config))  # refused: present
            elif message is not None:
                logger.warning("a worker sent %s while idle; ignored", type(message).__name__)
        self.check_alive()

    # --- the seam ---------------------------------------------------------------------------

    def _send(self, identity: bytes, frame: bytes | bytearray) -> None:
        try:
            self.socket.send(identity, frame)
        except Unreachable as e:
            raise self._blame(WorkerFailure("worker", f"cannot reach a worker: {e}")) from None

    def _receive(self, timeout_ms: int) -> tuple[object | None, bytes | None]:
        """One message and its sender, or (None, None) after the timeout. Liveness is checked
        whenever no frame is queued: a worker's last WorkerError is read before the
        disconnect and the exit that follow it."""
        waiting, disconnected = self.socket.poll(timeout_ms)
        if waiting:
            return self.socket.read()
        if disconnected:
            self._on_disconnect()
        self.check_alive()
        return None, None

    def shutdown(self) -> None:
        for identity in self.peers.values():
            try:
                self.socket.send(identity, self.socket.encoder.encode(WorkerShutdown()))
            except Unreachable:
                pass  # already gone
        self.launcher.stop()
        self.socket.close()

    def kill_local(self) -> None:
        """Last resort (the engine core's parent is gone): kill our workers at once."""
        self.launcher.kill()


class Watched(Protocol):
    """A worker this engine core started: a process, or a Ray actor."""

    name: str

    def state(self) -> str: ...

    def failure(self) -> WorkerFailure | None: ...


def _launcher(config: EngineConfig) -> ProcessLauncher | RayLauncher:
    if config.distributed_executor_backend == "ray":
        from engine_core.workers.ray_launcher import RayLauncher  # Ray is an optional extra
        return RayLauncher(config.tensor_parallel_size, config.device,
                           config.startup_timeout_s)
    return ProcessLauncher(config.tensor_parallel_size, config.spawned_ranks)
