"""``POST /v1/completions``: text prompts answered by decoding, prompt scoring (``echo``), or
a constrained choice among given answers."""

from __future__ import annotations

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from calm_runtime.server.batcher import Job
from calm_runtime.server.context import EndpointContext
from calm_runtime.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    completion_logprobs,
)
from calm_runtime.server.responses import EventStream, ResponseShape

__all__ = ["COMPLETION", "serve_completions"]


class CompletionShape(ResponseShape):
    """OpenAI's (legacy) completions objects: ``text_completion``, choices with ``text``."""

    id_prefix = "cmpl"
    response_model = CompletionResponse

    def object_name(self, chunk: bool) -> str:
        return "text_completion"

    def choice(self, index, text, finish, logprobs, calm):
        return CompletionChoice(index=index, text=text, finish_reason=finish,
                                logprobs=logprobs, calm=calm)

    def asks_logprobs(self, req) -> bool:
        return req.logprobs is not None

    def logprobs(self, tokens, req, *, offset=0, raw=False, token_bytes=None):
        return completion_logprobs(tokens, req.logprobs, offset, raw=raw)

    def chunk_choice(self, index, text):
        return {"index": index, "text": text or ""}


COMPLETION = CompletionShape()


async def serve_completions(context: EndpointContext, request: Request):
    intake, writer = context.intake, context.writer
    context.server.authorize(request)
    req = await intake.parse(request, CompletionRequest)
    prompts, _ = intake.completion_prompts(req)
    constrained = req.choices()
    if req.echo:  # prompt scoring: one forward pass per prompt, no decoding
        encoded = await run_in_threadpool(intake.encode, prompts)
        intake.check_echo(req, encoded)
        return await writer.echo(prompts, req, COMPLETION, request)
    if constrained is not None:
        encoded = await run_in_threadpool(intake.encode, prompts)
        return await writer.constrained(encoded, prompts, constrained, req, COMPLETION,
                                        request)
    limit = intake.max_tokens(req.max_tokens, context.server.config.default_max_tokens)
    options = req.to_decode_options(top=req.logprobs or 0)
    encoded = await run_in_threadpool(intake.encode, prompts)
    jobs = [Job(ids, limit, options, p if req.wants_p_true else None, stream=bool(req.stream))
            for ids, p in zip(encoded, prompts, strict=True)]
    intake.submit(jobs)
    if req.stream:
        return EventStream(context.server, jobs, writer.stream(jobs, req, COMPLETION, request))
    return await writer.complete(jobs, req, COMPLETION, request)
