"""Waiting queues: FCFS and priority order, prepend and removal."""
from __future__ import annotations

from sched_utils import make_requests

from engine_core.sched.request_queue import FCFSRequestQueue, PriorityRequestQueue


def _ids(queue) -> list[str]:
    return [r.request_id for r in queue]


def test_fcfs_order_prepend_remove():
    queue = FCFSRequestQueue()
    a, b, c = make_requests(3)
    for r in (a, b, c):
        queue.add(r)
    assert _ids(queue) == ["0", "1", "2"] and queue.peek() is a
    queue.remove(b)
    queue.prepend(b)
    assert _ids(queue) == ["1", "0", "2"]
    assert queue.pop() is b and len(queue) == 2


def _drain(queue) -> list[str]:
    out = []
    while len(queue):
        out.append(queue.pop().request_id)
    return out


def test_priority_basic_and_tiebreaks():
    cases = [
        ([2, 0, 1], [0, 1, 2], ["1", "2", "0"]),
        ([0, 0, 0], [3, 1, 2], ["1", "2", "0"]),
        ([2, 1, 1, 0], [1, 3, 2, 4], ["3", "2", "1", "0"]),
        ([1, 1, 1, 1], [4, 1, 3, 2], ["1", "3", "2", "0"]),
    ]
    for priorities, arrivals, expected in cases:
        queue = PriorityRequestQueue()
        for r in make_requests(len(priorities), priorities=priorities, arrival_times=arrivals):
            queue.add(r)
        assert _ids(queue) == expected  # iteration is ordered too
        assert _drain(queue) == expected


def test_priority_remove_is_lazy_but_exact():
    queue = PriorityRequestQueue()
    reqs = make_requests(5, priorities=[5, 1, 8, 3, 2])
    for r in reqs:
        queue.add(r)
    queue.remove(reqs[1])
    queue.remove(reqs[4])
    assert len(queue) == 3 and queue.peek() is reqs[3]
    queue.add(reqs[1])
    assert _drain(queue) == ["1", "3", "0", "2"]
