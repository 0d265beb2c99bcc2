"""Bounds on what one HTTP connection may hold or cost, on top of uvicorn's h11 server.

uvicorn bounds a request head's bytes (`h11_max_incomplete_event_size`), the number of
connections (`limit_concurrency`, answered 503) and idle keep-alive time. What it leaves open
is added here: a request head must arrive within `header_timeout_s` of the connection opening
(or of the previous response ending), so a client that trickles its headers (slowloris) or
sends nothing holds a connection for seconds, not forever; and a head may carry at most
`max_header_count` headers (431 otherwise). Parsing stays h11's.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from launch.entrypoints.openai.errors import APIError


@dataclass(frozen=True)
class HttpLimits:
    max_incomplete_event_size: int = 64 << 10  # bytes of one request head (line + headers)
    max_header_count: int = 256
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0  # enforced where the body is read
    limit_concurrency: int = 1024  # connections (and requests) before answering 503
    timeout_keep_alive_s: int = 5


def bounded_h11_protocol(limits: HttpLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline for each request head."""

    class BoundedH11Protocol(H11Protocol):
        _head_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()  # a head arrived: the app's timeouts take over

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and (self.cycle is None
                                                    or self.cycle.response_complete):
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._head_deadline = self.loop.call_later(limits.header_timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
                self._head_deadline = None

        def _expire(self) -> None:
            self._head_deadline = None
            if self.cycle is None or self.cycle.response_complete:
                self.transport.close()

    return BoundedH11Protocol


class HeaderCountMiddleware:
    """431 for a request with more than `max_header_count` headers."""

    def __init__(self, app: ASGIApp, max_header_count: int) -> None:
        self.app = app
        self.max_header_count = max_header_count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and len(scope["headers"]) > self.max_header_count:
            response = APIError(431, f"the request has {len(scope['headers'])} headers, more "
                                f"than {self.max_header_count}").response()
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
