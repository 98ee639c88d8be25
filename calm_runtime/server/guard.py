"""The body guard: ASGI middleware that reads every request body under the size limit and
keeps the request metrics."""

from __future__ import annotations

import asyncio
import time

from calm_runtime.server.config import ServeConfig
from calm_runtime.server.protocol import APIError
from calm_runtime.server.state import ServerState

__all__ = ["CLIENT_CLOSED", "DEADLINE_KEY", "Guard", "request_deadline", "too_large",
           "too_slow"]

#: status recorded in the metrics for a request whose client left before any answer
#: (nginx's "client closed request"; nothing is sent)
CLIENT_CLOSED = 499
#: where the request's deadline is kept in its ASGI scope's state
DEADLINE_KEY = "calm_deadline"
_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


def too_slow(config: ServeConfig) -> APIError:
    return APIError(408, f"the request body did not arrive within {config.body_timeout_s:g} s "
                    "(--body-timeout); send it at once", code="request_timeout")


def request_deadline(scope) -> float | None:
    """The request's deadline (``time.monotonic()`` seconds), set when its body was read."""
    return (scope.get("state") or {}).get(DEADLINE_KEY)


def too_large(config: ServeConfig) -> APIError:
    return APIError(413, f"the request body exceeds {config.max_body_bytes} bytes; send a "
                    "shorter prompt", code="request_too_large")


# ---------------------------------------------------------------------- the request's body
class Guard:
    """ASGI middleware around every HTTP request: reads the body under the size limit and
    keeps the request metrics (count by status, latency, in flight).

    The body is read here, counting bytes as they arrive; past ``max_body_bytes`` (or with
    a ``Content-Length`` over it) the answer is 413 with ``Connection: close`` and the rest
    of the body is never read. Otherwise the app receives the body as one message, then
    the server's own ``receive`` (which reports the client's disconnect).
    """

    def __init__(self, app, server: ServerState) -> None:
        self.app = app
        self.server = server

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        metrics = self.server.metrics
        path = scope["path"]
        endpoint = path if path in _ENDPOINTS else "other"
        api = path.startswith("/v1/")
        status = None

        async def tracked(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        started = time.perf_counter()
        if api:
            metrics.in_flight.inc()
        try:
            body = await self._read_body(scope, receive)
            if body is _TOO_LARGE or body is _TOO_SLOW:
                error = (too_large(self.server.config) if body is _TOO_LARGE
                         else too_slow(self.server.config))
                response = self.server.error_response(error, headers={"Connection": "close"})
                await response(scope, receive, tracked)
            elif body is not None:  # None: the client left while sending
                # one deadline for the whole request, from here: every pass it runs reads it
                scope.setdefault("state", {})[DEADLINE_KEY] = (
                    time.monotonic() + self.server.config.request_timeout_s)
                await self.app(scope, _replay(body, receive), tracked)
        except BaseException:
            if status is None:
                status = 500
            raise
        finally:
            if api:
                metrics.in_flight.dec()
            metrics.latency.labels(endpoint).observe(time.perf_counter() - started)
            metrics.requests.labels(endpoint, str(status or CLIENT_CLOSED)).inc()

    async def _read_body(self, scope, receive):
        limit = self.server.config.max_body_bytes
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                return _TOO_LARGE
        try:  # the whole body within the body deadline, however it trickles
            return await asyncio.wait_for(self._read_chunks(receive, limit),
                                          timeout=self.server.config.body_timeout_s)
        except asyncio.TimeoutError:
            return _TOO_SLOW

    @staticmethod
    async def _read_chunks(receive, limit: int):
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return _TOO_LARGE
            if chunk:
                chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


_TOO_LARGE = object()
_TOO_SLOW = object()


def _replay(body: bytes, receive):
    """A ``receive`` that hands over ``body`` first, then defers to the server's."""
    pending = True

    async def replayed():
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


