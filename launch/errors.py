"""Errors the front-end raises."""
from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine can no longer serve; `process` names the process that died or failed, and
    `replica` the data-parallel replica it belonged to (None with a single engine)."""

    def __init__(self, message: str, process: str = "engine_core",
                 replica: int | None = None) -> None:
        super().__init__(message)
        self.process = process
        self.replica = replica
