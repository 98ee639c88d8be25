"""Connections that cannot hold the server: read deadlines, connection caps, and every
refusal of the HTTP layer in the server's JSON error shape.

uvicorn's HTTP/1.1 protocol (h11) waits for a request's headers as long as a client cares to
send them, and a client that opens connections without finishing them holds one file
descriptor each until the process runs out and stops accepting anyone. This protocol, a
subclass of uvicorn's, adds what nginx, vLLM's and llama.cpp's servers have:

* **A header deadline** (``header_timeout_s``): a request's headers must arrive in full
  within it, counted from the connection's start or the end of its previous response; an
  idle connection is then closed, one that sent part of a request gets a JSON 408 first.
  Trickling one byte at a time does not reset it. (The body has its own deadline, enforced
  where the body is read: :class:`~calm_runtime.server.guard.Guard`.)
* **Connection caps** (``max_connections``, ``max_connections_per_client``): past either, the
  oldest connection of that client (or of anyone) that is not running a request is closed to
  make room, so a flood of half-open connections evicts itself and ``/health`` and new
  requests are still served; a connection that finds only running requests to evict is
  closed at once.
* **JSON errors**: a request h11 refuses (bad framing, a ``Content-Length`` that is not a
  size, headers too large) gets the server's JSON error object with 400, 413 or 431 instead
  of uvicorn's plain-text 400.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass

from uvicorn.protocols.http.h11_impl import H11Protocol

from calm_runtime.server.config import ServeConfig
from calm_runtime.server.protocol import APIError

__all__ = ["CalmH11Protocol", "ConnectionLimits", "protocol_for"]

logger = logging.getLogger(__name__)

#: at most one warning about evicted connections per this many seconds
_WARN_EVERY_S = 10.0


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float
    max_connections: int
    max_connections_per_client: int

    @classmethod
    def of(cls, config: ServeConfig) -> ConnectionLimits:
        """``config``'s limits, the server-wide cap lowered to fit the process's file
        descriptors (64 kept for the engine, logs and the listening socket)."""
        total = config.max_connections
        try:
            import resource

            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        except (ImportError, OSError, ValueError):
            soft = None
        if soft is not None and soft != getattr(resource, "RLIM_INFINITY", -1) \
                and total > soft - 64:
            logger.warning("--max-connections %d is above what this process's file descriptor "
                           "limit (%d) allows; using %d (raise it with ulimit -n)", total,
                           soft, max(1, soft - 64))
            total = max(1, soft - 64)
        return cls(config.header_timeout_s, total,
                   min(config.max_connections_per_client, total))


class _Registry:
    """The open connections of one server, oldest first, and per client address."""

    def __init__(self) -> None:
        self.open: OrderedDict[CalmH11Protocol, None] = OrderedDict()
        self.by_client: dict[str, OrderedDict[CalmH11Protocol, None]] = {}
        self.evicted = 0
        self._warned = 0.0

    def add(self, conn: CalmH11Protocol) -> None:
        self.open[conn] = None
        self.by_client.setdefault(conn.address, OrderedDict())[conn] = None

    def remove(self, conn: CalmH11Protocol) -> None:
        self.open.pop(conn, None)
        mine = self.by_client.get(conn.address)
        if mine is not None:
            mine.pop(conn, None)
            if not mine:
                del self.by_client[conn.address]

    def make_room(self, new: CalmH11Protocol, limits: ConnectionLimits) -> bool:
        """Evict idle connections until ``new`` fits both caps; False when it cannot."""
        for group, cap in ((self.by_client.get(new.address, {}),
                            limits.max_connections_per_client),
                           (self.open, limits.max_connections)):
            while len(group) > cap:
                victim = next((c for c in group if c is not new and not c.busy), None)
                if victim is None:
                    return False
                self.remove(victim)
                victim.evict()
                self.evicted += 1
        if self.evicted and time.monotonic() - self._warned > _WARN_EVERY_S:
            self._warned = time.monotonic()
            logger.warning("connection caps reached: %d idle or unfinished connection(s) "
                           "closed so far to make room (--max-connections %d, "
                           "--max-connections-per-client %d)", self.evicted,
                           limits.max_connections, limits.max_connections_per_client)
        return True


def error_bytes(status: int, reason: str, message: str, code: str | None,
                error_type: str = "invalid_request_error") -> bytes:
    """A complete HTTP/1.1 response carrying the server's JSON error object, closing."""
    body = json.dumps(APIError(status, message, error_type, code).body()).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode("ascii")
    return head + body


