"""What one batch of engine outputs changed, for stat loggers (the Prometheus metrics)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from protocol import SchedulerStats


@dataclass
class FinishedRequest:
    finish_reason: str
    e2e_s: float
    queue_s: float | None  # None when the engine core did not report when it was scheduled


@dataclass
class IterationStats:
    """Counts and latencies of the outputs the front-end received at `time` (time.time()).

    A request's first output yields a TTFT (and counts its prompt tokens); each later output
    with tokens yields one inter-token latency (the gap since its previous one); each finished
    sequence yields its finish reason, and a finished request its end-to-end latency."""

    time: float
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    ttfts_s: list[float] = field(default_factory=list)
    itls_s: list[float] = field(default_factory=list)
    finished_reasons: list[str] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)
    scheduler: SchedulerStats | None = None
    engine: int = 0  # the data-parallel rank of the replica these outputs came from
    # With LoRA requests in the front-end: adapter name -> requests not yet scheduled
    # (waiting) and scheduled (running), as vLLM's LoRARequestStates counts them.
    lora: LoRAStats | None = None


@dataclass
class LoRAStats:
    waiting: dict[str, int] = field(default_factory=dict)
    running: dict[str, int] = field(default_factory=dict)


class StatLogger(Protocol):
    def record(self, stats: IterationStats) -> None: ...
