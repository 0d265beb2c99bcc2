"""The engine core's one socket to its workers, and the one seam every worker frame passes."""
from __future__ import annotations

import errno
import logging
from collections import deque
from collections.abc import Callable

import zmq

from common.log_limiter import LogLimiter
from common.worker_auth import secure_server
from protocol import Channel, Codec, ProtocolError, WorkerHello, WorkerPing

logger = logging.getLogger("deltaserve")

# Called with every frame crossing the worker socket: (channel, frame, step, peer rank).
FrameTap = Callable[[Channel, bytes, int, int], None]
ALL_RANKS, UNKNOWN_RANK = 254, 255  # peer values of a broadcast and of an unnamed peer
# The largest frame a worker sends (a step's tokens and logprobs, or an error report) is well
# under this; anything bigger is refused by ZeroMQ before it is buffered.
MAX_WORKER_FRAME = 16 << 20


class Unreachable(Exception):
    """A send to a peer that is no longer connected."""


class WorkerSocket:
    """A ROUTER socket (each worker is a DEALER) on an ipc path in the private runtime
    directory, or on tcp with CURVE keyed by the worker secret. `peers` maps ranks to the
    identities of workers that proved themselves; frames from anyone else except hellos are
    logged (rate-limited) and dropped, so a stranger can make us do nothing but read."""

    def __init__(self, context: zmq.Context, address: str, secret: str, encrypt: bool,
                 tap: FrameTap | None) -> None:
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_WORKER_FRAME)
        self.auth = secure_server(self.socket, secret) if encrypt else None
        self.socket.bind(address)
        self.address = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.monitor = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.poller = zmq.Poller()
        self.poller.register(self.socket, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.peers: dict[int, bytes] = {}  # rank -> socket identity, once authenticated
        self.encoder, self.decoder = Codec(Channel.CORE_TO_WORKER), Codec(Channel.WORKER_TO_CORE)
        self.ping = bytes(self.encoder.encode(WorkerPing()))
        self.tap = tap
        self.step = 0  # the newest step submitted, for the journal
        self.held: deque[tuple[object, bytes]] = deque()  # read ahead, not yet handed out
        self.strangers = LogLimiter(logger, "worker socket")

    def rank_of(self, identity: bytes | None) -> int:
        return next((r for r, i in self.peers.items() if i == identity), UNKNOWN_RANK)

    def send(self, identity: bytes, frame: bytes | bytearray, tap: bool = True) -> None:
        """Raises Unreachable if the peer is gone (ROUTER_MANDATORY)."""
        if tap and self.tap is not None:
            self.tap(Channel.CORE_TO_WORKER, frame, self.step, self.rank_of(identity))
        try:
            self.socket.send_multipart([identity, frame], copy=False)
        except zmq.ZMQError as e:
            raise Unreachable(str(e)) from None

    def broadcast(self, frame: bytes | bytearray, step: int) -> None:
        """One encoded step to every rank, journaled once."""
        self.step = step
        if self.tap is not None:
            self.tap(Channel.CORE_TO_WORKER, frame, step, ALL_RANKS)
        for rank in sorted(self.peers):
            self.send(self.peers[rank], frame, tap=False)

    def reachable(self, identity: bytes) -> bool:
        try:
            self.socket.send_multipart([identity, self.ping], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            return e.errno != errno.EHOSTUNREACH
        return True

    def poll(self, timeout_ms: int) -> tuple[bool, bool]:
        """(a frame is waiting, some peer disconnected), waiting up to timeout_ms."""
        if self.held:
            return True, False
        events = dict(self.poller.poll(timeout_ms))
        disconnected = self.monitor in events
        if disconnected:
            self.monitor.recv_multipart()
        return self.socket in events, disconnected

    def read(self) -> tuple[object | None, bytes | None]:
        """The next message from an authenticated worker, or a hello from anyone, with its
        sender; (None, None) for anything dropped."""
        if self.held:
            return self.held.popleft()
        parts = self.socket.recv_multipart(copy=True)
        if len(parts) != 2:
            self.strangers.warn(f"dropped a {len(parts)}-part message (a worker sends one part)")
            return None, None
        identity, frame = parts
        rank = self.rank_of(identity)
        if self.tap is not None:
            self.tap(Channel.WORKER_TO_CORE, frame, self.step, rank)
        try:
            message = self.decoder.decode(frame)
        except ProtocolError as e:
            self.strangers.warn(f"dropped a frame: {e}")
            return None, None
        if rank == UNKNOWN_RANK and not isinstance(message, WorkerHello):
            self.strangers.warn(f"ignored a {type(message).__name__} from a peer that is not "
                                "an authenticated worker")
            return None, None
        return message, identity

    def close(self) -> None:
        self.monitor.close(linger=0)
        self.socket.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
