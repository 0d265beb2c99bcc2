"""The front-end's check of a constraint before anything is scheduled: in two lanes of niced
threads (small constraints apart from big ones), with a per-request deadline, cached by key.

A check asks llguidance with the model's tokenizer and the engine's limits (so unknown
special tokens and out-of-range token ids are refused too), then, when that was quick, probes
the grammar: its first mask (an empty language: a `$ref` loop, an empty character class) and
its first tokens (a rule with more alternatives than a row may hold). A verdict, valid or
not, is cached; a check that itself ran past the deadline is cached as "too complex". A
request whose check is still queued at its deadline is refused as busy (GrammarBusyError,
the server's 503), and the check is dropped unless another request waits for it.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from typing import Any

from common.work_lanes import Job, WorkLanes
from engine_core.structured_output.grammar import grammar_text, invalid_reason
from engine_core.structured_output.grammar_compiler import (
    COMPILE_NICE,
    SMALL_CONSTRAINT_CHARS,
    Key,
)
from engine_core.structured_output.grammar_limits import GrammarLimits
from engine_core.structured_output.mask_row import probe
from protocol.structured_outputs import StructuredOutputsError, StructuredOutputsParams

MAX_VERDICTS = 256  # cached verdicts (keys hold up to 64 KiB each)
PROBE_AFTER_S = 0.5  # a grammar llguidance validated in less than this is probed
MAX_QUEUED = 64  # checks waiting per lane; beyond, a new one is refused as busy


class GrammarBusyError(RuntimeError):
    """The constraint could not be checked in time: too many others ahead of it."""


class _Check:
    """One key's check, shared by the requests that wait for it."""

    __slots__ = ("job", "waiters", "events", "reason")

    def __init__(self, reason: str | None = None) -> None:
        self.job: Job | None = None
        self.waiters = 0
        self.events: list[Any] = []  # threading.Event or (loop, asyncio.Future)
        self.reason = reason  # the verdict once known: "" valid, else why not


