"""Reasoning written between `<think>` and `</think>`.

`qwen3`: the answer reasons only if it opens with `<think>` (after whitespace); otherwise all
of it is content (thinking switched off). `deepseek_r1`: the chat template opens the think
block in the prompt, so the answer is reasoning until `</think>` (a leading `<think>` is
tolerated). Either way, reasoning never closed (cut by max_tokens) is all reasoning, and the
text after `</think>` is the content, as written.

Under a structured-output constraint the reasoning is free text up to the first `</think>`,
then at most 4 whitespace characters, then the constrained answer (`REASONING` below); qwen3
may skip the think block (the answer then starts at once), deepseek_r1 may not.
"""
from __future__ import annotations

from launch.entrypoints.openai.reasoning.base import ReasoningParser, ReasoningStream
from launch.processing.detokenizer import partial_suffix

START, END = "<think>", "</think>"
# Text with no `</think>` inside, then `</think>` and up to 4 whitespace characters.
_UNTIL_END = (r"(?s:.*)<\/think>[ \t\r\n]{0,4}/ & ~/(?s:.*)<\/think>(?s:.*)<\/think>(?s:.*)/")


class ThinkTagStream(ReasoningStream):
    def __init__(self, opened_by_prompt: bool) -> None:
        self.state = "undecided"  # undecided -> reasoning -> content
        self.opened_by_prompt = opened_by_prompt
        self.buf = ""

    @property
    def reasoning_ended(self) -> bool:
        return self.state == "content"

    def feed(self, text: str) -> tuple[str, str]:
        if self.state == "content":
            return "", text
        self.buf += text
        if self.state == "undecided" and not self._decide():
            return "", ""
        if self.state == "content":
            out, self.buf = self.buf, ""
            return "", out
        i = self.buf.find(END)
        if i >= 0:
            reasoning, content = self.buf[:i], self.buf[i + len(END):]
            self.buf, self.state = "", "content"
            return reasoning, content
        keep = partial_suffix(self.buf, END)
        out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return out, ""

    def finish(self) -> tuple[str, str]:
        text, self.buf = self.buf, ""
        if self.state == "undecided":  # whitespace or a part of "<think>": content
            return "", text
        return (text, "") if self.state == "reasoning" else ("", text)

    def _decide(self) -> bool:
        """Leave "undecided" once the opening is known; False while it is not."""
        head = self.buf.lstrip()
        if head.startswith(START):
            self.buf, self.state = head[len(START):], "reasoning"
            return True
        if not head or START.startswith(head):
            return False
        self.state = "reasoning" if self.opened_by_prompt else "content"
        return True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    end_tag = END
    reasoning_lexeme = r"REASONING: /[ \t\r\n]*<think>" + _UNTIL_END
    reasoning_rule = "REASONING? "

    def stream(self) -> ReasoningStream:
        return ThinkTagStream(opened_by_prompt=False)


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    end_tag = END
    reasoning_lexeme = r"REASONING: /[ \t\r\n]*(<think>)?" + _UNTIL_END
    reasoning_rule = "REASONING "

    def stream(self) -> ReasoningStream:
        return ThinkTagStream(opened_by_prompt=True)