class CalmH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with the deadlines, caps and JSON errors above.

    The limits come from :func:`protocol_for` (a subclass per app), or, for ``calm serve
    --workers N`` (uvicorn imports the class by name in each worker), from the server's
    config in ``CALM_SERVE_CONFIG``."""

    limits: ConnectionLimits | None = None
    registry: _Registry | None = None

    @classmethod
    def _setup(cls) -> tuple[ConnectionLimits, _Registry]:
        if cls.limits is None:  # a worker of calm serve --workers N
            from calm_runtime.server.app import CONFIG_ENV

            cls.limits = ConnectionLimits.of(ServeConfig.from_json(os.environ[CONFIG_ENV]))
        if cls.registry is None:
            cls.registry = _Registry()
        return cls.limits, cls.registry

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.limits_, self.registry_ = self._setup()
        self.address = self.client[0] if self.client else ""
        self.busy = False
        self._header_timer = None
        self.registry_.add(self)
        if not self.registry_.make_room(self, self.limits_):
            self.registry_.remove(self)
            transport.write(error_bytes(503, "Service Unavailable", "the server's connection "
                                        "limit is reached by running requests; retry later",
                                        "too_many_connections", "server_error"))
            transport.close()
            return
        self._arm_header_deadline()

    def connection_lost(self, exc) -> None:
        self._disarm_header_deadline()
        registry = getattr(self, "registry_", None)
        if registry is not None:
            registry.remove(self)
        super().connection_lost(exc)

    # ---------------------------------------------------------------- header deadline
    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_timer = self.loop.call_later(self.limits_.header_timeout_s,
                                                  self._header_deadline)

    def _disarm_header_deadline(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def _header_deadline(self) -> None:
        self._header_timer = None
        if self.busy or self.transport.is_closing():
            return
        if self.conn.trailing_data[0]:  # part of a request arrived: say why it is closed
            self.transport.write(error_bytes(
                408, "Request Timeout", f"the request's headers did not arrive within "
                f"{self.limits_.header_timeout_s:g} s (--header-timeout); send them at once",
                "request_timeout"))
        self.transport.close()

    def evict(self) -> None:
        """Closed to make room for a new connection (it runs no request)."""
        self._disarm_header_deadline()
        if not self.transport.is_closing():
            self.transport.close()

    # ---------------------------------------------------------------- requests
    def handle_events(self) -> None:
        super().handle_events()
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and not self.busy:
            self.busy = True  # headers complete: the request's own deadlines apply now
            self._disarm_header_deadline()

    def on_response_complete(self) -> None:
        self.busy = False
        if not self.transport.is_closing():
            self._arm_header_deadline()  # the next request's headers, same deadline
        super().on_response_complete()

    def send_400_response(self, msg: str) -> None:
        """h11 refused the request (called while its RemoteProtocolError is handled): the
        server's JSON error with the fitting status, then the connection is closed."""
        exc = sys.exc_info()[1]
        reason = str(exc) if exc is not None else msg
        hint = getattr(exc, "error_status_hint", 400)
        if "Content-Length" in reason:
            status, phrase, code = 413, "Content Too Large", "request_too_large"
            message = ("the request's Content-Length is not a body size this server accepts; "
                       "send at most --max-body-bytes")
        elif hint == 431:
            status, phrase, code = 431, "Request Header Fields Too Large", "headers_too_large"
            message = "the request's headers are too large; send shorter headers"
        else:
            status, phrase, code = 400, "Bad Request", None
            message = f"the request is not valid HTTP/1.1 ({reason[:120]}); fix the client"
        self.transport.write(error_bytes(status, phrase, message, code))
        self.transport.close()


def protocol_for(config: ServeConfig) -> type[CalmH11Protocol]:
    """The protocol class of one server: :class:`CalmH11Protocol` with ``config``'s limits
    and a registry of its own (pass it as uvicorn's ``http``)."""
    return type("CalmH11Protocol", (CalmH11Protocol,),
                {"limits": ConnectionLimits.of(config), "registry": _Registry()})
