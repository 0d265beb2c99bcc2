"""The JSON-lines loop a peer script (`_vllm_peer.py`, `_llamacpp_peer.py`) runs under another
Python: one request per stdin line `{"op": ..., **kwargs}`, one reply per stdout line
`{"ok": true, **result}` or `{"ok": false, "error": ...}`; `{"op": "quit"}` ends it. The
peer's own output (Python and C level) goes to stderr, so stdout carries replies only."""
from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any


def serve(ops: dict[str, Callable[..., dict[str, Any]]]) -> None:
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for line in sys.stdin:
        request = json.loads(line)
        op = request.pop("op")
        if op == "quit":
            break
        try:
            reply = {"ok": True, **ops[op](**request)}
        except Exception as exc:  # noqa: BLE001 (reported to the driver, which raises it)
            traceback.print_exc()
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()
