"""Errors the front-end raises."""
from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine can no longer serve; `process` names the process that died or failed."""

    def __init__(self, message: str, process: str = "engine_core") -> None:
        super().__init__(message)
        self.process = process
