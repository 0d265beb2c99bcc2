"""Logging what a flood of bad input does without the log itself becoming the flood."""
from __future__ import annotations

import logging


class LogLimiter:
    """Logs the first `first` events of a kind, then every `every`-th, with a running count."""

    def __init__(self, logger: logging.Logger, where: str, first: int = 10,
                 every: int = 1000) -> None:
        self.logger, self.where, self.first, self.every = logger, where, first, every
        self.count = 0

    def warn(self, message: str) -> None:
        self._log(logging.WARNING, message)

    def info(self, message: str) -> None:
        self._log(logging.INFO, message)

    def _log(self, level: int, message: str) -> None:
        self.count += 1
        if self.count <= self.first or self.count % self.every == 0:
            suffix = f" [{self.count} so far]" if self.count > self.first else ""
            self.logger.log(level, "%s: %s%s", self.where, message, suffix)