class GrammarValidator:
    def __init__(self, model_dir: str | None, vocab_size: int | None,
                 eos_token_id: int | None, limits: GrammarLimits | None = None,
                 timeout_s: float = 5.0) -> None:
        self.model_dir, self.vocab_size, self.eos_token_id = model_dir, vocab_size, eos_token_id
        self.limits = limits or GrammarLimits()
        self.timeout_s = timeout_s
        # A check that ran half its deadline hands its lane on (looked at whenever a request
        # joins or gives up): the requests queued behind it still have a chance.
        self.lanes = WorkLanes({"small": (1, COMPILE_NICE), "big": (1, COMPILE_NICE)},
                               "deltaserve-validate", overdue_s=timeout_s / 2, max_overdue=2)
        self._lock = threading.Lock()
        self._verdicts: OrderedDict[Key, str] = OrderedDict()  # "" valid, else the reason
        self._checks: dict[Key, _Check] = {}
        self._tokenizer: Any = None
        self._tokenizer_loaded = False
        self._tokenizer_lock = threading.Lock()

    @staticmethod
    def from_config(config: Any, vocab_size: int | None, eos_token_id: int | None
                    ) -> GrammarValidator:
        return GrammarValidator(config.model, vocab_size, eos_token_id,
                                GrammarLimits.of(config),
                                config.structured_outputs_validation_timeout_s)

    def verdict(self, params: StructuredOutputsParams) -> bool:
        """True if the key's verdict is cached (raising StructuredOutputsError if it is a
        refusal); False if it still needs a check."""
        with self._lock:
            reason = self._verdicts.get(params.key)
            if reason is not None:
                self._verdicts.move_to_end(params.key)
        if reason:
            raise StructuredOutputsError(params.kind, reason)
        return reason is not None

    def check(self, params: StructuredOutputsParams) -> None:
        """Block until the constraint is checked: StructuredOutputsError if it is refused,
        GrammarBusyError if it could not be checked by its deadline."""
        if self.verdict(params):
            return
        event = threading.Event()
        check = self._join(params, event)
        if not event.wait(self.timeout_s):
            self._give_up(params, check)
        self._answer(params, check)

    async def check_async(self, params: StructuredOutputsParams) -> None:
        """`check` for an event loop: awaits the check without holding a thread."""
        if self.verdict(params):
            return
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        check = self._join(params, (loop, future))
        try:
            await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except asyncio.TimeoutError:
            self._give_up(params, check)
        except asyncio.CancelledError:  # the client went away: stop waiting for it
            self._leave(params, check)
            raise
        self._answer(params, check)

    def shutdown(self) -> None:
        self.lanes.shutdown()

    # --- the shared checks ---------------------------------------------------------------

    def _join(self, params: StructuredOutputsParams, waiter: Any) -> _Check:
        key = params.key
        lane = "small" if len(key[1]) <= SMALL_CONSTRAINT_CHARS else "big"
        with self._lock:
            if key in self._verdicts:  # decided meanwhile
                _notify(waiter)
                return _Check(self._verdicts[key])
            check = self._checks.get(key)
            if check is None:
                if self.lanes.queued(lane) >= MAX_QUEUED:
                    raise GrammarBusyError(self._busy(params))
                check = self._checks[key] = _Check()
                check.job = self.lanes.submit(lane, lambda: self._run(params),
                                              lambda job: self._done(key, job))
            check.waiters += 1
            check.events.append(waiter)
        self.lanes.check_overdue()
        return check

    @staticmethod
    def _answer(params: StructuredOutputsParams, check: _Check) -> None:
        if check.reason:
            raise StructuredOutputsError(params.kind, check.reason)

    def _give_up(self, params: StructuredOutputsParams, check: _Check) -> None:
        """The deadline passed without a verdict: busy if the check never started, else too
        complex (and cached as such once it ends, see _done)."""
        started = check.job is not None and check.job.started is not None
        self._leave(params, check)
        self.lanes.check_overdue()
        if check.reason is not None:  # decided at the last moment
            return
        if not started:
            raise GrammarBusyError(self._busy(params))
        raise StructuredOutputsError(params.kind, self._too_complex())

    def _leave(self, params: StructuredOutputsParams, check: _Check) -> None:
        with self._lock:
            check.waiters -= 1
            if check.waiters <= 0 and check.job is not None and self.lanes.cancel(check.job):
                self._checks.pop(params.key, None)

    def _done(self, key: Key, job: Job) -> None:
        reason = job.result if job.error is None else (
            f"could not be checked: {type(job.error).__name__}: {job.error}")
        if job.seconds > self.timeout_s:
            reason = self._too_complex()
        with self._lock:
            self._verdicts[key] = reason
            while len(self._verdicts) > MAX_VERDICTS:
                self._verdicts.popitem(last=False)
            check = self._checks.pop(key, None)
            if check is not None:
                check.reason = reason
        for waiter in check.events if check is not None else ():
            _notify(waiter)

    def _busy(self, params: StructuredOutputsParams) -> str:
        return (f"structured_outputs.{params.kind} could not be checked within "
                f"{self.timeout_s:g} s: the server is busy checking other constraints; retry "
                "later")

    def _too_complex(self) -> str:
        return (f"is too complex: checking it takes more than {self.timeout_s:g} s (the "
                "limit is --structured-outputs-validation-timeout-s)")

    # --- the work --------------------------------------------------------------------------

    def _run(self, params: StructuredOutputsParams) -> str:
        """The refusal reason ("" if valid), on a lane's thread."""
        import llguidance
        kind = params.kind
        try:
            grammar = grammar_text(params)
        except StructuredOutputsError as e:
            return e.reason
        tokenizer = self._llg_tokenizer()
        limits = self.limits.parser_limits()
        started = time.monotonic()
        message = llguidance.LLMatcher.validate_grammar(grammar, tokenizer, limits=limits)
        if message:
            return invalid_reason(kind, message)
        if tokenizer is None or time.monotonic() - started > PROBE_AFTER_S:
            return ""
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
        if matcher.is_error():
            return invalid_reason(kind, matcher.get_error())
        stops = {t for t in (self.eos_token_id,) if t is not None}
        return probe(matcher, (tokenizer.vocab_size + 31) // 32, stops)

    def _llg_tokenizer(self) -> Any:
        """The model's tokenizer as llguidance sees it, or None if there is none to read."""
        with self._tokenizer_lock:
            if not self._tokenizer_loaded:
                self._tokenizer_loaded = True
                try:
                    from engine_core.structured_output.guidance_tokenizer import load
                    self._tokenizer = load(self.model_dir, self.vocab_size, self.eos_token_id)
                except Exception:  # no tokenizer: checked without one (the engine will tell)
                    self._tokenizer = None
            return self._tokenizer


def _notify(waiter: Any) -> None:
    if isinstance(waiter, threading.Event):
        waiter.set()
        return
    loop, future = waiter

    def settle() -> None:
        if not future.done():
            future.set_result(None)
    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the loop is closed
        pass
