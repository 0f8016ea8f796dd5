"""uvicorn's HTTP protocol (httptools) with a deadline for a request's head: uvicorn has a keep-alive timeout
between requests, but none once a request's first byte has arrived (nor on a connection that never sends one), so a
client that sends a partial request line and then nothing held its connection open indefinitely: thousands of them
(a slow-connection attack) exhaust the server's sockets."""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# --header-timeout-s' default: a request's head is one packet or a few; a client that needs longer than this for it
# is not sending one.
DEFAULT_HEADER_TIMEOUT_S = 20.0


def header_timeout_protocol(header_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol, closing a connection whose request head (request line and headers) has not
    arrived `header_timeout_s` after the connection opened or the request began."""

    class HeaderTimeoutProtocol(HttpToolsProtocol):
        _head_deadline: asyncio.TimerHandle | None = None

        def _arm_head_deadline(self) -> None:
            if self._head_deadline is None:
                self._head_deadline = self.loop.call_later(header_timeout_s, self._head_too_slow)

        def _disarm_head_deadline(self) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
                self._head_deadline = None

        def _head_too_slow(self) -> None:
            self._head_deadline = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_head_deadline()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm_head_deadline()

        def on_headers_complete(self) -> None:
            self._disarm_head_deadline()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head_deadline()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol
