"""The engine core's side of its workers: start, greet, broadcast steps, collect rank 0's answer."""
from __future__ import annotations

import logging
import subprocess
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlparse

import zmq

from launch.process import describe_exit, free_port, spawn, stop_processes
from protocol import (Channel, Codec, EngineConfig, ModelRunnerOutput, ProtocolError,
                      SchedulerOutput, WorkerError, WorkerHello, WorkerInit, WorkerReady,
                      WorkerShutdown)

logger = logging.getLogger("deltaserve")
POLL_MS = 100  # liveness is checked at least this often while waiting

# Called with every frame crossing the worker socket: (channel, frame, step, peer rank).
FrameTap = Callable[[Channel, bytes, int, int], None]
ALL_RANKS, UNKNOWN_RANK = 254, 255  # peer values of a broadcast and of an unnamed worker


class WorkerFailure(RuntimeError):
    """A worker failed or died; `process` names it (e.g. "worker_1"). `reported` marks a
    failure the worker described itself (a WorkerError)."""

    def __init__(self, process: str, message: str, reported: bool = False) -> None:
        super().__init__(message)
        self.process = process
        self.reported = reported


@dataclass(frozen=True, slots=True)
class WorkersReady:
    num_blocks: int  # the minimum over ranks
    max_model_len: int
    vocab_size: int
    attention_backend: str


