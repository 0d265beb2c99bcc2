"""The request ids in a front-end frame the engine core cannot decode, so that every request
still gets an answer (an error) rather than silence."""
from __future__ import annotations

import msgspec

from protocol.codec import HEADER

_ADD_REQUEST_TAG, _ADD_REQUESTS_TAG = 10, 13  # AddRequest, AddRequests (engine_messages.py)
_MAX_IDS, _MAX_ID_CHARS = 100_000, 1024


def readable_request_ids(frame: bytes) -> list[str]:
    """Ids of the AddRequest(s) in `frame` whose id field is still a string (none if even the
    msgpack is unreadable). Bounded: a hostile frame cannot make this expensive."""
    if len(frame) < len(HEADER):
        return []
    try:
        payload = msgspec.msgpack.decode(memoryview(frame)[len(HEADER):])
    except (msgspec.DecodeError, ValueError):  # ValueError: e.g. invalid UTF-8 in a string
        return []
    if not isinstance(payload, list) or not payload:
        return []
    if payload[0] == _ADD_REQUEST_TAG:
        items = [payload]
    elif payload[0] == _ADD_REQUESTS_TAG and len(payload) > 1 and isinstance(payload[1], list):
        items = payload[1][:_MAX_IDS]
    else:
        return []
    return [item[1] for item in items
            if isinstance(item, list) and len(item) > 1 and isinstance(item[1], str)
            and len(item[1]) <= _MAX_ID_CHARS]
