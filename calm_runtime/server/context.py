"""What every endpoint works with: the server's state, its intake and its response writer,
composed once per app (``app.state.context``) and read by the routes."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from calm_runtime.server.intake import Intake
from calm_runtime.server.responses import ResponseWriter
from calm_runtime.server.state import ServerState

__all__ = ["EndpointContext", "context_of"]


@dataclass(frozen=True)
class EndpointContext:
    server: ServerState
    intake: Intake
    writer: ResponseWriter

    @classmethod
    def of(cls, server: ServerState) -> EndpointContext:
        return cls(server, Intake(server), ResponseWriter(server))


def context_of(request: Request) -> EndpointContext:
    """The app's :class:`EndpointContext` (``create_app`` puts it on ``app.state``)."""
    return request.app.state.context
