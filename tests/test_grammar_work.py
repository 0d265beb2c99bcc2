"""Grammar work bounded and fair (issue 30), in-process: the work lanes (separate queues,
cancelled queued jobs, a thread that overstays hands its lane on, niced threads), the
front-end's constraint checks (every failure a 400 naming the field, cached; busy when the
deadline passes in the queue), failed grammars cached as failures in the engine core, and
the scheduler holding a request whose mask is late."""
from __future__ import annotations

import os
import threading
import time

import pytest
from model_utils import save_tiny_tokenizer

from common.work_lanes import WorkLanes
from engine_core import CacheConfig, Request, Scheduler, SchedulerConfig
from engine_core.structured_output.grammar_compiler import GrammarCompiler
from engine_core.structured_output.grammar_limits import GrammarLimits, explain
from engine_core.structured_output.grammar_validator import GrammarBusyError, GrammarValidator
from protocol import ModelRunnerOutput, SamplingParams, StructuredOutputsError
from protocol import StructuredOutputsParams as S

EOS = 0
ALTERNATIVES = "start: x\nx: " + " | ".join(f'"w{i}"' for i in range(2500))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    save_tiny_tokenizer(str(path))
    return str(path)


@pytest.fixture(scope="module")
def validator(model_dir):
    validator = GrammarValidator(model_dir, None, EOS, timeout_s=60.0)
    yield validator
    validator.shutdown()


# --- lanes ------------------------------------------------------------------------------------

def test_a_lane_never_waits_behind_another_and_queued_jobs_cancel():
    lanes = WorkLanes({"small": (1, 0), "big": (1, 0)}, "test")
    gate = threading.Event()
    big = [lanes.submit("big", gate.wait) for _ in range(3)]
    small = lanes.submit("small", lambda: "done")
    assert lanes.wait([small], time.monotonic() + 10) and small.result == "done"
    deadline = time.monotonic() + 10  # the big lane's thread may not have taken its first job
    while big[0].started is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not big[0].done and lanes.cancel(big[2]) and not lanes.cancel(big[0])
    gate.set()
    assert lanes.wait(big[:2], time.monotonic() + 10)
    assert big[2].cancelled and big[2].started is None
    lanes.shutdown()


def test_an_overdue_job_hands_its_lane_to_a_new_niced_away_thread():
    lanes = WorkLanes({"only": (1, 5)}, "test", overdue_s=0.05, max_overdue=1)
    gate, tids = threading.Event(), []

    def stuck() -> None:
        tids.append(threading.get_native_id())
        gate.wait()
    first = lanes.submit("only", stuck)
    queued = lanes.submit("only", threading.get_native_id)
    time.sleep(0.2)
    lanes.check_overdue()
    assert lanes.wait([queued], time.monotonic() + 10) and not first.done
    assert queued.result != tids[0]  # served by a fresh thread
    if hasattr(os, "getpriority"):
        assert os.getpriority(os.PRIO_PROCESS, tids[0]) >= 5
    third = lanes.submit("only", lambda: 3)  # at max_overdue: the lane still serves
    assert lanes.wait([third], time.monotonic() + 10)
    gate.set()
    assert lanes.wait([first], time.monotonic() + 10)
    lanes.shutdown()


# --- the front-end's checks ---------------------------------------------------------------------

@pytest.mark.parametrize("params, field, words", [
    (S(json={"$ref": "#"}), "json", "admits no output at all"),
    (S(json={"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
             "$ref": "#/$defs/a"}), "json", "admits no output at all"),
    (S(regex=r"[^\s\S]"), "regex", "admits no output at all"),
    (S(grammar='start: "a" <|nonexistent|>'), "grammar", "unknown special token"),
    (S(grammar="start: <[99999999]>"), "grammar", "Token range end too large"),
    (S(grammar=ALTERNATIVES), "grammar", "--structured-outputs-max-items-in-row"),
    (S(json={"type": "string", "minLength": 5, "maxLength": 2}), "json", "Unsatisfiable"),
])
def test_what_the_grammar_engine_can_tell_is_a_refusal_naming_the_field(
        validator, params, field, words):
    with pytest.raises(StructuredOutputsError, match=words) as error:
        validator.check(params)
    assert error.value.field == field
    with pytest.raises(StructuredOutputsError, match=words):  # cached: the same answer
        validator.verdict(params)


