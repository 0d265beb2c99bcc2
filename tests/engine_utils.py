"""Helpers for tests that run the real multi-process engine."""
from __future__ import annotations

import time

import psutil

from launch import LLM


def engine_pids(llm: LLM) -> list[int]:
    """The engine core and every process it started."""
    core = psutil.Process(llm.engine.proc.pid)
    return [core.pid] + [p.pid for p in core.children(recursive=True)]


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """The pids still alive (and not zombies) after waiting up to timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [pid for pid in pids if _alive(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def titles(pids: list[int]) -> list[str]:
    return [" ".join(psutil.Process(pid).cmdline()).strip() for pid in pids]
