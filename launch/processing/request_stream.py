"""The consumer's end of one `AsyncLLM` request: an async iterator of `RequestOutput`s."""
from __future__ import annotations

import asyncio
import dataclasses

from launch.outputs import RequestOutput, RequestOutputKind
from launch.processing.request_state import RequestState


class RequestStream:
    """Woken by the output handler whenever its request changed; each `__anext__` returns the
    request's output at that moment (so a slow consumer gets several steps merged into one
    output, never a backlog). Ends after the finished output, or raises the stream's error."""

    def __init__(self, state: RequestState, kind: RequestOutputKind) -> None:
        self.state = state
        self.kind = kind
        self._changed = asyncio.Event()
        self._error: BaseException | None = None
        self._done = False

    @property
    def request_id(self) -> str:
        return self.state.request_id

    @property
    def finished(self) -> bool:
        return self._done or self.state.finished

    def notify(self) -> None:
        self._changed.set()

    def fail(self, error: BaseException) -> None:
        if not self._done:
            self._error = error
            self._changed.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        await self._changed.wait()
        self._changed.clear()
        while self.kind is RequestOutputKind.FINAL_ONLY and not (self.state.finished
                                                                  or self._error):
            await self._changed.wait()
            self._changed.clear()
        if self._error is not None:
            self._done = True
            raise self._error
        out = self.state.output(self.kind)
        self._done = out.finished
        if self.kind is RequestOutputKind.CUMULATIVE and not self._done:
            # A snapshot: the output handler goes on updating the state's own objects.
            out.outputs = [dataclasses.replace(o, token_ids=list(o.token_ids),
                                               logprobs=None if o.logprobs is None
                                               else list(o.logprobs)) for o in out.outputs]
        return out