def test_valid_constraints_pass_and_are_cached(validator):
    for params in (S(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
                   S(json_object=True), S(regex="(ab)+c"), S(choice=["x", "y"]),
                   S(grammar='start: "on" | "off"')):
        validator.check(params)
        assert validator.verdict(params)


def test_a_check_still_queued_at_its_deadline_is_busy(model_dir):
    validator = GrammarValidator(model_dir, None, EOS, timeout_s=0.3)
    gate = threading.Event()
    validator.lanes.submit("small", gate.wait)  # the lane is taken
    try:
        with pytest.raises(GrammarBusyError, match="busy"):
            validator.check(S(regex="[0-9]+"))
        assert validator.lanes.queued("small") == 0  # nobody waits: dropped
    finally:
        gate.set()
    validator.check(S(regex="[0-9]+"))  # and checked later
    validator.shutdown()


def test_a_check_that_runs_past_its_deadline_is_too_complex_for_good(model_dir):
    validator = GrammarValidator(model_dir, None, EOS, timeout_s=0.05)
    gate = threading.Event()
    validator._run = lambda params: gate.wait() and ""  # a check that takes its time
    params = S(regex="x+")
    with pytest.raises(StructuredOutputsError, match="too complex"):
        validator.check(params)
    time.sleep(0.1)
    gate.set()
    deadline = time.monotonic() + 10
    while params.key not in validator._verdicts and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(StructuredOutputsError, match="too complex"):
        validator.check(params)
    validator.shutdown()


def test_limits_are_named_in_their_errors():
    assert "--structured-outputs-lexer-fuel" in explain(
        "lexer error: too many expressions constructed\n<non-verbose/>", at_start=False)
    assert explain("NoExtensionBias\n<non-verbose/>", at_start=True).startswith(
        "admits no output")
    limits = GrammarLimits(max_items_in_row=10).parser_limits()
    assert limits.max_items_in_row == 10 and not limits.verbose_errors


# --- the engine core's compiles -----------------------------------------------------------------

def test_a_grammar_that_failed_is_cached_as_failed(model_dir):
    compiler = GrammarCompiler(model_dir, None, timeout_s=30.0)
    empty = S(regex=r"[^\s\S]")
    task = compiler.compile(empty, EOS)
    with pytest.raises(ValueError, match="admits no output at all"):
        compiler.compiled(task)
    assert compiler.compile(empty, EOS) is task  # the same answer, no new compile
    good = S(regex="(ab)+")
    compiler.compiled(compiler.compile(good, EOS))
    compiler.fail(good.key, "structured_outputs.regex exceeds the grammar engine's limits")
    assert compiler.status(compiler.compile(good, EOS)).endswith("limits")
    compiler.shutdown()


def test_a_queued_compile_nobody_waits_for_is_dropped(model_dir):
    compiler = GrammarCompiler(model_dir, None, timeout_s=30.0)
    gate = threading.Event()
    compiler.lanes.submit("small", gate.wait)
    task = compiler.compile(S(regex="q+"), EOS)
    assert "still queued" in compiler.give_up(task)
    assert compiler.compile(S(regex="q+"), EOS) is not task  # started afresh
    gate.set()
    compiler.shutdown()


# --- the scheduler ------------------------------------------------------------------------------

def _step(scheduler: Scheduler) -> list[int]:
    """Schedule a step, answer it with one token each; the handles that ran."""
    so = scheduler.schedule()
    handles = list(so.scheduled_req_ids)
    scheduler.update_from_output(so, ModelRunnerOutput(handles, [[7] for _ in handles],
                                                       step=so.step))
    return handles


def test_a_request_whose_mask_is_late_sits_out_steps_in_its_place():
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                          max_model_len=64), CacheConfig(4, 64, True))
    a, b = (Request(name, [i + 1] * 4, SamplingParams(max_tokens=20), arrival_time=float(i))
            for i, name in enumerate(("a", "b")))
    for request in (a, b):
        scheduler.add_request(request)
    assert _step(scheduler) == [a.req_id, b.req_id]
    scheduler.hold(a)
    assert _step(scheduler) == [b.req_id]
    scheduler.check_integrity()
    scheduler.hold(b)
    assert not scheduler.has_runnable_requests()
    scheduler.release(a)
    assert _step(scheduler) == [a.req_id]
    scheduler.finish_requests("b")  # finished while held
    assert scheduler.num_held == 0
    scheduler.check_integrity()
