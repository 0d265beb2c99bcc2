"""The Responses API's output: items (`reasoning`, `message`, `function_call`), the
`response` object, its usage, and the typed stream events an item's life gives
(`response.output_item.added`, `response.output_text.delta`,
`response.function_call_arguments.delta`/`.done`, ...), each with its `sequence_number`."""
from __future__ import annotations

import secrets
from typing import Any

import msgspec

from launch.entrypoints.openai.output_items import ItemEvent, OutputItem

_PREFIX = {"reasoning": "rs", "text": "msg", "call": "fc"}
_encoder = msgspec.json.Encoder()


def item_id(item: OutputItem) -> str:
    return f"{_PREFIX[item.kind]}_{secrets.token_hex(16)}"


def item_json(item: OutputItem, iid: str, status: str) -> dict[str, Any]:
    if item.kind == "reasoning":
        return {"type": "reasoning", "id": iid, "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": item.text}]}
    if item.kind == "text":
        return {"type": "message", "id": iid, "status": status, "role": "assistant",
                "content": [_part(item)] if status != "in_progress" else []}
    return {"type": "function_call", "id": iid, "call_id": item.call_id, "name": item.name,
            "arguments": item.text, "status": status}


def _part(item: OutputItem) -> dict[str, Any]:
    if item.kind == "reasoning":
        return {"type": "reasoning_text", "text": item.text}
    return {"type": "output_text", "text": item.text, "annotations": [], "logprobs": []}


def status_of(finish_reason: str | None) -> tuple[str, dict[str, Any] | None]:
    """(response status, incomplete_details) for a sequence's finish reason."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "abort":
        return "cancelled", None
    if finish_reason == "error":
        return "failed", None
    return "completed", None


def usage_json(prompt: int, output: int, cached: int, reasoning: int) -> dict[str, Any]:
    """`cached_tokens` are the prefix cache's hits; nothing is written to a cache a client
    asks for (prefix caching is implicit), so `cache_write_tokens` is 0."""
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + output}


def reasoning_tokens(tokenizer: Any, token_ids: list[int], text: str, reasoning: bool,
                     end_tag: str) -> int:
    """How many output tokens the reasoning took: up to and including the one that ends it
    (the shortest prefix whose text holds `end_tag`, found by bisection), or all of them when
    the reasoning never ended."""
    if not reasoning or tokenizer is None:
        return 0
    if end_tag not in text:
        return len(token_ids)
    lo, hi = 1, len(token_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if end_tag in tokenizer.decode(token_ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo


class ResponseEvents:
    """One stream's server-sent events: numbered in order, an item's events from its life."""

    def __init__(self) -> None:
        self.sequence = 0
        self.ids: list[str] = []  # per output index

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + _encoder.encode(data) + b"\n\n"

    def of_item(self, e: ItemEvent, final_status: str = "completed") -> list[bytes]:
        """The events of one item event; a closing item gets `final_status`."""
        item, index = e.item, e.index
        if e.kind == "open":
            self.ids.append(item_id(item))
            out = [self.event("response.output_item.added", output_index=index,
                              item=item_json(item, self.ids[index], "in_progress"))]
            if item.kind != "call":
                out.append(self.event("response.content_part.added", item_id=self.ids[index],
                                      output_index=index, content_index=0,
                                      part={**_part(item), "text": ""}))
            return out
        iid = self.ids[index]
        where = {"item_id": iid, "output_index": index}
        if e.kind == "delta":
            if item.kind == "call":
                return [self.event("response.function_call_arguments.delta", **where,
                                   delta=e.delta)]
            if item.kind == "reasoning":
                return [self.event("response.reasoning_text.delta", **where, content_index=0,
                                   delta=e.delta)]
            return [self.event("response.output_text.delta", **where, content_index=0,
                               delta=e.delta, logprobs=[])]
        done = item_json(item, iid, final_status)
        if item.kind == "call":
            out = [self.event("response.function_call_arguments.done", **where,
                              name=item.name, arguments=item.text)]
        else:
            kind = "reasoning_text" if item.kind == "reasoning" else "output_text"
            out = [self.event(f"response.{kind}.done", **where, content_index=0,
                              text=item.text, **({"logprobs": []} if item.kind == "text"
                                                 else {})),
                   self.event("response.content_part.done", **where, content_index=0,
                              part=_part(item))]
        return out + [self.event("response.output_item.done", output_index=index, item=done)]
