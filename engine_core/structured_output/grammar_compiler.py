"""Compiling grammars off the step loop: two lanes of niced threads, a cache by key that
keeps failures, and a per-request deadline that also cancels queued work.

A compile builds the llguidance matcher and computes its first mask (the costly part of
some grammars: `a{1000000}` spends its time there), so a grammar is ready only once its
requests can be scheduled without any more grammar work, and a grammar that cannot produce
anything fails here. Small constraints (at most SMALL_CONSTRAINT_CHARS of text) and big ones
compile in separate lanes, so a small uncached grammar never queues behind big ones.
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from common.work_lanes import Job, WorkLanes
from engine_core.structured_output.grammar import grammar_text, invalid_reason
from engine_core.structured_output.grammar_limits import GrammarLimits
from engine_core.structured_output.mask_row import MaskRow, fill_row, first_row_problem
from protocol.structured_outputs import StructuredOutputsError, StructuredOutputsParams

MAX_CACHED = 256  # grammars kept, compiled or failed (least recently used dropped first)
SMALL_CONSTRAINT_CHARS = 4096  # a constraint this short compiles in the small lane
COMPILE_NICE = 10  # compile threads yield the cores to the step loop and the workers
Key = tuple[str, str, bool, bool | None]


@dataclass(slots=True)
class CompiledGrammar:
    """A pristine matcher (requests get copies) and the mask every copy starts with."""

    matcher: Any
    first_row: MaskRow


@dataclass(slots=True)
class CompileTask:
    """One key's compilation, shared by every request with that key. `failure` is set once
    the grammar failed, at compile time or later while a request ran it."""

    key: Key
    job: Job | None = None
    failure: str | None = None
    waiters: int = 0  # requests waiting for it (a queued job nobody waits for is cancelled)
    kind: str = field(default="json")

    @property
    def done(self) -> bool:
        return self.failure is not None or (self.job is not None and self.job.done)


class GrammarCompiler:
    """Compiles `StructuredOutputsParams` into llguidance matchers for one model's tokenizer.

    `compile` returns at once with the key's task (compiling, compiled, or failed: a failure
    stays cached and answers every later request with the same key). `wakeup_fd` becomes
    readable whenever a compile ends, so an idle engine loop can wait on it. llguidance
    releases the GIL while it builds a grammar, so compiling does not slow the step loop.
    """

    def __init__(self, model_dir: str | None, vocab_size: int | None, timeout_s: float,
                 limits: GrammarLimits | None = None) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.limits = limits or GrammarLimits()
        # A compile that overstays the timeout hands its lane to a new thread (two at most).
        self.lanes = WorkLanes({"small": (1, COMPILE_NICE), "big": (1, COMPILE_NICE)},
                               "deltaserve-grammar", overdue_s=timeout_s, max_overdue=2)
        self._tasks: OrderedDict[Key, CompileTask] = OrderedDict()
        self._tokenizer: Any = None
        self._tokenizer_lock = threading.Lock()
        self.wakeup_fd, self._wakeup_w = os.pipe()
        os.set_blocking(self.wakeup_fd, False)
        os.set_blocking(self._wakeup_w, False)

    def compile(self, params: StructuredOutputsParams, eos_token_id: int | None) -> CompileTask:
        """The key's task, started if it is new; the caller waits for it (`waiters`)."""
        key = params.key
        task = self._tasks.get(key)
        if task is None:
            task = self._tasks[key] = CompileTask(key, kind=params.kind)
            lane = "small" if len(key[1]) <= SMALL_CONSTRAINT_CHARS else "big"
            task.job = self.lanes.submit(lane, lambda: self._run(params, eos_token_id),
                                         self._wake)
            self._evict()
        self._tasks.move_to_end(key)
        task.waiters += 1
        return task

    def status(self, task: CompileTask) -> str | None:
        """"" when compiled, the error when it failed, None while it compiles."""
        if task.failure is not None:
            return task.failure
        job = task.job
        if job is None or not job.done:
            return None
        if job.error is not None:
            error = job.error
            task.failure = str(error) if isinstance(error, StructuredOutputsError) else str(
                StructuredOutputsError(task.kind, f"could not be compiled: "
                                                  f"{type(error).__name__}: {error}"))
            return task.failure
        return ""

    def give_up(self, task: CompileTask) -> str:
        """A waiter's deadline passed: its error. A queued compile nobody waits for any more
        is cancelled and forgotten (a later request starts it again); a running one goes on
        and its result is cached."""
        task.waiters -= 1
        started = task.job is not None and task.job.started is not None
        if task.waiters <= 0 and task.job is not None and self.lanes.cancel(task.job):
            if self._tasks.get(task.key) is task:
                del self._tasks[task.key]
        why = "" if started else " (it was still queued behind other grammars)"
        return (f"structured_outputs.{task.kind} did not compile within {self.timeout_s:g} s"
                f"{why}")

    def release(self, task: CompileTask) -> None:
        """A waiter got its answer (or went away)."""
        task.waiters = max(task.waiters - 1, 0)

    def fail(self, key: Key, error: str) -> None:
        """The grammar failed while a request ran it: every later request with its key gets
        the same error (its copies share llguidance state, which may be spent)."""
        task = self._tasks.get(key)
        if task is not None:
            task.failure = error

    def compiled(self, task: CompileTask) -> CompiledGrammar:
        """The task's grammar (waiting for it if it is still compiling, as in a replay);
        raises ValueError (its request's error) if it failed."""
        if task.failure is None and task.job is not None:
            self.lanes.wait([task.job])
        error = self.status(task)
        if error:
            raise ValueError(error)
        return task.job.result

    def matcher(self, task: CompileTask) -> Any:
        """A fresh matcher of the task's grammar (waits for it; ValueError if it failed)."""
        return self.compiled(task).matcher.deep_copy()

    def drain_wakeups(self) -> None:
        try:
            while os.read(self.wakeup_fd, 4096):
                pass
        except BlockingIOError:
            pass

    def tokenizer(self, eos_token_id: int | None) -> Any:
        """The model's tokenizer as llguidance sees it (loaded once, on first use)."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                from engine_core.structured_output.guidance_tokenizer import load
                self._tokenizer = load(self.model_dir, self.vocab_size, eos_token_id)
            return self._tokenizer

    def num_words(self) -> int:
        """Words of a mask row: ceil(vocabulary / 32)."""
        vocab = self.vocab_size or self.tokenizer(None).vocab_size
        return (vocab + 31) // 32

    def shutdown(self) -> None:
        self.lanes.shutdown()
        os.close(self.wakeup_fd)
        os.close(self._wakeup_w)

    def _run(self, params: StructuredOutputsParams, eos_token_id: int | None
             ) -> CompiledGrammar:
        import llguidance
        kind = params.kind
        try:
            tokenizer = self.tokenizer(eos_token_id)
            matcher = llguidance.LLMatcher(tokenizer, grammar_text(params), log_level=0,
                                           limits=self.limits.parser_limits())
        except StructuredOutputsError:
            raise
        except Exception as e:  # e.g. a tokenizer llguidance cannot read
            raise StructuredOutputsError(kind, f"could not be compiled: {type(e).__name__}: "
                                               f"{e}") from None
        if matcher.is_error():
            raise StructuredOutputsError(kind, invalid_reason(kind, matcher.get_error()))
        first_row = fill_row(matcher.deep_copy(), self.num_words())
        problem = first_row_problem(first_row)
        if problem:
            raise StructuredOutputsError(kind, problem)
        return CompiledGrammar(matcher, first_row)

    def _wake(self, job: Job) -> None:
        try:
            os.write(self._wakeup_w, b"x")
        except (BlockingIOError, OSError):
            pass  # full (the loop is behind: it will look anyway) or closed (shut down)

    def _evict(self) -> None:
        while len(self._tasks) > MAX_CACHED:
            key, task = next(iter(self._tasks.items()))
            if not task.done:
                return  # still compiling: kept, so its waiters find it
            del self._tasks[key]
