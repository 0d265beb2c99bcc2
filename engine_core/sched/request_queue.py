"""Waiting queues: arrival order (fcfs) or (priority, arrival) order. Iteration is ordered."""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from engine_core.request import Request


class FCFSRequestQueue:
    """Arrival order; preempted requests go back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue:
    """Lowest `priority` value first, then earliest arrival, then insertion order.

    A binary heap of `(priority, arrival_time, seq, request)`; `seq` is a counter, so ties
    never compare requests and the order is deterministic. Removal is lazy: removed entries
    are skipped when they reach the top.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()
        self._removed: set[int] = set()  # seq numbers of removed entries (never iterated)
        self._seq_of: dict[int, int] = {}  # id(request) -> seq of its live entry

    def add(self, request: Request) -> None:
        seq = next(self._seq)
        self._seq_of[id(request)] = seq
        heapq.heappush(self._heap, (request.priority, request.arrival_time, seq, request))

    prepend = add  # a preempted request's place follows from its priority and arrival

    def peek(self) -> Request:
        self._drop_removed()
        return self._heap[0][3]

    def pop(self) -> Request:
        self._drop_removed()
        request = heapq.heappop(self._heap)[3]
        del self._seq_of[id(request)]
        return request

    def remove(self, request: Request) -> None:
        self._removed.add(self._seq_of.pop(id(request)))

    def _drop_removed(self) -> None:
        while self._heap and self._heap[0][2] in self._removed:
            self._removed.discard(heapq.heappop(self._heap)[2])

    def __len__(self) -> int:
        return len(self._seq_of)

    def __iter__(self) -> Iterator[Request]:
        live = (entry for entry in self._heap if entry[2] not in self._removed)
        return (entry[3] for entry in sorted(live, key=lambda e: e[:3]))


def create_request_queue(policy: str) -> FCFSRequestQueue | PriorityRequestQueue:
    return PriorityRequestQueue() if policy == "priority" else FCFSRequestQueue()
