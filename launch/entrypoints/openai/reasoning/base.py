"""What a reasoning parser gives: (reasoning, content) of a model's text, whole or as a stream
of (reasoning delta, content delta). As with tool parsers, `extract` is the stream's own result
over the whole text, so the streamed deltas always concatenate to the whole answer's parts."""
from __future__ import annotations

import abc


class ReasoningStream(abc.ABC):
    @abc.abstractmethod
    def feed(self, text: str) -> tuple[str, str]:
        """New model text in; (reasoning delta, content delta) out."""

    @abc.abstractmethod
    def finish(self) -> tuple[str, str]:
        """The sequence ended: whatever was held back."""

    @property
    @abc.abstractmethod
    def reasoning_ended(self) -> bool:
        """The reasoning is over: what follows is the answer."""


class ReasoningParser(abc.ABC):
    name: str

    @abc.abstractmethod
    def stream(self) -> ReasoningStream: ...

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole answer; None for an empty part."""
        stream = self.stream()
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.finish()
        return (reasoning + more_reasoning) or None, (content + more_content) or None
