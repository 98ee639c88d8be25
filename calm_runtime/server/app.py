"""The FastAPI application behind ``calm serve``: OpenAI's endpoints over one engine.

    from calm_runtime.server import ServeConfig, create_app
    app = create_app(ServeConfig(engine="engine/"))     # any ASGI server runs it

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (JSON or SSE
streaming), ``GET /v1/models``, ``GET /health`` (never needs the key), ``GET /metrics``
(Prometheus text). Every request is decoded by the :class:`~.batcher.MicroBatcher`, so
concurrent requests share batched decodes. Errors are OpenAI error objects: 400 for a bad
body or parameter, 401 for a wrong key, 404 for another model or path, 413 for a body over
``max_body_bytes``, 429 when the queue is full, 503 when a batch ran out of memory (the
next request is served), 504 past ``request_timeout_s``; an unexpected failure is a 500
whose message hides the traceback (it goes to the log).

Defences, in the order a request meets them:

* the body is counted as it arrives (``Content-Length`` or chunked): past
  ``max_body_bytes`` the server stops reading, answers 413 and closes the connection;
* the body must be UTF-8 JSON (no ``NaN``/``Infinity``, no lone UTF-16 surrogate, nesting
  within Python's recursion limit) and match the request model exactly (strict types);
* a prompt longer than :data:`PROMPT_CHARS_PER_TOKEN` characters per token of the
  prompt-token limit is refused before it is tokenised; tokenising runs on a worker
  thread, so the event loop (and ``/health``) never waits for it;
* a prompt that cannot be prefilled within ``max_prefill_tokens`` even alone is refused
  (400) before it is queued;
* a request whose client disconnects (or that passes its timeout) stops decoding at the
  next step and leaves its batch; ``calm_requests_cancelled_total`` counts the former.

``app.openapi()`` describes every endpoint with its request body and error responses (the
server does not publish it; the fuzz tests drive the server from it).
"""

from __future__ import annotations

import logging
import os
from contextlib import asynccontextmanager

try:
    import fastapi  # noqa: F401
except ImportError as err:  # one clear line instead of a missing-module error deep inside
    from calm_runtime.errors import BackendUnavailableError
    from calm_runtime.extras import missing_extra_message

    raise BackendUnavailableError(missing_extra_message("serve", "calm_runtime.server")) from err

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from calm_runtime._version import __version__
from calm_runtime.errors import CalmError, ConfigError
from calm_runtime.inference.lm import CalibratedLM
from calm_runtime.server.batcher import Job
from calm_runtime.server.config import ServeConfig
from calm_runtime.server.guard import Guard
from calm_runtime.server.intake import Intake
from calm_runtime.server.metrics import CONTENT_TYPE_LATEST
from calm_runtime.server.openapi import openapi_schema, request_body, template_tokens
from calm_runtime.server.protocol import APIError, ChatRequest, CompletionRequest, ErrorResponse
from calm_runtime.server.responses import EventStream, ResponseWriter
from calm_runtime.server.serving import ECHO_MAX_ENTRIES, PROMPT_CHARS_PER_TOKEN, ServerState  # noqa: F401

__all__ = ["create_app", "app_from_environment", "CONFIG_ENV", "PROMPT_CHARS_PER_TOKEN"]

logger = logging.getLogger(__name__)

#: environment variable through which ``calm serve --workers N`` hands each worker its config
CONFIG_ENV = "CALM_SERVE_CONFIG"
_ERROR_RESPONSES = {
    status: {"model": ErrorResponse, "description": text} for status, text in (
        (400, "a bad body or parameter"), (401, "a missing or wrong API key"),
        (404, "another model"), (413, "a body over the size limit"),
        (429, "the queue is full"),
        (503, "the server is shutting down, or a batch ran out of memory"),
        (504, "past the request timeout"))}


