"""The routes of ``calm serve``, at module level: one router that ``create_app`` includes.
Each route reads the app's :class:`~calm_runtime.server.context.EndpointContext` and hands
the request to its endpoint's serving module (``completions``, ``chat``); the checks a
request passes are the intake's (intake.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from calm_runtime.server.chat import serve_chat
from calm_runtime.server.completions import serve_completions
from calm_runtime.server.context import context_of
from calm_runtime.server.metrics import CONTENT_TYPE_LATEST
from calm_runtime.server.openapi import request_body
from calm_runtime.server.protocol import ChatRequest, CompletionRequest, ErrorResponse

__all__ = ["ERROR_RESPONSES", "router"]

#: the error responses the OpenAPI document lists for each endpoint
ERROR_RESPONSES = {
    status: {"model": ErrorResponse, "description": text} for status, text in (
        (400, "a bad body or parameter"), (401, "a missing or wrong API key"),
        (404, "another model"), (413, "a body over the size limit"),
        (429, "the queue is full"),
        (503, "the server is shutting down, or a batch ran out of memory"),
        (504, "past the request timeout"))}

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    server = context_of(request).server
    return {"status": "ok", "model": server.config.served_name,
            "queue_depth": server.batcher.depth}


@router.get("/metrics", responses={401: ERROR_RESPONSES[401]})
async def metrics(request: Request):
    server = context_of(request).server
    server.authorize(request)
    return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models", responses={401: ERROR_RESPONSES[401]})
async def models(request: Request):
    server = context_of(request).server
    server.authorize(request)
    return {"object": "list", "data": [{"id": server.config.served_name, "object": "model",
                                        "created": server.created, "owned_by": "calm",
                                        "calm": server.identity}]}


@router.post("/v1/completions", openapi_extra=request_body(CompletionRequest),
             responses=ERROR_RESPONSES)
async def completions(request: Request):
    return await serve_completions(context_of(request), request)


@router.post("/v1/chat/completions", openapi_extra=request_body(ChatRequest),
             responses=ERROR_RESPONSES)
async def chat(request: Request):
    return await serve_chat(context_of(request), request)
