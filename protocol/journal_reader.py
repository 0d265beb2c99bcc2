"""Reading a journal (layout in `protocol.journal`): the header, every record, then the
trailer that proves nothing is missing. All damage is a JournalError naming the file and
the byte offset; nothing else escapes (no OSError, no msgspec error)."""
from __future__ import annotations

import mmap
import os
import stat
import zlib
from collections.abc import Iterator

import msgspec

from protocol.codec import Channel, Codec, ProtocolError
from protocol.journal import (
    CHANNELS,
    MAGIC,
    MAGIC_STEM,
    PREFIX,
    RECORD,
    TRAILER,
    TRAILER_BODY,
    JournalError,
    JournalHeader,
    JournalRecord,
    JournalTruncated,
)

_TRAILER_KIND = bytes([TRAILER])  # a record's kind byte sits right after its PREFIX


class JournalReader:
    """Iterating yields the JournalHeader, then a JournalRecord per frame, in order, then ends
    after checking the trailer. Damage raises JournalError (JournalTruncated if the file just
    ends early); every record before it has been yielded."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._codecs = {channel: Codec(channel) for channel in Channel}

    def __iter__(self) -> Iterator[JournalHeader | JournalRecord]:
        data = self._map()
        try:
            header, offset = self._header(data)
            yield header
            crc = zlib.crc32(data[:offset])  # of every byte before `offset`
            count = 0
            while data[offset + PREFIX.size:offset + PREFIX.size + 1] != _TRAILER_KIND:
                record = self._record(data, offset, count)
                yield record
                crc = zlib.crc32(record.frame, zlib.crc32(data[offset:offset + RECORD.size], crc))
                offset, count = offset + RECORD.size + len(record.frame), count + 1
            self._trailer(data, offset, count, crc)
        finally:
            data.close()

    @property
    def header(self) -> JournalHeader:
        return next(iter(self))

    def records(self) -> Iterator[JournalRecord]:
        it = iter(self)
        next(it)
        return it

    def _map(self) -> mmap.mmap:
        """The file, mapped; file-level problems become one-line JournalErrors."""
        try:
            mode = os.stat(self.path).st_mode
            if stat.S_ISDIR(mode):
                raise JournalError(self.path, "is a directory, not a journal file", None)
            if not stat.S_ISREG(mode):
                raise JournalError(self.path, "is not a regular file", None)
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size < len(MAGIC):
                    raise JournalError(self.path, "is not a deltaserve journal (shorter than "
                                       "its magic)", 0)
                return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            raise JournalError(self.path, "no such file", None) from None
        except OSError as e:
            raise JournalError(self.path, f"cannot be read ({e.strerror or e})", None) from None

    def _header(self, data: mmap.mmap) -> tuple[JournalHeader, int]:
        """The header and the offset of the first record."""
        magic = data[:len(MAGIC)]
        if magic != MAGIC:
            if magic.startswith(MAGIC_STEM):
                raise JournalError(self.path, f"journal format {magic.decode(errors='replace')} "
                                   f"is not readable by this deltaserve (it reads "
                                   f"{MAGIC.decode()}; record the run again)", 0)
            raise JournalError(self.path, f"is not a deltaserve journal (bad magic {magic!r})",
                               0)
        start = len(MAGIC) + PREFIX.size
        if len(data) < start:
            raise JournalTruncated(self.path, "truncated inside the header prefix", len(data))
        size, crc = PREFIX.unpack_from(data, len(MAGIC))
        if start + size > len(data):
            raise JournalError(self.path, f"truncated or corrupted header (it declares {size} "
                               f"bytes, the file ends at byte offset {len(data)})", len(MAGIC))
        head = data[start:start + size]
        if zlib.crc32(head) != crc:
            raise JournalError(self.path, "corrupted header (checksum mismatch)", start)
        try:
            return msgspec.msgpack.decode(head, type=JournalHeader), start + size
        except msgspec.MsgspecError as e:
            raise JournalError(self.path, f"the header is not a JournalHeader ({e})",
                               start) from None

    def _record(self, data: mmap.mmap, offset: int, count: int) -> JournalRecord:
        if offset + RECORD.size > len(data):
            self._truncated(data, offset, count)
        size, crc, channel, peer, step, ts = RECORD.unpack_from(data, offset)
        start = offset + RECORD.size
        if start + size > len(data):
            self._truncated(data, offset, count)
        frame = data[start:start + size]
        if zlib.crc32(frame, zlib.crc32(data[offset + PREFIX.size:start])) != crc:
            raise JournalError(self.path, "checksum mismatch (corrupted record)", offset)
        if channel not in CHANNELS:
            raise JournalError(self.path, f"unknown record kind {channel} (corrupted record)",
                               offset)
        channel = Channel(channel)
        try:
            return JournalRecord(offset, channel, peer, step, ts, frame,
                                 self._codecs[channel].decode(frame))
        except ProtocolError as e:  # recorded as received: the engine dropped it too
            return JournalRecord(offset, channel, peer, step, ts, frame, None, str(e))

    def _truncated(self, data: mmap.mmap, offset: int, count: int) -> None:
        """The file ends at or inside the record at `offset`: no trailer, unless the file
        ends with a sound one and this record's length is what is damaged."""
        if offset == len(data):
            detail = f"no trailer after {count} records; the recording was not closed"
        elif self._ends_with_trailer(data):
            raise JournalError(self.path, "corrupted record (its length runs past the end of "
                               "the journal)", offset)
        else:
            what = ("the trailer" if data[offset + PREFIX.size:offset + PREFIX.size + 1]
                    == _TRAILER_KIND else f"record {count + 1}")
            detail = (f"the file ends inside {what}, which starts at byte offset {offset}; "
                      f"{count} records before it are intact")
        raise JournalTruncated(self.path, f"truncated ({detail})", len(data))

    @staticmethod
    def _ends_with_trailer(data: mmap.mmap) -> bool:
        """Whether the file's last bytes are a trailer record with a valid checksum."""
        start = len(data) - RECORD.size - TRAILER_BODY.size
        if start < 0:
            return False
        size, crc, kind = RECORD.unpack_from(data, start)[:3]
        return kind == TRAILER and size == TRAILER_BODY.size and crc == zlib.crc32(
            data[start + PREFIX.size:])

    def _trailer(self, data: mmap.mmap, offset: int, count: int, crc: int) -> None:
        """Check the trailer at `offset` against the `count` records and the `crc` of every
        byte before it; it must end the file."""
        end = offset + RECORD.size + TRAILER_BODY.size
        if end > len(data):
            self._truncated(data, offset, count)
        size, record_crc = PREFIX.unpack_from(data, offset)
        body = data[offset + RECORD.size:end]
        if size != TRAILER_BODY.size or record_crc != zlib.crc32(
                body, zlib.crc32(data[offset + PREFIX.size:offset + RECORD.size])):
            raise JournalError(self.path, "corrupted trailer (checksum mismatch)", offset)
        recorded_count, recorded_crc = TRAILER_BODY.unpack(body)
        if recorded_count != count:
            raise JournalError(self.path, f"corrupted journal: the trailer counts "
                               f"{recorded_count} records, {count} precede it", offset)
        if recorded_crc != crc:
            raise JournalError(self.path, "corrupted journal: the bytes before the trailer do "
                               "not match its checksum", offset)
        if end != len(data):
            raise JournalError(self.path, f"{len(data) - end} unexpected bytes after the "
                               "trailer", end)
