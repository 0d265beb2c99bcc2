"""The message journal: every frame the engine core sends and receives, byte for byte.

File layout (integers little-endian):
    b"DSJRNL02"                     magic: b"DSJRNL" and the two-digit format version
    u32 header length | u32 crc32(header) | header (msgpack JournalHeader)
    records, each:  u32 body length | u32 crc32(meta + body) | meta | body
        meta = u8 kind | u8 peer | u64 step | u64 monotonic ns      (22 bytes)
        kind is a Channel (1..4) and body the frame as sent or received,
    then exactly one trailer, the last bytes of the file: a record of kind TRAILER whose body is
        u64 record count | u32 crc32(every byte of the file before the trailer)
`peer` is the worker rank a frame came from or went to (ALL_PEERS for a step broadcast to
every rank, NO_PEER on front-end channels and in the trailer, ENGINE_CORE for an input the
engine core made itself, such as `GrammarsCompiled`, recorded on the front-end channel).

Invariants: a journal is complete iff it ends with a trailer whose count and checksum agree
with the bytes before it. The trailer is written only by close(), after the last record, so a
recording that was killed (or is still running) is a truncated journal: every record written
so far reads back, and the reader says where the file ends. Records are appended by a
background thread, so the step loop never waits on the disk; the buffer is flushed every
FLUSH_S and on close. Reading lives in `protocol.journal_reader`.
"""
from __future__ import annotations

import queue
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Any

import msgspec

from protocol.codec import Channel
from protocol.engine_config import EngineConfig

MAGIC_STEM = b"DSJRNL"
VERSION = b"02"
MAGIC = MAGIC_STEM + VERSION
ENGINE_CORE, ALL_PEERS, NO_PEER = 253, 254, 255
TRAILER = 0xFF  # the record kind of the trailer: never a Channel
FLUSH_S = 0.1
RECORD = struct.Struct("<IIBBQQ")  # length, crc, kind, peer, step, timestamp_ns
META = struct.Struct("<BBQQ")  # kind, peer, step, timestamp_ns: the record's bytes 8..30
PREFIX = struct.Struct("<II")  # header length, crc
TRAILER_BODY = struct.Struct("<QI")  # record count, crc32 of every byte before the trailer
CHANNELS = frozenset(int(c) for c in Channel)
_DIRECTIONS = {Channel.FRONTEND_TO_CORE: ("in", "frontend"),
               Channel.CORE_TO_FRONTEND: ("out", "frontend"),
               Channel.CORE_TO_WORKER: ("out", "worker"),
               Channel.WORKER_TO_CORE: ("in", "worker")}


class JournalError(Exception):
    """A journal that cannot be read as it should: one line naming the file and, when the
    damage is inside the file, the byte offset where it starts (`offset`, else None)."""

    def __init__(self, path: str, message: str, offset: int | None) -> None:
        where = "" if offset is None else f" at byte offset {offset}"
        super().__init__(f"{path}: {message}{where}")
        self.path, self.offset = path, offset


class JournalTruncated(JournalError):
    """The journal ends without its trailer; `offset` is where the file ends. Every record
    before the incomplete one (if any) is intact."""


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
    """Appends records on its own thread; close() writes the trailer and makes the journal
    complete. Only the writer thread touches the file after __init__."""

    def __init__(self, path: str, header: JournalHeader) -> None:
        self._file = open(path, "wb")
        head = msgspec.msgpack.encode(header)
        start = MAGIC + PREFIX.pack(len(head), zlib.crc32(head)) + head
        self._file.write(start)
        self._crc = zlib.crc32(start)  # of every byte written so far
        self._count = 0  # records written, the trailer excluded
        self._last_step = 0
        self._closed = False
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._drain, name="journal", daemon=True)
        self._thread.start()

    def record(self, channel: Channel, frame: bytes | bytearray, step: int,
               peer: int = NO_PEER) -> None:
        """Cheap on the caller's side: the frame is packed and written by the thread."""
        self._queue.put((channel, peer, step, time.monotonic_ns(), bytes(frame)))

    def close(self) -> None:
        """Write what is queued, then the trailer. Idempotent; records after it are dropped."""
        if self._closed:
            return
        self._closed = True
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
                self._write(TRAILER, NO_PEER, self._last_step, time.monotonic_ns(),
                            TRAILER_BODY.pack(self._count, self._crc))
                self._file.flush()
                return
            if item is not ...:
                channel, peer, step, ts, frame = item
                self._write(channel, peer, step, ts, frame)
                self._count += 1
                self._last_step = max(self._last_step, step)
            if time.monotonic() - last_flush >= FLUSH_S:
                self._file.flush()
                last_flush = time.monotonic()

    def _write(self, kind: int, peer: int, step: int, ts: int, body: bytes) -> None:
        meta = META.pack(kind, peer, step, ts)
        prefix = PREFIX.pack(len(body), zlib.crc32(body, zlib.crc32(meta))) + meta
        self._file.write(prefix)
        self._file.write(body)
        self._crc = zlib.crc32(body, zlib.crc32(prefix, self._crc))