class WorkerGroup:
    """Implements `ModelExecutor` over a ROUTER socket; each worker is a DEALER.

    Every step message is encoded once and sent to every rank, in step order, over ordered
    connections, so each worker sees each step exactly once. Only rank 0 answers.
    """

    def __init__(self, config: EngineConfig, context: zmq.Context, runtime_dir: str,
                 tap: FrameTap | None = None) -> None:
        self.config = config
        self.world_size = config.tensor_parallel_size
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.socket.setsockopt(zmq.LINGER, 0)
        if config.worker_address:
            self.socket.bind(config.worker_address)
        else:
            self.socket.bind(f"ipc://{runtime_dir}/workers")
        self.address = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.monitor = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.poller = zmq.Poller()
        self.poller.register(self.socket, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.procs: dict[int, subprocess.Popen] = {}
        self.peers: dict[int, bytes] = {}  # rank -> socket identity
        self.encoder, self.decoder = Codec(Channel.CORE_TO_WORKER), Codec(Channel.WORKER_TO_CORE)
        self.tap = tap
        self.step = 0  # the newest step submitted
        self.in_flight: deque[int] = deque()  # steps submitted and not yet collected
        self.held: deque[tuple[object, bytes]] = deque()  # read while looking for reports
        self.started = False  # every rank has reported WorkerReady

    # --- start-up ---------------------------------------------------------------------------

    def start(self) -> WorkersReady:
        for rank in self.config.spawned_ranks:
            self.procs[rank] = spawn("worker", ["--connect", self.address, "--rank", str(rank)])
        host = urlparse(self.address).hostname if self.address.startswith("tcp") else None
        dist_host = "127.0.0.1" if host in (None, "0.0.0.0", "*") else host
        init = WorkerInit(self.config.worker_config(f"tcp://{dist_host}:{free_port(dist_host)}"))
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
            elif isinstance(message, WorkerReady):
                ready[message.rank] = message
            elif isinstance(message, WorkerError):
                raise self._blame(self._failure_of(message))
        self.started = True
        logger.info("workers ready: %s", ", ".join(
            f"rank {r}: {m.num_blocks} blocks on {m.device} ({m.attention_backend}, {m.dtype})"
            for r, m in sorted(ready.items())))
        return WorkersReady(min(m.num_blocks for m in ready.values()),
                            min(m.max_model_len for m in ready.values()),
                            min(m.vocab_size for m in ready.values()),
                            ready[0].attention_backend)

    def _greet(self, hello: WorkerHello, identity: bytes, init: WorkerInit) -> None:
        if not 0 <= hello.rank < self.world_size or hello.rank in self.peers:
            logger.error("refusing worker with rank %d (pid %d, %s): already present or "
                         "outside world size %d", hello.rank, hello.pid, hello.hostname,
                         self.world_size)
            self._send(identity, self.encoder.encode(WorkerShutdown()))
            return
        self.peers[hello.rank] = identity
        self._send(identity, self.encoder.encode(init))

    # --- steps ------------------------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.submit(scheduler_output)
        return self.collect()

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        self.submit_frame(self.encoder.encode(scheduler_output), scheduler_output.step)

    def execute_frame(self, frame: bytes | bytearray, step: int) -> ModelRunnerOutput:
        """Broadcast one encoded step (e.g. a recorded one) and wait for rank 0's answer."""
        self.submit_frame(frame, step)
        return self.collect()

    def submit_frame(self, frame: bytes | bytearray, step: int) -> None:
        """Broadcast one encoded step without waiting for its answer."""
        self.step = step
        if self.tap is not None:
            self.tap(Channel.CORE_TO_WORKER, frame, step, ALL_RANKS)
        for rank in range(self.world_size):
            self._send(self.peers[rank], frame, tap=False)
        self.in_flight.append(step)

    def collect(self) -> ModelRunnerOutput:
        """Rank 0's answer to the oldest step submitted and not yet collected."""
        step = self.in_flight.popleft()
        while True:
            message, identity = self._receive(POLL_MS)
            if isinstance(message, ModelRunnerOutput) and identity == self.peers[0]:
                if message.step != step:
                    raise WorkerFailure("worker_0", f"answered step {message.step} to step "
                                                    f"{step}")
                return message
            if isinstance(message, WorkerError):
                raise self._blame(self._failure_of(message))

    def check_alive(self) -> None:
        """Raise a WorkerFailure if a local worker has exited, with its own report if queued."""
        dead = self._dead_worker()
        if dead is not None:
            raise self._blame(dead)

    def _dead_worker(self) -> WorkerFailure | None:
        for rank, proc in self.procs.items():
            if proc.poll() is not None:
                return WorkerFailure(f"worker_{rank}", f"worker_{rank} (pid {proc.pid}) "
                                                       f"{describe_exit(proc.returncode)}")
        return None

    def _failure_of(self, error: WorkerError) -> WorkerFailure:
        when = f"at step {error.step}" if self.started else "to start"
        return WorkerFailure(f"worker_{error.rank}",
                             f"worker_{error.rank} failed {when}: {error.message}", True)

    def _blame(self, symptom: WorkerFailure, grace_s: float = 0.3) -> WorkerFailure:
        """A failure often surfaces first as a symptom: a socket disconnect, a process exit,
        or a collective failing on a survivor. Blame a local process that turns out to be
        dead, in its own words if it sent a WorkerError; else the first report; else the
        symptom."""
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
        WorkerErrors, else into `held` for `_receive`: a false alarm must lose nothing."""
        while self.socket.poll(timeout_ms, zmq.POLLIN):
            message, identity = self._read_frame()
            if isinstance(message, WorkerError):
                failure = self._failure_of(message)
                reports.setdefault(failure.process, failure)
            elif message is not None:
                self.held.append((message, identity))

    def _on_disconnect(self) -> None:
        """Raise if a worker is gone. When every rank is a local process that is alive and
        none reported an error, the peer that left was not a worker (a stray connection):
        log it and carry on. With remote ranks a disconnect is all we see, so it is fatal."""
        symptom = WorkerFailure("worker", f"a worker disconnected from {self.address}")
        failure = self._blame(symptom)
        if failure is not symptom or len(self.procs) < self.world_size:
            raise failure
        logger.warning("a peer that is not a worker disconnected from %s; all %d workers are "
                       "alive", self.address, self.world_size)

    def shutdown(self) -> None:
        for identity in self.peers.values():
            try:
                self._send(identity, self.encoder.encode(WorkerShutdown()))
            except WorkerFailure:
                pass  # already gone
        stop_processes(list(self.procs.values()))
        self.monitor.close(linger=0)
        self.socket.close(linger=0)

    # --- the one seam every worker frame passes -----------------------------------------------

    def _rank_of(self, identity: bytes) -> int:
        return next((r for r, i in self.peers.items() if i == identity), UNKNOWN_RANK)

    def _send(self, identity: bytes, frame: bytes | bytearray, tap: bool = True) -> None:
        if tap and self.tap is not None:
            self.tap(Channel.CORE_TO_WORKER, frame, self.step, self._rank_of(identity))
        try:
            self.socket.send_multipart([identity, frame], copy=False)
        except zmq.ZMQError as e:  # ROUTER_MANDATORY: the peer is gone
            raise self._blame(WorkerFailure("worker", f"cannot reach a worker: {e}")) from None

    def _receive(self, timeout_ms: int) -> tuple[object | None, bytes | None]:
        """One decoded message and its sender, or (None, None) after the timeout. Liveness is
        checked whenever no frame is queued: a worker's last WorkerError is read before the
        disconnect and the exit that follow it."""
        if self.held:
            return self.held.popleft()
        events = dict(self.poller.poll(timeout_ms))
        if self.socket in events:
            return self._read_frame()
        if self.monitor in events:
            self.monitor.recv_multipart()
            if self.peers:
                self._on_disconnect()
        self.check_alive()
        return None, None

    def _read_frame(self) -> tuple[object | None, bytes | None]:
        """Malformed frames are logged and dropped."""
        identity, frame = self.socket.recv_multipart()
        if self.tap is not None:
            self.tap(Channel.WORKER_TO_CORE, frame, self.step, self._rank_of(identity))
        try:
            return self.decoder.decode(frame), identity
        except ProtocolError as e:
            logger.warning("dropped a frame from a worker: %s", e)
            return None, None
