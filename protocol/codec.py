"""Versioned msgpack frames, one codec per channel.

Frame layout: `MAGIC (1 byte) | PROTOCOL_VERSION (1 byte) | msgpack payload`. The payload is
one message of the channel's tagged union, encoded by msgspec as `[tag, field, ...]` with
trailing defaults omitted. Anything else (garbage, another version, an unknown tag, a field of
the wrong type, a value its `__post_init__` refuses) decodes to `ProtocolError`.
"""
from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from common.log_limiter import LogLimiter
from protocol.engine_messages import CoreToFrontend, FrontendToCore
from protocol.int_column import IntColumn
from protocol.scheduler_output import ScheduledTokens
from protocol.worker_messages import CoreToWorker, WorkerToCore

logger = logging.getLogger("deltaserve")

PROTOCOL_VERSION = 2
MAGIC = 0xD5
HEADER = bytes((MAGIC, PROTOCOL_VERSION))


class ProtocolError(Exception):
    """A frame that is not a valid message of this channel and protocol version."""


class Channel(enum.IntEnum):
    """The four directed channels; the value is how a journal names them."""

    FRONTEND_TO_CORE = 1
    CORE_TO_FRONTEND = 2
    CORE_TO_WORKER = 3
    WORKER_TO_CORE = 4


_MESSAGE_TYPES: dict[Channel, Any] = {
    Channel.FRONTEND_TO_CORE: FrontendToCore,
    Channel.CORE_TO_FRONTEND: CoreToFrontend,
    Channel.CORE_TO_WORKER: CoreToWorker,
    Channel.WORKER_TO_CORE: WorkerToCore,
}


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, ScheduledTokens):
        return obj.counts.to_wire()
    if isinstance(obj, IntColumn):
        return obj.to_wire()
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec_hook(kind: type, obj: Any) -> Any:
    if isinstance(obj, bytes) and kind is IntColumn:
        return IntColumn.from_wire(obj)
    if isinstance(obj, bytes) and kind is ScheduledTokens:
        return ScheduledTokens(IntColumn.from_wire(obj))
    raise msgspec.ValidationError(f"expected {kind.__name__}, got {type(obj).__name__}")


def _readable(obj: Any) -> Any:
    if isinstance(obj, ScheduledTokens):
        return dict(obj.items())
    if isinstance(obj, IntColumn):
        return obj.tolist()
    raise NotImplementedError(f"cannot show {type(obj).__name__}")


def to_builtins(message: msgspec.Struct) -> Any:
    """A message as plain dicts and lists, for printing and diffing."""
    return msgspec.to_builtins(message, enc_hook=_readable)


class Codec:
    """Encodes and decodes the messages of one channel."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
        self._decoder = msgspec.msgpack.Decoder(_MESSAGE_TYPES[channel], dec_hook=_dec_hook)
        self.dropped = LogLimiter(logger, channel.name)

    def encode(self, message: msgspec.Struct) -> bytearray:
        frame = bytearray(HEADER)
        self._encoder.encode_into(message, frame, len(HEADER))
        return frame

    def decode(self, frame: bytes | bytearray | memoryview) -> Any:
        if len(frame) < len(HEADER) or frame[0] != MAGIC:
            head = bytes(frame[:8]).hex()
            raise ProtocolError(f"{self.channel.name}: not a deltaserve frame "
                                f"({len(frame)} bytes, starting {head or 'empty'})")
        if frame[1] != PROTOCOL_VERSION:
            raise ProtocolError(f"{self.channel.name}: frame has protocol version {frame[1]}, "
                                f"this process speaks version {PROTOCOL_VERSION}")
        try:
            return self._decoder.decode(memoryview(frame)[len(HEADER):])
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
            raise ProtocolError(f"{self.channel.name}: malformed frame "
                                f"({len(frame)} bytes): {e}") from None

    def receive_all(self, socket: zmq.Socket, timeout_ms: int,
                    on_frame: Callable[[bytes], None] | None = None,
                    on_error: Callable[[bytes, ProtocolError], None] | None = None,
                    ) -> list[Any]:
        """Every message waiting on `socket`, waiting up to timeout_ms for the first. Each
        frame goes to `on_frame` as received (the journal); malformed frames go to `on_error`,
        else are logged and dropped, so a bad peer never stops the caller."""
        messages: list[Any] = []
        if not socket.poll(timeout_ms):
            return messages
        while True:
            try:
                frame = socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return messages
            if on_frame is not None:
                on_frame(frame)
            try:
                messages.append(self.decode(frame))
            except ProtocolError as e:
                if on_error is not None:
                    on_error(frame, e)
                else:
                    self.dropped.warn(f"dropped a frame: {e}")
