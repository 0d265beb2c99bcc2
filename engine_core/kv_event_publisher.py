"""Publishing the block pool's KV-cache events on ZeroMQ, as vLLM's ZmqEventPublisher does.

The step loop encodes one batch per step and hands it to a thread over an inproc socket
without blocking (a full queue drops the batch, logged). The thread numbers the batches
(0, 1, 2, ... with no gaps), sends `(topic, seq, payload)` on the PUB socket, keeps the last
`buffer_steps` for replay, and answers replay requests on the ROUTER: `[identity, b"",
start seq]` gets every kept batch from `start` on as `[identity, b"", seq, payload]`, then
`[identity, b"", -1, b""]`.
"""
from __future__ import annotations

import ipaddress
import logging
import threading
import time
from collections import deque
from urllib.parse import urlparse

import msgspec
import zmq

from common.log_limiter import LogLimiter
from protocol.kv_events import KVEvent, KVEventBatch, KVEventsConfig

logger = logging.getLogger("deltaserve")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MAX_REPLAY_REQUEST = 64  # bytes; a replay request is three short frames
_STOP = b""  # on the inbox: the step loop is done


def offset_endpoint(endpoint: str, rank: int) -> str:
    """Data-parallel rank `rank` publishes on the endpoint's port + rank (vLLM's rule);
    ipc and inproc endpoints get a `_dp{rank}` suffix."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


def binds(endpoint: str) -> bool:
    """vLLM binds wildcard, ipc and inproc endpoints and connects to the rest (the consumer
    binds); a loopback address is bound too, so the default needs no consumer first."""
    if endpoint.startswith(("ipc://", "inproc://")) or "*" in endpoint or "::" in endpoint:
        return True
    host = urlparse(endpoint).hostname or ""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class KVEventPublisher:
    """One engine core's events: `publish` from the step loop, `close` at shutdown."""

    def __init__(self, config: KVEventsConfig, rank: int, context: zmq.Context) -> None:
        self.rank = rank
        self.topic = config.topic.encode()
        self.endpoint = offset_endpoint(config.endpoint, rank)
        self.pub = context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, config.hwm)
        self.pub.setsockopt(zmq.LINGER, 500)  # the last batches get half a second to leave
        self.replay: zmq.Socket | None = None
        self.inbox = context.socket(zmq.PAIR)  # the step loop's end
        self.outbox = context.socket(zmq.PAIR)  # the thread's end
        try:
            _attach(self.pub, self.endpoint)
            if config.replay_endpoint is not None:
                self.replay = context.socket(zmq.ROUTER)
                self.replay.setsockopt(zmq.LINGER, 0)
                self.replay.setsockopt(zmq.MAXMSGSIZE, MAX_REPLAY_REQUEST)
                _attach(self.replay, offset_endpoint(config.replay_endpoint, rank), bind=True)
            address = f"inproc://kv-events-{id(self)}"
            for socket in (self.inbox, self.outbox):
                socket.setsockopt(zmq.SNDHWM if socket is self.inbox else zmq.RCVHWM,
                                  config.max_queue_size)
                socket.setsockopt(zmq.LINGER, 0)
            self.outbox.bind(address)
            self.inbox.connect(address)
        except BaseException:
            self._close_sockets()
            raise
        self.encoder = msgspec.msgpack.Encoder()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.next_seq = 0
        self.drops = LogLimiter(logger, "KV events")  # the step loop's
        self.strangers = LogLimiter(logger, "KV-event replay")  # the thread's
        self.thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self.thread.start()
        logger.info("publishing KV-cache events on %s%s", self.endpoint,
                    f" (replay: {offset_endpoint(config.replay_endpoint, rank)})"
                    if self.replay is not None else "")

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one batch; never blocks the caller."""
        payload = self.encoder.encode(KVEventBatch(time.time(), events, self.rank))
        try:
            self.inbox.send(payload, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.drops.warn(f"dropped a batch of {len(events)} events: the publisher's "
                               "queue is full")

    def close(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (for up to `timeout_s`), then stop."""
        try:
            self.inbox.send(_STOP, zmq.NOBLOCK)
        except zmq.Again:
            pass
        self.thread.join(timeout_s)
        if not self.thread.is_alive():
            self._close_sockets()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.outbox, zmq.POLLIN)
        if self.replay is not None:
            poller.register(self.replay, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self.replay is not None and self.replay in ready:
                self._serve_replay()
            if self.outbox in ready:
                payload = self.outbox.recv(copy=True)
                if payload == _STOP:
                    return
                self._send(payload)

    def _send(self, payload: bytes) -> None:
        seq = self.next_seq.to_bytes(8, "big")
        try:
            self.pub.send_multipart((self.topic, seq, payload), zmq.NOBLOCK)
        except zmq.Again:
            pass  # a connecting PUB with no peer yet: the batch stays replayable
        self.buffer.append((self.next_seq, payload))
        self.next_seq += 1

    def _serve_replay(self) -> None:
        try:
            parts = self.replay.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        if len(parts) != 3 or parts[1] != b"" or len(parts[2]) != 8:
            self.strangers.warn(f"ignored a replay request of {len(parts)} frames (want "
                              "[b'', 8-byte start sequence])")
            return
        identity, start = parts[0], int.from_bytes(parts[2], "big")
        try:
            for seq, payload in list(self.buffer):
                if seq >= start:
                    self.replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload),
                                               zmq.NOBLOCK)
            self.replay.send_multipart((identity, b"", END_SEQ, b""), zmq.NOBLOCK)
        except zmq.Again:
            self.strangers.warn("a replay client stopped reading; its answer was cut short")

    def _close_sockets(self) -> None:
        for socket in (self.pub, self.replay, self.inbox, self.outbox):
            if socket is not None:
                socket.close()


def _attach(socket: zmq.Socket, endpoint: str, bind: bool | None = None) -> None:
    try:
        if bind if bind is not None else binds(endpoint):
            socket.bind(endpoint)
        else:
            socket.connect(endpoint)
    except zmq.ZMQError as e:
        raise ValueError(f"KV events: cannot use {endpoint}: {e}") from None
