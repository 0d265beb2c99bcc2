"""A journal read into steps: what replay and the journal tools work from."""
from __future__ import annotations

import difflib
import json
from collections.abc import Callable
from dataclasses import dataclass

from protocol import (
    AbortRequests,
    AddRequest,
    AddRequests,
    Channel,
    EngineReady,
    GrammarsCompiled,
    ModelRunnerOutput,
    SchedulerOutput,
    to_builtins,
)
from protocol.journal import (
    ENGINE_CORE,
    JournalError,
    JournalHeader,
    JournalRecord,
    JournalTruncated,
)
from protocol.journal_reader import JournalReader


@dataclass(slots=True)
class RecordedStep:
    step: int
    scheduler_output: SchedulerOutput
    frame: bytes  # the step exactly as broadcast
    timestamp_ns: int
    model_runner_output: ModelRunnerOutput | None = None  # rank 0's answer


class RecordedRun:
    """Every record of a journal, plus its steps in order. A damaged journal keeps what was
    readable before the damage; `damage` holds the error (with its byte offset). A journal
    whose header cannot be read raises JournalError here: there is nothing to keep."""

    def __init__(self, path: str) -> None:
        self.path = path
        reader = iter(JournalReader(path))
        self.header: JournalHeader = next(reader)
        self.records: list[JournalRecord] = []
        self.damage: JournalError | None = None
        try:
            for record in reader:
                self.records.append(record)
        except JournalError as e:
            self.damage = e
        self.ready = next((r.message for r in self.records
                           if isinstance(r.message, EngineReady)), None)
        self.steps: list[RecordedStep] = []
        by_step: dict[int, RecordedStep] = {}
        for r in self.records:
            if isinstance(r.message, SchedulerOutput):
                by_step[r.message.step] = RecordedStep(r.message.step, r.message, r.frame,
                                                       r.timestamp_ns)
                self.steps.append(by_step[r.message.step])
            elif isinstance(r.message, ModelRunnerOutput) and r.peer == 0:
                if r.message.step in by_step:
                    by_step[r.message.step].model_runner_output = r.message

    @property
    def truncated(self) -> bool:
        """The journal just ends (no trailer): what is there is intact."""
        return isinstance(self.damage, JournalTruncated)

    def require_intact(self, allow_truncated: bool = False) -> None:
        """Raise unless the journal is complete (or only truncated, if that is allowed) and
        the engine got as far as being ready."""
        if self.damage is not None and not (allow_truncated and self.truncated):
            raise self.damage
        if self.ready is None:
            end = self.damage.offset if self.damage is not None else None
            raise JournalError(self.path, "the journal ends before the engine was ready", end)

    def frontend_messages(self, record: JournalRecord,
                          ) -> list[AddRequest | AbortRequests | GrammarsCompiled]:
        """What an input frame asked the engine to do (nothing for malformed frames): the
        front-end's requests and aborts, and the engine core's own grammar events."""
        if record.channel != Channel.FRONTEND_TO_CORE:
            return []
        if isinstance(record.message, AddRequests):
            return list(record.message.requests)
        if isinstance(record.message, GrammarsCompiled):  # the engine core's, or dropped
            return [record.message] if record.peer == ENGINE_CORE else []
        if isinstance(record.message, (AddRequest, AbortRequests)):
            return [record.message]
        return []

    def request_names(self) -> dict[int, str]:
        """Handle -> external request id, as of the last time each handle was assigned."""
        names: dict[int, str] = {}
        for step in self.steps:
            for new in step.scheduler_output.scheduled_new_reqs:
                names[new.req_id] = new.request_id
        return names


Print = Callable[[str], None]


def unified_diff(recorded: str, replayed: str, names: tuple[str, str] = ("recorded",
                                                                           "replayed")) -> str:
    return "\n".join(difflib.unified_diff(recorded.splitlines(), replayed.splitlines(),
                                          *names, lineterm="", n=2))


def readable(message: object) -> str:
    """A message as indented JSON, one field per line (what diffs are shown in)."""
    return json.dumps(to_builtins(message), indent=1, default=str)
