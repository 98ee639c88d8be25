"""``POST /v1/chat/completions``: messages through the engine's chat template, answered by
decoding or by a constrained choice among given answers."""

from __future__ import annotations

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from calm_runtime.server.batcher import Job
from calm_runtime.server.context import EndpointContext
from calm_runtime.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    ChatRequest,
    chat_logprobs,
)
from calm_runtime.server.responses import EventStream, ResponseShape

__all__ = ["CHAT", "serve_chat"]


class ChatShape(ResponseShape):
    """OpenAI's chat completions objects: ``chat.completion`` (``.chunk`` when streamed),
    choices with an assistant ``message`` (a ``delta`` when streamed)."""

    id_prefix = "chatcmpl"
    response_model = ChatCompletionResponse
    opens_with_role = True

    def object_name(self, chunk: bool) -> str:
        return "chat.completion.chunk" if chunk else "chat.completion"

    def choice(self, index, text, finish, logprobs, calm):
        return ChatChoice(index=index, message=AssistantMessage(content=text),
                          finish_reason=finish, logprobs=logprobs, calm=calm)

    def asks_logprobs(self, req) -> bool:
        return bool(req.logprobs)

    def logprobs(self, tokens, req, *, offset=0, raw=False, token_bytes=None):
        return chat_logprobs(tokens, req.top_logprobs or 0, raw=raw, token_bytes=token_bytes)

    def chunk_choice(self, index, text):
        return {"index": index, "delta": {} if text is None else {"content": text}}

    def final_text(self, text, sent):
        return text[sent:] if len(text) > sent else None


CHAT = ChatShape()


async def serve_chat(context: EndpointContext, request: Request):
    intake, writer = context.intake, context.writer
    context.server.authorize(request)
    req = await intake.parse(request, ChatRequest)
    messages, users, limit = intake.chat_messages(req)
    top = (req.top_logprobs or 0) if req.logprobs else 0
    constrained = req.choices()
    ids = await run_in_threadpool(intake.encode_chat, messages)
    if constrained is not None:
        return await writer.constrained([ids], [users[-1] if users else ""], constrained, req,
                                        CHAT, request)
    job = Job(ids, limit, req.to_decode_options(top=top),
              users[-1] if req.wants_p_true else None, stream=bool(req.stream))
    intake.submit([job])
    if req.stream:
        return EventStream(context.server, [job], writer.stream([job], req, CHAT, request))
    return await writer.complete([job], req, CHAT, request)
