"""The engine core's side of its workers: start, greet, broadcast steps, collect rank 0's answer."""
from __future__ import annotations

import logging
import socket as pysocket
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol
from urllib.parse import urlparse

import psutil
import zmq

from common.process import POLL_MS, free_port
from common.worker_auth import SECRET_ENV, new_secret, proof_is_valid, read_secret_file
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
    WorkerReady,
    WorkerShutdown,
)
from protocol.lora import LoadLoRA, UnloadLoRA

if TYPE_CHECKING:
    from engine_core.workers.ray_launcher import RayLauncher

logger = logging.getLogger("deltaserve")


@dataclass(frozen=True, slots=True)
class WorkerCapacity:
    num_blocks: int  # the minimum over ranks
    max_model_len: int
    vocab_size: int
    attention_backend: str
    dtype: str = ""
    quantization: str = ""
    sliding_windows: tuple[int, ...] = ()  # per KV layer group (empty: one full group)


class WorkerGroup:
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

    # --- start-up ---------------------------------------------------------------------------

    def start(self) -> WorkerCapacity:
        all_local = self.launcher.ranks_are_local(self.address)
        env = {SECRET_ENV: self.secret, **({"GLOO_SOCKET_IFNAME": "lo"} if all_local else {})}
        self.local = self.launcher.launch(self.address, env)
        init = WorkerInit(self.config, self._rendezvous(all_local))
        ready: dict[int, WorkerReady] = {}
        deadline = time.monotonic() + self.config.startup_timeout_s
        while len(ready) < self.world_size:
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world_size)) - set(ready))
                raise WorkerFailure(f"worker_{missing[0]}",
                                    f"workers {missing} were not ready within "
                                    f"{self.config.startup_timeout_s:.0f} s")
            message, identity = self._receive(POLL_MS)
            if isinstance(message, WorkerHello):
                self._greet(message, identity, init)
            elif isinstance(message, WorkerReady) and self.peers.get(message.rank) == identity:
                ready[message.rank] = message
            elif isinstance(message, WorkerError):
                raise self._blame(self._failure_of(message, identity))
        self.started = True
        logger.info("workers ready: %s", ", ".join(
            f"rank {r}: {m.num_blocks} blocks on {m.device} ({m.attention_backend}, {m.dtype}, "
            f"{m.quantization}){'; ' + m.host if m.host else ''}"
            for r, m in sorted(ready.items())))
        return WorkerCapacity(min(m.num_blocks for m in ready.values()),
                              min(m.max_model_len for m in ready.values()),
                              min(m.vocab_size for m in ready.values()),
                              ready[0].attention_backend, ready[0].dtype,
                              ready[0].quantization, tuple(ready[0].sliding_windows))

    def _rendezvous(self, all_local: bool) -> str:
        """Where the ranks' torch.distributed group meets: a file in the private runtime
        directory when every rank is local (nothing listens on the network), else a TCP store
        on the host the workers reach us on."""
        if all_local:
            return f"file://{self.runtime_dir}/rendezvous"
        host = urlparse(self.address).hostname or ""
        if host in ("", "0.0.0.0", "*", "::"):
            host = _outward_address()
        return f"tcp://{host}:{free_port(host)}"

    def _greet(self, hello: WorkerHello, identity: bytes, init: WorkerInit) -> None:
        if not proof_is_valid(self.secret, hello.proof, hello.rank, hello.pid, identity):
            self.socket.strangers.warn(f"ignored a hello without a valid proof (claims rank "
                                       f"{hello.rank}, pid {hello.pid}, host "
                                       f"{hello.hostname!r})")
            return
        if not 0 <= hello.rank < self.world_size or hello.rank in self.peers:
            logger.error("refusing worker with rank %d (pid %d, %s): already present or "
                         "outside world size %d", hello.rank, hello.pid, hello.hostname,
                         self.world_size)
            self._send(identity, self.socket.encoder.encode(WorkerShutdown()))
            return
        self.peers[hello.rank] = identity
        self._send(identity, self.socket.encoder.encode(init))

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

    # --- failures ---------------------------------------------------------------------------

    def check_alive(self) -> None:
        """Raise a WorkerFailure if a local worker has exited or is stopped, with its own
        report if one is queued."""
        dead = self._dead_worker()
        if dead is not None:
            raise self._blame(dead)

    def _dead_worker(self) -> WorkerFailure | None:
        return next((f for f in (w.failure() for w in self.local.values()) if f), None)

    def _failure_of(self, error: WorkerError, identity: bytes | None) -> WorkerFailure:
        rank = self.socket.rank_of(identity)
        when = f"at step {error.step}" if self.started else "to start"
        return WorkerFailure(f"worker_{rank}", f"worker_{rank} failed {when}: {error.message}",
                             True)

    def _blame(self, symptom: WorkerFailure, grace_s: float = 0.3) -> WorkerFailure:
        """A failure often surfaces first as a symptom: a socket disconnect, a process exit,
        or a collective failing on a survivor. Blame a local process that turns out to be
        dead or stopped, in its own words if it sent a WorkerError; else the first report;
        else the symptom."""
        reports = {symptom.process: symptom} if symptom.reported else {}
        deadline = time.monotonic() + grace_s
        while True:
            self._collect_reports(reports, 20)
            dead = self._dead_worker()
            if dead is not None:
                self._collect_reports(reports, 100)
                return reports.get(dead.process, dead)
            if time.monotonic() > deadline:
                return next(iter(reports.values()), symptom)

    def _collect_reports(self, reports: dict[str, WorkerFailure], timeout_ms: int) -> None:
        """Read queued frames (waiting up to the timeout for each) into `reports` if they are
        WorkerErrors, else keep them for `_receive`: a false alarm must lose nothing."""
        kept = []
        while self.socket.socket.poll(timeout_ms, zmq.POLLIN):
            message, identity = self.socket.read()
            if isinstance(message, WorkerError):
                failure = self._failure_of(message, identity)
                reports.setdefault(failure.process, failure)
            elif message is not None:
                kept.append((message, identity))
        self.socket.held.extend(kept)

    def _on_disconnect(self) -> None:
        """Some peer left. Raise if it was a worker: a worker that is gone is no longer
        routable (ROUTER_MANDATORY refuses a ping to it); anyone else is a stranger."""
        gone = [rank for rank, identity in self.peers.items()
                if not self.socket.reachable(identity)]
        if gone:
            name = f"worker_{gone[0]}"
            raise self._blame(WorkerFailure(name, f"{name} disconnected from {self.address}"))
        self.socket.strangers.info(f"a peer that is not a worker disconnected from "
                                   f"{self.address}")

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


def _outward_address() -> str:
    """This host's first non-loopback IPv4 address (what other hosts reach it by), else
    whatever its name resolves to."""
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == pysocket.AF_INET and not address.address.startswith("127."):
                return address.address
    return pysocket.gethostbyname(pysocket.gethostname())
