"""Small integer handles that name requests on the scheduler-to-worker wire."""
from __future__ import annotations

import heapq


class HandleAllocator:
    """Hands out the lowest free handle, so handles stay small (one msgpack byte below 128).

    A released handle is reusable only after the step message that reports it finished has
    been built, so a worker never sees one handle name two live requests.
    """

    def __init__(self) -> None:
        self._free: list[int] = []
        self._next = 0

    def allocate(self) -> int:
        if self._free:
            return heapq.heappop(self._free)
        self._next += 1
        return self._next - 1

    def release(self, handles: list[int]) -> None:
        for handle in handles:
            heapq.heappush(self._free, handle)

    @property
    def bound(self) -> int:
        """Every handle given out so far is below this."""
        return self._next

