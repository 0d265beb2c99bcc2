"""The base of every message that crosses a process boundary."""
from __future__ import annotations

import msgspec


class WireStruct(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Encoded as a msgpack array in field order (no field names on the wire); untracked by
    the garbage collector, since messages hold no reference cycles. Subclasses inherit this."""
