"""The priority policy: order, victim choice, and resumption after preemption."""
from __future__ import annotations

from sched_utils import make_requests, make_scheduler, sample, scheduled_ids

from engine_core.request import RequestStatus


def _priority_scheduler(**kwargs):
    return make_scheduler(policy="priority", **kwargs)


def test_scheduled_in_priority_then_arrival_order():
    scheduler = _priority_scheduler(max_num_seqs=4)
    for r in make_requests(4, priorities=[2, 1, 1, 0], arrival_times=[1, 3, 2, 4]):
        scheduler.add_request(r)
    so = scheduler.schedule()
    assert [r.request_id for r in so.scheduled_new_reqs] == ["3", "2", "1", "0"]


def test_limited_slots_leave_low_priority_waiting():
    scheduler = _priority_scheduler(max_num_seqs=2)
    for r in make_requests(4, priorities=[3, 1, 2, 0]):
        scheduler.add_request(r)
    so = scheduler.schedule()
    assert list(scheduled_ids(so, scheduler)) == ["3", "1"]
    assert [r.request_id for r in scheduler.waiting] == ["2", "0"]


def test_one_at_a_time_runs_in_priority_order():
    scheduler = _priority_scheduler(max_num_seqs=1)
    for r in make_requests(8, priorities=[5, 1, 8, 3, 2, 7, 4, 6], max_tokens=1):
        scheduler.add_request(r)
    order = []
    while scheduler.has_unfinished_requests():
        so = scheduler.schedule()
        order += [r.sampling_params and r.request_id for r in so.scheduled_new_reqs]
        scheduler.update_from_output(so, sample(so, scheduler))
    priorities = {str(i): p for i, p in enumerate([5, 1, 8, 3, 2, 7, 4, 6])}
    assert [priorities[i] for i in order] == sorted(priorities.values())


def test_high_priority_request_preempts_the_lowest():
    scheduler = _priority_scheduler(num_blocks=6, max_num_batched_tokens=64)  # 5 usable
    low, high = make_requests(2, num_tokens=32, priorities=[5, 0], max_tokens=10)
    scheduler.add_request(low)
    so = scheduler.schedule()
    scheduler.update_from_output(so, sample(so, scheduler))  # low: 33 tokens, 3 blocks
    scheduler.add_request(high)
    so = scheduler.schedule()  # low decodes; high is admitted with the last 2 blocks
    assert scheduled_ids(so, scheduler) == {"0": 1, "1": 32}
    scheduler.update_from_output(so, sample(so, scheduler))
    so = scheduler.schedule()  # high needs a 3rd block: low (already scheduled) is the victim
    assert so.preempted_req_ids == [low.req_id] and scheduled_ids(so, scheduler) == {"1": 1}
    assert low.status == RequestStatus.PREEMPTED and scheduler.running == [high]
    assert so.total_num_scheduled_tokens == 1

    while high.status == RequestStatus.RUNNING:
        scheduler.update_from_output(so, sample(so, scheduler))
        so = scheduler.schedule()
    cached = so.scheduled_cached_reqs
    assert cached.req_ids.tolist() == [low.req_id] and cached.resumed_req_ids == [low.req_id]
    assert low.num_tokens == 34 and low.output_token_ids == [100, 100]


def test_no_preemption_when_space_is_available():
    scheduler = _priority_scheduler(max_num_seqs=3)
    for r in make_requests(3, priorities=[2, 2, 0]):
        scheduler.add_request(r)
    so = scheduler.schedule()
    assert so.preempted_req_ids == [] and len(scheduler.running) == 3
