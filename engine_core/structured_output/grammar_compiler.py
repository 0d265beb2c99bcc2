"""Compiling grammars off the step loop: a small thread pool, a cache by key, a time bound."""
from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from engine_core.structured_output.grammar import grammar_text, invalid_reason
from protocol.structured_outputs import StructuredOutputsError, StructuredOutputsParams

COMPILE_THREADS = 2
MAX_CACHED = 256  # compiled grammars kept (least recently used dropped first)


@dataclass(slots=True)
class CompileTask:
    """One key's compilation; `started` (time.monotonic()) is set by the thread that runs it,
    once the tokenizer is loaded, so the time bound covers the grammar alone."""

    key: tuple[str, str, bool, bool | None]
    future: Future = field(default_factory=Future)
    started: float | None = None


class GrammarCompiler:
    """Compiles `StructuredOutputsParams` into llguidance matchers for one model's tokenizer.

    `compile` returns at once: a task shared by every request with the same key (running,
    done, or failed; a failure stays cached, a timeout does not). `wakeup_fd` becomes
    readable whenever a compilation ends, so an idle engine loop can wait on it. llguidance
    releases the GIL while it builds a grammar, so compiling does not slow the step loop.
    """

    def __init__(self, model_dir: str | None, vocab_size: int | None, timeout_s: float) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self._pool: ThreadPoolExecutor | None = None  # started on first use
        self._tasks: OrderedDict[tuple, CompileTask] = OrderedDict()
        self._tokenizer: Any = None
        self._tokenizer_lock = threading.Lock()
        self.wakeup_fd, self._wakeup_w = os.pipe()
        os.set_blocking(self.wakeup_fd, False)
        os.set_blocking(self._wakeup_w, False)

    def compile(self, params: StructuredOutputsParams, eos_token_id: int | None) -> CompileTask:
        key = params.key
        task = self._tasks.get(key)
        if task is not None:
            self._tasks.move_to_end(key)
            return task
        if self._pool is None:
            self._pool = ThreadPoolExecutor(COMPILE_THREADS, "deltaserve-grammar")
        task = self._tasks[key] = CompileTask(key)
        self._pool.submit(self._run, task, params, eos_token_id)
        self._evict()
        return task

    def status(self, task: CompileTask, now: float) -> str | None:
        """"" when compiled, the error when it failed or ran out of time, None meanwhile."""
        if task.future.done():
            error = task.future.exception()
            return "" if error is None else str(error)
        if task.started is not None and now - task.started > self.timeout_s:
            if self._tasks.get(task.key) is task:  # the next request with this key retries
                del self._tasks[task.key]
            return (f"structured_outputs.{task.key[0]} did not compile within "
                    f"{self.timeout_s:g} s")
        return None

    def matcher(self, task: CompileTask) -> Any:
        """A fresh matcher of the task's grammar (waits for it if it is still compiling);
        raises StructuredOutputsError if it failed."""
        return task.future.result().deep_copy()

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

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        os.close(self.wakeup_fd)
        os.close(self._wakeup_w)

    def _run(self, task: CompileTask, params: StructuredOutputsParams,
             eos_token_id: int | None) -> None:
        import llguidance
        try:
            tokenizer = self.tokenizer(eos_token_id)
            task.started = time.monotonic()
            matcher = llguidance.LLMatcher(tokenizer, grammar_text(params), log_level=0)
            if matcher.is_error():
                raise StructuredOutputsError(params.kind,
                                             invalid_reason(params.kind, matcher.get_error()))
            task.future.set_result(matcher)
        except StructuredOutputsError as e:
            task.future.set_exception(e)
        except Exception as e:  # e.g. a tokenizer llguidance cannot read
            task.future.set_exception(StructuredOutputsError(
                params.kind, f"could not be compiled: {type(e).__name__}: {e}"))
        try:
            os.write(self._wakeup_w, b"x")
        except (BlockingIOError, OSError):
            pass  # full (the loop is behind: it will look anyway) or closed (shut down)

    def _evict(self) -> None:
        while len(self._tasks) > MAX_CACHED:
            key, task = next(iter(self._tasks.items()))
            if not task.future.done():
                return  # still compiling: kept, so its waiters find it
            del self._tasks[key]

