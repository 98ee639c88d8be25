"""What every endpoint serves with: the server's state, its intake and its response writer,
composed once per app (``app.state.served``) and read by the routes."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from calm_runtime.server.intake import Intake
from calm_runtime.server.responses import ResponseWriter
from calm_runtime.server.serving import ServerState

__all__ = ["Served", "served"]


@dataclass(frozen=True)
class Served:
    server: ServerState
    intake: Intake
    writer: ResponseWriter

    @classmethod
    def of(cls, server: ServerState) -> Served:
        return cls(server, Intake(server), ResponseWriter(server))


def served(request: Request) -> Served:
    """The app's :class:`Served` (``create_app`` puts it on ``app.state``)."""
    return request.app.state.served
