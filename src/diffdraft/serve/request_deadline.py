"""Connections that hold the server without sending a request get closed.

uvicorn (0.55) closes a connection left idle after a response (its keep-alive timeout), but not one
that has sent no whole request yet: a client that opened a connection and sent nothing, or sent its
headers a line a second, still held it after 40 s (measured), and enough of them use up the
server's file descriptors, so it can accept no one else. :func:`uvicorn_config` runs uvicorn's h11
protocol with a deadline: a connection that has been waiting for a request's headers for
``header_timeout`` seconds, since it opened or since its last response, is closed. A request under
way (its headers in, its response not finished: a long stream, a body arriving, which
``--body-timeout`` bounds) is never cut. uvicorn's own names (``cycle``, ``response_complete``,
``on_response_complete``) are read as its h11 protocol defines them; the serve tests run through it.
"""

from __future__ import annotations

import asyncio

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol


def uvicorn_config(app, header_timeout: float, log_level: str = "info") -> uvicorn.Config:
    """uvicorn's configuration for ``app``, its connections under :func:`deadline_protocol`."""
    return uvicorn.Config(app, log_level=log_level, http=deadline_protocol(header_timeout))


def deadline_protocol(header_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection after ``header_timeout`` seconds without a request
    under way (see the module docstring)."""

    class RequestDeadline(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._waiting_since = self.loop.time()
            self._deadline = self.loop.call_later(header_timeout, self._check_deadline)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._waiting_since = self.loop.time()

        def connection_lost(self, exc: Exception | None) -> None:
            self._deadline.cancel()
            super().connection_lost(exc)

        def _check_deadline(self) -> None:
            if self.transport.is_closing():
                return
            under_way = self.cycle is not None and not self.cycle.response_complete
            waited = self.loop.time() - self._waiting_since
            if not under_way and waited >= header_timeout:
                self.transport.close()
                return
            left = header_timeout if under_way else header_timeout - waited
            self._deadline = self.loop.call_later(left, self._check_deadline)

    return RequestDeadline
