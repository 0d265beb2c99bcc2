"""The message journal: every frame the engine core sends and receives, byte for byte.

File layout (integers little-endian):
    b"DSJRNL01" | u32 header length | u32 crc32(header) | header (msgpack JournalHeader)
    then records: u32 frame length | u32 crc32(rest) | u8 channel | u8 peer | u64 step |
                  u64 monotonic ns | frame
`peer` is the worker rank a frame came from or went to (ALL_PEERS for a step broadcast to
every rank, NO_PEER on front-end channels). Records are appended by a background thread, so
the step loop never waits on the disk; the buffer is flushed every FLUSH_S and on close.
"""
from __future__ import annotations

import mmap
import queue
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec

from protocol.codec import Channel, Codec, ProtocolError
from protocol.engine_config import EngineConfig

MAGIC = b"DSJRNL01"
ALL_PEERS, NO_PEER = 254, 255
FLUSH_S = 0.1
_RECORD = struct.Struct("<IIBBQQ")  # length, crc, channel, peer, step, timestamp_ns
_PREFIX = struct.Struct("<II")  # header length, crc
_DIRECTIONS = {Channel.FRONTEND_TO_CORE: ("in", "frontend"),
               Channel.CORE_TO_FRONTEND: ("out", "frontend"),
               Channel.CORE_TO_WORKER: ("out", "worker"),
               Channel.WORKER_TO_CORE: ("in", "worker")}


class JournalError(Exception):
    """A truncated or corrupted journal; `offset` is where the damage starts."""

    def __init__(self, message: str, offset: int) -> None:
        super().__init__(f"{message} at byte offset {offset}")
        self.offset = offset


class JournalHeader(msgspec.Struct, kw_only=True):
    protocol_version: int
    engine_config: EngineConfig
    weights_hash: str  # sha256 over the model directory's weight files
    world_size: int
    seed: int
    versions: dict[str, str]
    created_unix: float


@dataclass(frozen=True, slots=True)
class JournalRecord:
    offset: int
    channel: Channel
    peer: int
    step: int
    timestamp_ns: int
    frame: bytes
    message: Any  # the decoded message, or None if the frame was malformed when recorded
    error: str | None = None

    @property
    def direction(self) -> str:
        """"in" or "out", seen from the engine core."""
        return _DIRECTIONS[self.channel][0]

    @property
    def endpoint(self) -> str:
        """"frontend" or "worker": who is on the other side."""
        return _DIRECTIONS[self.channel][1]


class JournalWriter:
    def __init__(self, path: str, header: JournalHeader) -> None:
        self._file = open(path, "wb")
        head = msgspec.msgpack.encode(header)
        self._file.write(MAGIC + _PREFIX.pack(len(head), zlib.crc32(head)) + head)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._drain, name="journal", daemon=True)
        self._thread.start()

    def record(self, channel: Channel, frame: bytes | bytearray, step: int,
               peer: int = NO_PEER) -> None:
        """Cheap on the caller's side: the frame is packed and written by the thread."""
        self._queue.put((channel, peer, step, time.monotonic_ns(), bytes(frame)))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self._file.close()

    def _drain(self) -> None:
        last_flush = time.monotonic()
        while True:
            try:
                item = self._queue.get(timeout=FLUSH_S)
            except queue.Empty:
                item = ...
            if item is None:
                self._file.flush()
                return
            if item is not ...:
                channel, peer, step, ts, frame = item
                meta = struct.pack("<BBQQ", channel, peer, step, ts)
                self._file.write(_RECORD.pack(len(frame), zlib.crc32(frame, zlib.crc32(meta)),
                                              channel, peer, step, ts) + frame)
            if time.monotonic() - last_flush >= FLUSH_S:
                self._file.flush()
                last_flush = time.monotonic()


class JournalReader:
    """Iterating yields the JournalHeader, then a JournalRecord per frame, in order. Damage
    raises JournalError naming the byte offset; every record before it has been yielded."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._codecs = {channel: Codec(channel) for channel in Channel}

    def __iter__(self) -> Iterator[JournalHeader | JournalRecord]:
        with open(self.path, "rb") as f:
            if f.seek(0, 2) < len(MAGIC):
                raise JournalError(f"{self.path} is not a deltaserve journal", 0)
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        yield self._header(data)
        offset = len(MAGIC) + _PREFIX.size + _PREFIX.unpack_from(data, len(MAGIC))[0]
        while offset < len(data):
            record = self._record(data, offset)
            yield record
            offset += _RECORD.size + len(record.frame)

    @property
    def header(self) -> JournalHeader:
        return next(iter(self))

    def records(self) -> Iterator[JournalRecord]:
        it = iter(self)
        next(it)
        return it

    def _header(self, data: bytes) -> JournalHeader:
        if data[:len(MAGIC)] != MAGIC:
            raise JournalError(f"{self.path} is not a deltaserve journal", 0)
        if len(data) < len(MAGIC) + _PREFIX.size:
            raise JournalError("truncated header", len(MAGIC))
        size, crc = _PREFIX.unpack_from(data, len(MAGIC))
        start = len(MAGIC) + _PREFIX.size
        head = data[start:start + size]
        if len(head) < size or zlib.crc32(head) != crc:
            raise JournalError("truncated or corrupted header", len(MAGIC))
        return msgspec.msgpack.decode(head, type=JournalHeader)

    def _record(self, data: bytes, offset: int) -> JournalRecord:
        if offset + _RECORD.size > len(data):
            raise JournalError("truncated record header", offset)
        size, crc, channel, peer, step, ts = _RECORD.unpack_from(data, offset)
        start = offset + _RECORD.size
        frame = bytes(data[start:start + size])
        if len(frame) < size:
            raise JournalError(f"truncated frame ({len(frame)} of {size} bytes)", offset)
        meta = data[offset + 8:start]
        if zlib.crc32(frame, zlib.crc32(meta)) != crc or channel not in _CHANNELS:
            raise JournalError("checksum mismatch (corrupted record)", offset)
        channel = Channel(channel)
        try:
            return JournalRecord(offset, channel, peer, step, ts, frame,
                                 self._codecs[channel].decode(frame))
        except ProtocolError as e:  # recorded as received: the engine dropped it too
            return JournalRecord(offset, channel, peer, step, ts, frame, None, str(e))


_CHANNELS = {int(c) for c in Channel}
