"""The worker refuses step messages that contradict its state, instead of guessing."""
from __future__ import annotations

import pytest
from model_utils import make_tiny_model

from protocol import (
    CachedRequestData,
    EngineConfig,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)
from worker.input_batch import StepProtocolError
from worker.model_runner import ModelRunner


@pytest.fixture(scope="module")
def runner_factory(tmp_path_factory):
    path = make_tiny_model(str(tmp_path_factory.mktemp("m") / "model"), "llama")
    return lambda: ModelRunner(EngineConfig(model=path, num_gpu_blocks_override=32,
                                            max_model_len=128))


def _new(handle: int, prompt: list[int], blocks: list[int]) -> NewRequestData:
    return NewRequestData(handle, f"r{handle}", prompt, SamplingParams(temperature=0.0),
                          blocks)


def _first_step(runner):
    so = SchedulerOutput([_new(0, [1, 2, 3], [1])], num_scheduled_tokens={0: 3},
                         total_num_scheduled_tokens=3, step=1)
    out = runner.execute_model(so)
    assert out.req_ids == [0] and len(out.sampled_token_ids[0]) == 1


def _cached(step: int, computed: int, handle: int = 0, blocks=None) -> SchedulerOutput:
    return SchedulerOutput(scheduled_cached_reqs=CachedRequestData([handle], [computed], [blocks]),
                           num_scheduled_tokens={handle: 1}, total_num_scheduled_tokens=1,
                           step=step)


def test_step_gap(runner_factory):
    runner = runner_factory()
    _first_step(runner)
    with pytest.raises(StepProtocolError, match="expected step 2, got step 3"):
        runner.execute_model(_cached(3, 3))


@pytest.mark.parametrize("so,message", [
    (_cached(2, 3, handle=5), "unknown request handle 5"),
    (_cached(2, 2), "has 3 computed tokens here, the scheduler says 2"),
    (SchedulerOutput([_new(0, [4], [2])], num_scheduled_tokens={0: 1},
                     total_num_scheduled_tokens=1, step=2), "already live"),
    (SchedulerOutput(scheduled_cached_reqs=CachedRequestData([0], [3], [None]),
                     num_scheduled_tokens={0: 2}, total_num_scheduled_tokens=2, step=2),
     "scheduled up to 5 of 4 known tokens"),
    (SchedulerOutput([_new(1, list(range(20)), [2])], num_scheduled_tokens={1: 20},
                     total_num_scheduled_tokens=20, step=2), "too few KV blocks"),
])
def test_contradicting_steps_are_refused(runner_factory, so, message):
    runner = runner_factory()
    _first_step(runner)
    with pytest.raises(StepProtocolError, match=message):
        runner.execute_model(so)


def test_finish_then_reuse_handle(runner_factory):
    runner = runner_factory()
    _first_step(runner)
    so = SchedulerOutput([_new(0, [9, 9], [3])], num_scheduled_tokens={0: 2},
                         total_num_scheduled_tokens=2, finished_req_ids=[0], step=2)
    assert runner.execute_model(so).req_ids == [0]
