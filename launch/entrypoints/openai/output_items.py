"""An answer's ordered parts as a list of output items, the unit the Responses API (output
items) and Anthropic's Messages API (content blocks) answer in: reasoning, text, and one
item per tool call, in the order the model wrote them.

`ItemBuilder` turns the parts of a stream into item events: an item opens, grows by deltas
and closes before the next one opens (consecutive parts of one kind extend one item; a call
opens its own). Fed the parts of a whole answer at once, it builds the same items, since the
parts come in the same order for any cut (see `chat_answer`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from launch.entrypoints.openai.chat_answer import AnswerDelta


@dataclass(slots=True)
class OutputItem:
    kind: str  # "reasoning" | "text" | "call"
    text: str = ""  # the reasoning, the text, or a call's arguments
    call_id: str | None = None
    name: str | None = None
    done: bool = False


@dataclass(slots=True)
class ItemEvent:
    kind: str  # "open" | "delta" | "close"
    index: int  # the item's position in the answer
    item: OutputItem
    delta: str = ""


@dataclass(slots=True)
class ItemBuilder:
    items: list[OutputItem] = field(default_factory=list)
    call_items: dict[int, int] = field(default_factory=dict)  # call index -> item index

    def feed(self, delta: AnswerDelta) -> list[ItemEvent]:
        events: list[ItemEvent] = []
        for kind, value in delta.parts:
            if kind == "call" and value.name is None:  # more arguments of an open call
                index = self.call_items[value.index]
                self._grow(index, value.arguments, events)
                continue
            if kind != "call" and self.items and not self.items[-1].done \
                    and self.items[-1].kind == _KINDS[kind]:
                self._grow(len(self.items) - 1, value, events)
                continue
            events += self.finish()
            if kind == "call":
                item = OutputItem("call", call_id=value.id, name=value.name)
                self.call_items[value.index] = len(self.items)
                text = value.arguments
            else:
                item, text = OutputItem(_KINDS[kind]), value
            self.items.append(item)
            events.append(ItemEvent("open", len(self.items) - 1, item))
            self._grow(len(self.items) - 1, text, events)
        return events

    def finish(self) -> list[ItemEvent]:
        """Close the open item, if any (the next one opens, or the answer ended)."""
        if not self.items or self.items[-1].done:
            return []
        self.items[-1].done = True
        return [ItemEvent("close", len(self.items) - 1, self.items[-1])]

    def _grow(self, index: int, text: str, events: list[ItemEvent]) -> None:
        if text:
            self.items[index].text += text
            events.append(ItemEvent("delta", index, self.items[index], text))


_KINDS = {"reasoning": "reasoning", "content": "text"}


def whole_items(delta: AnswerDelta) -> list[OutputItem]:
    """The items of a whole answer (its parts from `ChatAnswerParser.parts`)."""
    builder = ItemBuilder()
    builder.feed(delta)
    builder.finish()
    return builder.items