def create_app(config: ServeConfig, lm: CalibratedLM | None = None) -> FastAPI:
    """The ASGI app for ``config``; loads the engine now unless ``lm`` is given."""
    if lm is None:
        lm = CalibratedLM.load(config.engine, backend=config.backend, threads=config.threads,
                               verify_hashes=config.verify_hashes,
                               max_prefill_tokens=config.max_prefill_tokens)
    elif lm.max_prefill_tokens != config.max_prefill_tokens:
        raise ConfigError(f"the engine was loaded with max_prefill_tokens "
                          f"{lm.max_prefill_tokens} but the server's config says "
                          f"{config.max_prefill_tokens}; load it with "
                          f"CalibratedLM.load(..., max_prefill_tokens="
                          f"{config.max_prefill_tokens}) or set the config's")
    server = ServerState(config, lm)
    intake = Intake(server)
    writer = ResponseWriter(server)
    #: tokens the chat template adds around the documented messages (the OpenAPI document's
    #: text limits leave room for them)
    template_overhead = template_tokens(lm)

    @asynccontextmanager
    async def lifespan(_app):
        server.batcher.start()
        yield
        await server.batcher.close()  # in-flight requests finish first

    app = FastAPI(title="calm serve", version=__version__, lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.state.calm = server
    app.add_middleware(Guard, server=server)

    @app.exception_handler(APIError)
    async def _api_error(_request, exc: APIError):
        return server.error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, exc: StarletteHTTPException):
        return server.error_response(APIError(
            exc.status_code, str(exc.detail),
            code="not_found" if exc.status_code == 404 else None))

    @app.exception_handler(Exception)
    async def _unexpected(_request, exc: Exception):
        logger.error("unexpected error", exc_info=exc)
        return server.error_response(APIError(
            500, "the server failed on this request; the details are in its log",
            type="server_error"))

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": config.served_name, "queue_depth": server.batcher.depth}

    @app.get("/metrics", responses={401: _ERROR_RESPONSES[401]})
    async def metrics(request: Request):
        server.authorize(request)
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses={401: _ERROR_RESPONSES[401]})
    async def models(request: Request):
        server.authorize(request)
        return {"object": "list", "data": [{"id": config.served_name, "object": "model",
                                            "created": server.created, "owned_by": "calm",
                                            "calm": server.identity}]}

    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest),
              responses=_ERROR_RESPONSES)
    async def completions(request: Request):
        server.authorize(request)
        req = await intake.parse(request, CompletionRequest)
        single = isinstance(req.prompt, str)
        prompts = [req.prompt] if single else list(req.prompt)
        if not prompts or len(prompts) > config.max_queue:
            raise APIError(400, f"prompt must be a string or a list of 1 to {config.max_queue} "
                           "strings", param="prompt")
        for index, prompt in enumerate(prompts):
            intake.check_chars(len(prompt), "the prompt" if single else f"prompt[{index}]",
                               "prompt")
        intake.check_raw(req, req.logprobs is not None)
        constrained = req.choices()
        if constrained is not None:
            intake.check_constrained(req, logprobs=req.logprobs is not None,
                                     max_tokens=req.max_tokens)
        if req.echo:  # prompt scoring: one forward pass per prompt, no decoding
            # --max-prompt-tokens applies too, and the answer's size is bounded before work
            encoded = await run_in_threadpool(intake.encode, prompts)
            entries = sum(len(ids) for ids in encoded) * (1 + (req.logprobs or 0)) * (
                2 if req.wants_raw else 1)
            if entries > ECHO_MAX_ENTRIES:
                raise APIError(400, f"this echo would return {entries:,} log-probabilities "
                               f"(tokens x (1 + logprobs)); the limit is {ECHO_MAX_ENTRIES:,}: "
                               "send fewer or shorter prompts or fewer alternatives",
                               param="logprobs" if req.logprobs else "prompt")
            return await writer.echo(prompts, req, request)
        if constrained is not None:
            encoded = await run_in_threadpool(intake.encode, prompts)
            return await writer.constrained(encoded, prompts, constrained, req, "completion",
                                            request)
        limit = intake.max_tokens(req.max_tokens, config.default_max_tokens)
        options = intake.options(req, top=req.logprobs or 0)
        encoded = await run_in_threadpool(intake.encode, prompts)
        jobs = [Job(ids, limit, options, p if req.wants_p_true else None,
                    stream=bool(req.stream)) for ids, p in zip(encoded, prompts, strict=True)]
        intake.submit(jobs)
        if req.stream:
            return EventStream(server, jobs, writer.stream(jobs, req, "completion"))
        return await writer.complete(jobs, req, "completion", request)

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatRequest),
              responses=_ERROR_RESPONSES)
    async def chat(request: Request):
        server.authorize(request)
        req = await intake.parse(request, ChatRequest)
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        limit = intake.max_tokens(req.limit(), config.max_tokens_limit)
        messages = [{"role": "system" if m.role == "developer" else m.role,
                     "content": m.text()} for m in req.messages]
        users = [m["content"] for m in messages if m["role"] == "user"]
        if req.wants_p_true and not users:
            raise APIError(400, "P(True) needs a user message to score the answer against",
                           param="messages")
        intake.check_chars(sum(len(m["content"]) for m in messages), "the messages' text",
                           "messages")
        top = (req.top_logprobs or 0) if req.logprobs else 0
        intake.check_raw(req, bool(req.logprobs))
        constrained = req.choices()
        if constrained is not None:
            intake.check_constrained(req, logprobs=bool(req.logprobs), max_tokens=req.limit())
        ids = await run_in_threadpool(intake.encode_chat, messages)
        if constrained is not None:
            return await writer.constrained([ids], [users[-1] if users else ""], constrained,
                                            req, "chat", request)
        job = Job(ids, limit, intake.options(req, top=top),
                  users[-1] if req.wants_p_true else None, stream=bool(req.stream))
        intake.submit([job])
        if req.stream:
            return EventStream(server, [job], writer.stream([job], req, "chat"))
        return await writer.complete([job], req, "chat", request)

    app.openapi = lambda: openapi_schema(app, server, template_overhead)  # type: ignore[method-assign]
    return app


def app_from_environment() -> FastAPI:
    """The app for ``uvicorn --factory`` workers: the config comes from ``CALM_SERVE_CONFIG``."""
    text = os.environ.get(CONFIG_ENV)
    if not text:
        raise CalmError(f"{CONFIG_ENV} is not set; start the server with `calm serve ENGINE`")
    return create_app(ServeConfig.from_json(text))


