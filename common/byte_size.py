"""Byte counts as log lines show them."""
from __future__ import annotations


def byte_size(size: int) -> str:
    """`size` bytes for a log line: GiB, MiB or KiB."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift:
            return f"{size / (1 << shift):.{2 if shift == 30 else 1}f} {unit}"
    return f"{size} B"
