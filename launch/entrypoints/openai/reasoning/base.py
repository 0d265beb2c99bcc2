"""What a reasoning parser gives: (reasoning, content) of a model's text, whole or as a stream
of (reasoning delta, content delta). As with tool parsers, `extract` is the stream's own result
over the whole text, so the streamed deltas always concatenate to the whole answer's parts."""
from __future__ import annotations

import abc

from engine_core.structured_output.grammar import answer_lark
from protocol import StructuredOutputsParams


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
    end_tag: str  # the text that ends the reasoning
    # The Lark lexeme `REASONING` (the whole reasoning, closing tag included) and how the
    # start rule uses it ("REASONING " or "REASONING? "), for constraints on the answer.
    reasoning_lexeme: str
    reasoning_rule: str

    def constrain(self, params: StructuredOutputsParams) -> StructuredOutputsParams:
        """A grammar that leaves the reasoning free and holds the answer after it to
        `params` (what a structured-output constraint means under a reasoning parser)."""
        return StructuredOutputsParams(grammar=f"start: {self.reasoning_rule}answer\n"
                                       f"answer: {answer_lark(params)}\n"
                                       f"{self.reasoning_lexeme}\n")

    @abc.abstractmethod
    def stream(self) -> ReasoningStream: ...

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole answer; None for an empty part."""
        stream = self.stream()
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.finish()
        return (reasoning + more_reasoning) or None, (content + more_content) or None
