"""``POST /v1/chat/completions``: messages through the engine's chat template, answered by
decoding or by a constrained choice among given answers."""

from __future__ import annotations

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from calm_runtime.server.batcher import Job
from calm_runtime.server.protocol import ChatRequest
from calm_runtime.server.responses import EventStream
from calm_runtime.server.served import Served

__all__ = ["serve_chat"]


async def serve_chat(served: Served, request: Request):
    intake, writer = served.intake, served.writer
    served.server.authorize(request)
    req = await intake.parse(request, ChatRequest)
    messages, users, limit = intake.chat_messages(req)
    top = (req.top_logprobs or 0) if req.logprobs else 0
    constrained = req.choices()
    ids = await run_in_threadpool(intake.encode_chat, messages)
    if constrained is not None:
        return await writer.constrained([ids], [users[-1] if users else ""], constrained, req,
                                        "chat", request)
    job = Job(ids, limit, intake.options(req, top=top),
              users[-1] if req.wants_p_true else None, stream=bool(req.stream))
    intake.submit([job])
    if req.stream:
        return EventStream(served.server, [job], writer.stream([job], req, "chat"))
    return await writer.complete([job], req, "chat", request)
