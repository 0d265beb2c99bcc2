"""The scheduler's self-audit: every invariant the soak tests check after each step."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import numpy as np

from engine_core.kv_cache.block_pool import IntegrityError
from engine_core.kv_cache.kv_cache_manager import KVCacheManager
from engine_core.request import Request, RequestStatus
from engine_core.sched.request_table import RequestTable

_QUEUED = (RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.WAITING_FOR_GRAMMAR)


class AuditedScheduler(Protocol):
    """What the audit reads of a `Scheduler`."""

    running: list[Request]
    waiting: Iterable[Request]
    requests: dict[str, Request]
    requests_by_handle: dict[int, Request]
    table: RequestTable
    kv_cache_manager: KVCacheManager
    _handles_of_running: np.ndarray | None
    num_blocked: int
    num_held: int


def audit_scheduler(scheduler: AuditedScheduler) -> None:
    """Raise IntegrityError if the queues, the request table or the block pool disagree."""
    running, queued = scheduler.running, list(scheduler.waiting)
    if any(r.status != RequestStatus.RUNNING for r in running) or any(
            r.status not in _QUEUED for r in queued):
        raise IntegrityError("a queued request has the wrong status")
    ids = [r.request_id for r in running + queued]
    if sorted(ids) != sorted(scheduler.requests):
        raise IntegrityError("running + waiting do not match the known requests")
    if sum(r.status == RequestStatus.WAITING_FOR_GRAMMAR for r in queued) != \
            scheduler.num_blocked:
        raise IntegrityError("the count of requests waiting for grammars is stale")
    if sum(r.mask_late for r in running + queued) != scheduler.num_held:
        raise IntegrityError("the count of requests waiting for masks is stale")
    if any(r.num_computed_tokens > r.num_tokens + r.num_output_placeholders for r in running):
        raise IntegrityError("a request computed more tokens than it has")
    cached = scheduler._handles_of_running
    if cached is not None and cached.tolist() != [r.req_id for r in running]:
        raise IntegrityError("the cached handles of running requests are stale")
    mismatches = scheduler.table.check(list(scheduler.requests_by_handle.values()),
                                       scheduler.kv_cache_manager)
    if mismatches:
        raise IntegrityError(f"request table disagrees: {mismatches[:3]}")
    scheduler.kv_cache_manager.check_integrity()
