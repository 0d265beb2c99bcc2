"""Stored responses (`store: true`), for `previous_response_id`, `GET` and `DELETE
/v1/responses/{id}`: in memory, least recently used first out, bounded by a count and by
bytes (each record counted as its JSON size). A response bigger than the byte bound is not
kept. What is gone (evicted, deleted, never stored, or the server restarted) is a 404 that
says so."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec

from launch.entrypoints.openai.errors import APIError

DEFAULT_MAX_RESPONSES = 1024
DEFAULT_MAX_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict[str, Any]  # the response object, as returned
    items: list[dict[str, Any]]  # the conversation it answered (input items, in order)
    size: int  # bytes counted against the bound

    @property
    def history(self) -> list[dict[str, Any]]:
        """The conversation including this response's output: what a follow-up continues."""
        return [*self.items, *self.response["output"]]


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.bytes = 0
        self._records: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def put(self, response: dict[str, Any], items: list[dict[str, Any]]) -> bool:
        """Keep a finished response (evicting the least recently used to fit); False when
        it alone exceeds the byte bound."""
        size = len(msgspec.json.encode([response, items]))
        if size > self.max_bytes or self.max_responses <= 0:
            return False
        self.delete(response["id"])
        while self._records and (len(self._records) >= self.max_responses
                                 or self.bytes + size > self.max_bytes):
            _, old = self._records.popitem(last=False)
            self.bytes -= old.size
        self._records[response["id"]] = StoredResponse(response, items, size)
        self.bytes += size
        return True

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        record = self._records.get(response_id)
        if record is None:
            raise APIError(404, f"the response {response_id!r} is not stored on this server: "
                           "it was never stored (store: false), was deleted, or was evicted "
                           f"(this server keeps the {self.max_responses} most recently used "
                           f"responses, {self.max_bytes} bytes at most)", param)
        self._records.move_to_end(response_id)
        return record

    def delete(self, response_id: str) -> bool:
        record = self._records.pop(response_id, None)
        if record is not None:
            self.bytes -= record.size
        return record is not None
