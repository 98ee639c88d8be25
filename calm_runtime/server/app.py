"""The FastAPI application behind ``calm serve``: OpenAI's endpoints over one engine.

    from calm_runtime.server import ServeConfig, create_app
    app = create_app(ServeConfig(engine="engine/"))     # any ASGI server runs it

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (JSON or SSE
streaming), ``GET /v1/models``, ``GET /health`` (never needs the key), ``GET /metrics``
(Prometheus text). Every request is decoded by the :class:`~.batcher.MicroBatcher`, so
concurrent requests share batched decodes. Errors are OpenAI error objects: 400 for a bad
body or parameter, 401 for a wrong key, 404 for another model or path, 413 for a body over
``max_body_bytes``, 429 when the queue is full, 504 past ``request_timeout_s``; an
unexpected failure is a 500 whose message hides the traceback (it goes to the log).

Defences, in the order a request meets them:

* the body is counted as it arrives (``Content-Length`` or chunked): past
  ``max_body_bytes`` the server stops reading, answers 413 and closes the connection;
* the body must be UTF-8 JSON (no ``NaN``/``Infinity``, no lone UTF-16 surrogate, nesting
  within Python's recursion limit) and match the request model exactly (strict types);
* a prompt longer than :data:`PROMPT_CHARS_PER_TOKEN` characters per token of the
  prompt-token limit is refused before it is tokenised; tokenising runs on a worker
  thread, so the event loop (and ``/health``) never waits for it;
* a request whose client disconnects (or that passes its timeout) stops decoding at the
  next step and leaves its batch; ``calm_requests_cancelled_total`` counts the former.

``app.openapi()`` describes every endpoint with its request body and error responses (the
server does not publish it; the fuzz tests drive the server from it).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import json
import logging
import os
import re
import threading
import time
import uuid
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from .._scoring import ScoringStopped
from ..engine import ENGINE_MANIFEST_NAME
from ..errors import CalmError
from ..lm import CalibratedLM
from .batcher import END, Job, MicroBatcher, QueueFull, ShuttingDown
from .config import ServeConfig
from .metrics import CONTENT_TYPE_LATEST, ServerMetrics
from .protocol import (
    FINISH_REASONS,
    MAX_CHOICE_CHARS,
    MAX_CHOICES,
    MIN_CHOICES,
    APIError,
    CalmOptions,
    ChatRequest,
    CompletionRequest,
    ErrorResponse,
    chat_logprobs,
    choice_extension,
    completion_logprobs,
    echo_logprobs,
)

__all__ = ["create_app", "app_from_environment", "CONFIG_ENV", "PROMPT_CHARS_PER_TOKEN"]

logger = logging.getLogger(__name__)

#: the most log-probabilities one echo may return (prompt tokens x (1 + alternatives),
#: twice with raw_logprobs): about 20 MB of JSON
ECHO_MAX_ENTRIES = 500_000
#: environment variable through which ``calm serve --workers N`` hands each worker its config
CONFIG_ENV = "CALM_SERVE_CONFIG"
#: a prompt (a chat request: its messages' text together) may hold at most this many
#: characters per token of the server's prompt-token limit; longer ones get a 400 before
#: tokenising. Text averages 3-5 characters per token, so only pathological prompts (say,
#: long runs of one character) that would fit in tokens are refused by it.
PROMPT_CHARS_PER_TOKEN = 32
#: status recorded in the metrics for a request whose client left before any answer
#: (nginx's "client closed request"; nothing is sent)
CLIENT_CLOSED = 499
_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
#: a JSON escape of a UTF-16 surrogate; only then can the parsed body hold a lone one
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_ERROR_RESPONSES = {
    status: {"model": ErrorResponse, "description": text} for status, text in (
        (400, "a bad body or parameter"), (401, "a missing or wrong API key"),
        (404, "another model"), (413, "a body over the size limit"),
        (429, "the queue is full"), (503, "the server is shutting down"),
        (504, "past the request timeout"))}


def create_app(config: ServeConfig, lm: CalibratedLM | None = None) -> FastAPI:
    """The ASGI app for ``config``; loads the engine now unless ``lm`` is given."""
    if lm is None:
        lm = CalibratedLM.load(config.engine, backend=config.backend, threads=config.threads,
                               verify_hashes=config.verify_hashes)
    server = _Server(config, lm)

    @asynccontextmanager
    async def lifespan(_app):
        server.batcher.start()
        yield
        await server.batcher.close()  # in-flight requests finish first

    app = FastAPI(title="calm serve", version=__version__, lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.state.calm = server
    app.add_middleware(_Guard, server=server)

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

    @app.post("/v1/completions", openapi_extra=_request_body(CompletionRequest),
              responses=_ERROR_RESPONSES)
    async def completions(request: Request):
        server.authorize(request)
        req = await server.parse(request, CompletionRequest)
        single = isinstance(req.prompt, str)
        prompts = [req.prompt] if single else list(req.prompt)
        if not prompts or len(prompts) > config.max_queue:
            raise APIError(400, f"prompt must be a string or a list of 1 to {config.max_queue} "
                           "strings", param="prompt")
        for index, prompt in enumerate(prompts):
            server.check_chars(len(prompt), "the prompt" if single else f"prompt[{index}]",
                               "prompt")
        server.check_raw(req, req.logprobs is not None)
        constrained = req.choices()
        if constrained is not None:
            server.check_constrained(req, logprobs=req.logprobs is not None,
                                     max_tokens=req.max_tokens)
        if req.echo:  # prompt scoring: one forward pass per prompt, no decoding
            # --max-prompt-tokens applies too, and the answer's size is bounded before work
            encoded = await run_in_threadpool(server.encode, prompts)
            entries = sum(len(ids) for ids in encoded) * (1 + (req.logprobs or 0)) * (
                2 if req.wants_raw else 1)
            if entries > ECHO_MAX_ENTRIES:
                raise APIError(400, f"this echo would return {entries:,} log-probabilities "
                               f"(tokens x (1 + logprobs)); the limit is {ECHO_MAX_ENTRIES:,}: "
                               "send fewer or shorter prompts or fewer alternatives",
                               param="logprobs" if req.logprobs else "prompt")
            return await server.echo(prompts, req, request)
        if constrained is not None:
            encoded = await run_in_threadpool(server.encode, prompts)
            return await server.constrained(encoded, prompts, constrained, req, "completion",
                                            request)
        limit = server.max_tokens(req.max_tokens, config.default_max_tokens)
        options = server.options(req, top=req.logprobs or 0)
        encoded = await run_in_threadpool(server.encode, prompts)
        jobs = [Job(ids, limit, options, p if req.wants_p_true else None,
                    stream=bool(req.stream)) for ids, p in zip(encoded, prompts, strict=True)]
        server.submit(jobs)
        if req.stream:
            return _EventStream(server, jobs, server.stream(jobs, req, "completion"))
        return await server.complete(jobs, req, "completion", request)

    @app.post("/v1/chat/completions", openapi_extra=_request_body(ChatRequest),
              responses=_ERROR_RESPONSES)
    async def chat(request: Request):
        server.authorize(request)
        req = await server.parse(request, ChatRequest)
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        limit = server.max_tokens(req.limit(), config.max_tokens_limit)
        messages = [{"role": "system" if m.role == "developer" else m.role,
                     "content": m.text()} for m in req.messages]
        users = [m["content"] for m in messages if m["role"] == "user"]
        if req.wants_p_true and not users:
            raise APIError(400, "P(True) needs a user message to score the answer against",
                           param="messages")
        server.check_chars(sum(len(m["content"]) for m in messages), "the messages' text",
                           "messages")
        top = (req.top_logprobs or 0) if req.logprobs else 0
        server.check_raw(req, bool(req.logprobs))
        constrained = req.choices()
        if constrained is not None:
            server.check_constrained(req, logprobs=bool(req.logprobs), max_tokens=req.limit())
        ids = await run_in_threadpool(server.encode_chat, messages)
        if constrained is not None:
            return await server.constrained([ids], [users[-1] if users else ""], constrained,
                                            req, "chat", request)
        job = Job(ids, limit, server.options(req, top=top),
                  users[-1] if req.wants_p_true else None, stream=bool(req.stream))
        server.submit([job])
        if req.stream:
            return _EventStream(server, [job], server.stream([job], req, "chat"))
        return await server.complete([job], req, "chat", request)

    app.openapi = lambda: _openapi(app, server)  # type: ignore[method-assign]
    return app


def app_from_environment() -> FastAPI:
    """The app for ``uvicorn --factory`` workers: the config comes from ``CALM_SERVE_CONFIG``."""
    text = os.environ.get(CONFIG_ENV)
    if not text:
        raise CalmError(f"{CONFIG_ENV} is not set; start the server with `calm serve ENGINE`")
    return create_app(ServeConfig.from_json(text))


def _too_large(config: ServeConfig) -> APIError:
    return APIError(413, f"the request body exceeds {config.max_body_bytes} bytes; send a "
                    "shorter prompt", code="request_too_large")


def _event(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


# ---------------------------------------------------------------------- the request's body
class _Guard:
    """ASGI middleware around every HTTP request: reads the body under the size limit and
    keeps the request metrics (count by status, latency, in flight).

    The body is read here, counting bytes as they arrive; past ``max_body_bytes`` (or with
    a ``Content-Length`` over it) the answer is 413 with ``Connection: close`` and the rest
    of the body is never read. Otherwise the app receives the body as one message, then
    the server's own ``receive`` (which reports the client's disconnect).
    """

    def __init__(self, app, server: _Server) -> None:
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
            if body is _TOO_LARGE:
                response = self.server.error_response(_too_large(self.server.config),
                                                      headers={"Connection": "close"})
                await response(scope, receive, tracked)
            elif body is not None:  # None: the client left while sending
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


class _NotJSONNumber(ValueError):
    pass


def _not_a_json_number(name: str):
    raise _NotJSONNumber(name)


def _load_json(body: bytes):
    """The body's JSON value, or a 400 that says what is wrong with the text."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {exc.start}); send "
                       "JSON encoded as UTF-8") from None
    try:
        return json.loads(text, parse_constant=_not_a_json_number)
    except RecursionError:
        raise APIError(400, "the request body's JSON is nested too deeply; send a JSON "
                       "object a few levels deep") from None
    except json.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON ({exc.msg} at line "
                       f"{exc.lineno} column {exc.colno}); send a JSON object") from None
    except _NotJSONNumber as exc:
        raise APIError(400, f"the request body is not valid JSON ({exc} is not a JSON number); "
                       "send finite numbers") from None
    except ValueError:  # an integer of more digits than Python converts
        raise APIError(400, "the request body's JSON holds a number too long to read; send "
                       "numbers of ordinary size") from None


def _lone_surrogate(data) -> str | None:
    """Where the first string (or key) holding a lone UTF-16 surrogate is, else ``None``
    (``""`` for a key of the top-level object)."""
    stack = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return path
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                if _SURROGATE.search(key):
                    return path
                stack.append((item, f"{path}.{key}" if path else key))
        elif isinstance(value, list):
            for index in range(len(value) - 1, -1, -1):
                stack.append((value[index], f"{path}.{index}" if path else str(index)))
    return None


def _error_param(error: dict, data) -> str | None:
    """The dotted place in the body of a pydantic error (union members' tags dropped)."""
    parts, node = [], data
    loc = error.get("loc", ())
    for i, part in enumerate(loc):
        if isinstance(node, dict) and isinstance(part, str) and part in node:
            node = node[part]
            parts.append(part)
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
            parts.append(str(part))
        elif isinstance(node, dict) and error.get("type") == "missing" and i == len(loc) - 1:
            parts.append(str(part))
        # anything else is the tag of a union's member ("str", "list[str]"), not a place
    return _clip(".".join(parts)) or None


def _clip(text: str, size: int = 120) -> str:
    return text if len(text) <= size else text[:size] + "..."


# ---------------------------------------------------------------------- streaming
class _EventStream(StreamingResponse):
    """The SSE response: while it streams it listens for the client's disconnect (whatever
    the ASGI server's spec version), and when the client leaves early the request's rows
    stop decoding."""

    def __init__(self, server: _Server, jobs: list[Job], events) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._server = server
        self._jobs = jobs

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def respond() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client left while an event was written
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(respond)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
            self._server.abandon(self._jobs)


# ---------------------------------------------------------------------- OpenAPI
def _request_body(model) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def _openapi(app: FastAPI, server: _Server) -> dict:
    """FastAPI's schema plus the request models (the endpoints parse bodies themselves) with
    this server's limits, and, with an API key, the bearer scheme on every endpoint but
    ``/health``."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                             description="OpenAI-compatible completions with calibrated "
                                         "confidences")
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (CompletionRequest, ChatRequest):
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            _document_limits(body, server)
            components[model.__name__] = body
        if server.has_key:
            schema["components"]["securitySchemes"] = {"bearer": {"type": "http",
                                                                  "scheme": "bearer"}}
            for path, operations in schema["paths"].items():
                if path != "/health":
                    for operation in operations.values():
                        operation["security"] = [{"bearer": []}]
        app.openapi_schema = schema
    return app.openapi_schema


def _document_limits(body: dict, server: _Server) -> None:
    """Narrow a request model's JSON schema to what this server accepts, so that a request
    the schema calls valid is served (a 2xx): its model name, its limits, the single value
    of each parameter calm cannot vary (the request models take any value there, to refuse
    it by name), the rules between fields (``if``/``then``), and text short enough for the
    context whatever the tokenizer (at most :data:`TOKENS_PER_CHAR` tokens a character; the
    server itself takes longer text that fits)."""
    config = server.config
    properties = body["properties"]

    def optional(schema: dict, default=None) -> dict:
        return {"anyOf": [schema, {"type": "null"}], "default": default}

    chat = "prompt" not in properties
    # the longest text that fits whatever it tokenises to (the chat template's own tokens
    # are set aside first)
    room = max(1, server.max_prompt - (server.template_tokens if chat else 1))
    text_chars = max(1, room // TOKENS_PER_CHAR)
    text = {"type": "string", "minLength": 1, "maxLength": text_chars}
    tokens = optional({"type": "integer", "minimum": 1, "maximum": config.max_tokens_limit})
    choices = {"type": "array", "minItems": MIN_CHOICES, "maxItems": MAX_CHOICES,
               "uniqueItems": True,
               "items": {"type": "string", "minLength": 1,
                         "maxLength": min(MAX_CHOICE_CHARS, text_chars), "pattern": r"\S"}}
    properties["model"] = {"type": "string", "enum": [config.served_name]}
    properties["n"] = optional({"type": "integer", "minimum": 1, "maximum": 1}, 1)
    for name in ("presence_penalty", "frequency_penalty"):
        properties[name] = optional({"type": "number", "minimum": 0, "maximum": 0}, 0.0)
    properties["logit_bias"] = optional({"type": "object", "maxProperties": 0})
    properties["stop"] = optional({"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 4}]})
    properties["max_tokens"] = tokens
    properties["guided_choice"] = optional(choices)
    properties["structured_outputs"] = optional({
        "type": "object", "properties": {"choice": choices}, "required": ["choice"],
        "additionalProperties": False})
    raw_ok = _raw_recoverable(server)
    calm = {"type": "object", "additionalProperties": False, "properties": {
        "p_true": {"type": "boolean"},
        "choice_mode": optional({"enum": ["cloze"]}),  # letter mode needs a question
        "abstain_below": optional({"type": "number", "minimum": 0, "maximum": 1}),
        "raw_logprobs": {"type": "boolean"} if raw_ok else {"const": False}}}
    properties["calm"] = optional(calm)
    constrained = {"anyOf": [{"required": ["guided_choice"],
                              "properties": {"guided_choice": {"type": "array"}}},
                             {"required": ["structured_outputs"],
                              "properties": {"structured_outputs": {"type": "object"}}}]}
    absent = {"type": "null"}
    no_p_true = optional({"type": "object", "properties": {"p_true": {"const": False},
                                                             "raw_logprobs": {"const": False}}})
    rules = [
        # one form of constrained choice at a time
        {"not": {"required": ["guided_choice", "structured_outputs"],
                 "properties": {"guided_choice": {"type": "array"},
                                "structured_outputs": {"type": "object"}}}},
        # a constrained choice is answered whole, with option probabilities only
        {"if": constrained, "then": {"properties": {
            "stream": {"enum": [False, None]}, "stop": absent, "calm": no_p_true,
            "logprobs": {"enum": [None, False]}, "echo": {"enum": [False, None]},
            "top_logprobs": absent}}},
    ]
    if chat:
        properties["max_completion_tokens"] = tokens
        part = {"type": "object", "additionalProperties": False, "required": ["type", "text"],
                "properties": {"type": {"const": "text"},
                               "text": {"type": "string", "maxLength": text_chars}}}
        message = properties["messages"]
        message["maxItems"] = CHAT_MESSAGES_DOCUMENTED
        per_message = max(1, text_chars // CHAT_MESSAGES_DOCUMENTED)
        message["items"] = {
            "type": "object", "additionalProperties": False, "required": ["role", "content"],
            "properties": {
                "role": {"enum": ["system", "developer", "user", "assistant"]},
                "content": {"anyOf": [
                    {"type": "string", "maxLength": per_message},
                    {"type": "array", "maxItems": 1,
                     "items": {**part, "properties": {**part["properties"], "text": {
                         "type": "string", "maxLength": per_message}}}}]},
                "name": optional({"type": "string", "maxLength": 64})}}
        # P(True) judges the last user message: there must be one; top_logprobs needs logprobs
        rules += [
            {"if": {"required": ["calm"], "properties": {"calm": {
                "type": "object", "required": ["p_true"],
                "properties": {"p_true": {"const": True}}}}},
             "then": {"properties": {"messages": {"contains": {
                 "type": "object", "properties": {"role": {"const": "user"}}}}}}},
            {"if": {"required": ["top_logprobs"],
                    "properties": {"top_logprobs": {"type": "integer"}}},
             "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}},
            {"if": {"required": ["calm"], "properties": {"calm": {
                "type": "object", "required": ["raw_logprobs"],
                "properties": {"raw_logprobs": {"const": True}}}}},
             "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}},
        ]
    else:
        properties["prompt"] = {"anyOf": [text, {"type": "array", "items": text, "minItems": 1,
                                                 "maxItems": config.max_queue}]}
        # max_tokens 0 with echo: prompt scoring (echo is refused with any other max_tokens)
        properties["max_tokens"] = optional({"type": "integer", "minimum": 0,
                                             "maximum": config.max_tokens_limit})
        properties["echo"] = optional({"type": "boolean"}, False)
        properties["best_of"] = optional({"type": "integer", "minimum": 1, "maximum": 1})
        properties["suffix"] = optional({"type": "string", "maxLength": 0})
        echo = {"required": ["echo"], "properties": {"echo": {"const": True}}}
        rules += [
            {"if": echo, "then": {"required": ["max_tokens"], "properties": {
                "max_tokens": {"const": 0}, "stream": {"enum": [False, None]}}},
             "else": {"properties": {"max_tokens": {"anyOf": [{"type": "null"},
                                                              {"minimum": 1}]}}}},
            {"if": {"required": ["calm"], "properties": {"calm": {
                "type": "object", "required": ["raw_logprobs"],
                "properties": {"raw_logprobs": {"const": True}}}}},
             "then": {"required": ["logprobs"],
                      "properties": {"logprobs": {"type": "integer"}}}},
        ]
    body["allOf"] = rules


#: a character is at most this many tokens (its UTF-8 bytes, under byte-level BPE or byte
#: fallback): what the documented text limits assume
TOKENS_PER_CHAR = 4
#: the messages of a documented chat request (the server takes more that fit)
CHAT_MESSAGES_DOCUMENTED = 8


def _template_tokens(lm: CalibratedLM) -> int:
    if not lm.tokenizer.has_chat_template:
        return 0
    roles = ["system"] + ["user", "assistant"] * CHAT_MESSAGES_DOCUMENTED
    try:
        ids = lm.tokenizer.encode_chat([{"role": r, "content": ""}
                                        for r in roles[:CHAT_MESSAGES_DOCUMENTED]])
    except CalmError:
        return 0
    return len(ids) + 1


def _raw_recoverable(server: _Server) -> bool:
    try:
        _ = server.lm.raw_logit_scale
        return True
    except CalmError:
        return False


class _Server:
    """The state one app holds: engine, batcher, metrics, key and identity."""

    def __init__(self, config: ServeConfig, lm: CalibratedLM) -> None:
        self.config = config
        self.lm = lm
        self.metrics = ServerMetrics()
        self.batcher = MicroBatcher(lm, max_batch_size=config.max_batch_size,
                                    window_s=config.batch_window_ms / 1000,
                                    max_queue=config.max_queue, metrics=self.metrics)
        self._key = config.api_key()
        self.created = int(time.time())
        self.max_prompt = min(config.max_prompt_tokens or lm.max_context - 1,
                              lm.max_context - 1)
        self.max_prompt_chars = self.max_prompt * PROMPT_CHARS_PER_TOKEN
        manifest = lm.manifest
        digest = hashlib.sha256((manifest.root / ENGINE_MANIFEST_NAME).read_bytes()).hexdigest()
        self.fingerprint = f"calm-{digest[:16]}"
        #: which outputs are calibrated, by which fit (None: the model's own); in every
        #: response's calm object
        self.calibrated = lm.calibrated_outputs
        self._scoring_gate: asyncio.Semaphore | None = None  # made in the event loop
        #: tokens the chat template adds around CHAT_MESSAGES_DOCUMENTED messages (the
        #: documented text limits leave room for them)
        self.template_tokens = _template_tokens(lm)
        fitted = (lm.manifest.export or {}).get("prompt_format")
        if fitted == "plain" and lm.tokenizer.has_chat_template and lm.choice_mode == "letter":
            logger.warning("%s: its calibration was fitted on plain-text letter prompts; "
                           "/v1/chat/completions renders the chat template, a format the fit "
                           "did not see (fit with the default --chat to calibrate chat "
                           "traffic)", lm.manifest.root)
        self._scoring_waiting = 0
        self.identity = {"engine": config.served_name, "engine_manifest_sha256": digest,
                         "engine_kind": manifest.kind, "backend": lm.backend.description,
                         "source_model": manifest.source.get("model", {}).get("name"),
                         "calibration": manifest.calibration}

    @property
    def has_key(self) -> bool:
        return self._key is not None

    def error_response(self, exc: APIError, headers: dict | None = None) -> JSONResponse:
        self.metrics.errors.labels(exc.type).inc()
        headers = dict(headers or {})
        if exc.status == 429:
            headers["Retry-After"] = "1"
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers or None)

    # ------------------------------------------------------------------ requests
    def authorize(self, request: Request) -> None:
        if self._key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                 self._key.encode()):
            raise APIError(401, "invalid or missing API key; send 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    async def parse(self, request: Request, model):
        body = await request.body()
        if len(body) > self.config.max_body_bytes:  # _Guard refuses these before
            raise _too_large(self.config)
        data = _load_json(body)
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object")
        if _SURROGATE_ESCAPE.search(body.decode("utf-8")):
            where = _lone_surrogate(data)
            if where is not None:
                raise APIError(400, f"{_clip(where) or 'a key of the body'} holds a lone UTF-16 "
                               "surrogate (an unpaired \\ud800-\\udfff escape), which is not "
                               "valid Unicode; send valid text", param=_clip(where) or None)
        try:
            req = model.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = _error_param(first, data)
            raise APIError(400, f"{where}: {first['msg']}" if where else first["msg"],
                           param=where) from None
        if req.model != self.config.served_name:
            raise APIError(404, f"model {_clip(req.model, 80)!r} is not served here; this server "
                           f"serves {self.config.served_name!r}", param="model",
                           code="model_not_found")
        bad = req.unsupported()
        if bad:
            raise APIError(400, f"{', '.join(bad)} not supported by calm serve; remove "
                           f"{'it' if len(bad) == 1 else 'them'} from the request",
                           param=bad[0])
        return req

    def max_tokens(self, asked: int | None, default: int) -> int:
        value = default if asked is None else asked
        if value > self.config.max_tokens_limit:
            raise APIError(400, f"max_tokens {value} exceeds this server's limit of "
                           f"{self.config.max_tokens_limit}; ask for fewer tokens",
                           param="max_tokens")
        return value

    def check_constrained(self, req, *, logprobs: bool, max_tokens: int | None) -> None:
        """Refuse, naming it, each field a constrained choice cannot honour: its answer is one
        of the choices, scored whole, with calibrated ``option_probabilities`` in the ``calm``
        object (not token ``logprobs``), never cut by ``stop`` or ``max_tokens`` (which must
        still be within the server's limit)."""
        refused = [("logprobs", logprobs, "the calm object's option_probabilities are the "
                    "calibrated distribution over the choices"),
                   ("echo", bool(getattr(req, "echo", False)), "echo scores the prompt only"),
                   ("stop", bool(req.stops()), "a choice is answered whole"),
                   ("calm.p_true", req.wants_p_true, "the choice's confidence is its calibrated "
                    "option probability"),
                   ("n", (req.n or 1) > 1, "a choice has one answer")]
        for name, given, why in refused:
            if given:
                raise APIError(400, f"{name} is not supported with a constrained choice ({why}); "
                               "drop it", param=name)
        if max_tokens is not None:
            self.max_tokens(max_tokens, self.config.default_max_tokens)

    def options(self, req, *, top: int) -> dict:
        return {"temperature": 1.0 if req.temperature is None else float(req.temperature),
                "top_p": 1.0 if req.top_p is None else float(req.top_p),
                "top_k": req.top_k or 0, "seed": req.seed, "stop": req.stops(),
                "top_alternatives": top, "raw_logprobs": req.wants_raw}

    def check_raw(self, req, logprobs: bool) -> None:
        """Refuse ``calm.raw_logprobs`` without ``logprobs``, with constrained choices, or
        on an engine whose raw log-probabilities cannot be recovered (per-token
        calibration)."""
        if not req.wants_raw:
            return
        if not logprobs:
            raise APIError(400, "calm.raw_logprobs needs logprobs (the raw values come beside "
                           "the calibrated ones); set logprobs", param="calm")
        if req.choices() is not None:
            raise APIError(400, "calm.raw_logprobs is for generated or echoed tokens, not "
                           "constrained choices (their option_probabilities are calibrated)",
                           param="calm")
        try:
            _ = self.lm.raw_logit_scale
        except CalmError as exc:
            raise APIError(400, str(exc), param="calm") from None

    def check_chars(self, count: int, what: str, param: str) -> None:
        """Refuse a prompt too long to be worth tokenising (see PROMPT_CHARS_PER_TOKEN)."""
        if count > self.max_prompt_chars:
            raise APIError(400, f"{what} is {count} characters; this server takes prompts of "
                           f"at most {self.max_prompt} tokens, so at most "
                           f"{self.max_prompt_chars} characters ({PROMPT_CHARS_PER_TOKEN} per "
                           "token); shorten it", param=param, code="context_length_exceeded")

    def encode(self, prompts: list[str]) -> list[list[int]]:
        """Token ids of each prompt (blocking: call it on a worker thread)."""
        encoded = []
        for index, prompt in enumerate(prompts):
            label = "the prompt" if len(prompts) == 1 else f"prompt[{index}]"
            try:
                ids = self.lm._encode_prompt(prompt, False, label)
            except CalmError as exc:
                raise APIError(400, str(exc), param="prompt") from None
            encoded.append(self._check_prompt(ids))
        return encoded

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of the rendered conversation (blocking: call it on a worker thread)."""
        try:
            ids = self.lm.tokenizer.encode_chat(
                messages, allow_special_tokens=self.config.allow_special_tokens)
        except CalmError as exc:
            raise APIError(400, str(exc), param="messages") from None
        return self._check_prompt(ids)

    def _check_prompt(self, ids: list[int]) -> list[int]:
        if len(ids) > self.max_prompt:
            raise APIError(400, f"the prompt is {len(ids)} tokens; this server takes at most "
                           f"{self.max_prompt}; shorten it", code="context_length_exceeded")
        return ids

    def submit(self, jobs: list[Job]) -> None:
        try:
            for job in jobs:
                self.batcher.submit(job)
        except QueueFull:
            for job in jobs:
                self.batcher.cancel(job)
            raise APIError(429, f"the server's queue is full ({self.batcher.max_queue} rows "
                           "waiting); retry shortly", type="rate_limit_error",
                           code="queue_full") from None
        except ShuttingDown:
            raise APIError(503, "the server is shutting down; retry on another replica",
                           type="server_error", code="shutting_down") from None

    def abandon(self, jobs: list[Job], client_left: bool = True) -> None:
        """Stop the request's unfinished rows; count the request when its client left."""
        live = [job for job in jobs if not job.future.done()]
        for job in live:
            self.batcher.cancel(job)
        if live and client_left:
            self.metrics.cancelled.inc()
            logger.info("a client went away; stopped %d unfinished row(s) of its request",
                        len(live))

    # ------------------------------------------------------------------ responses
    async def scoring(self, request: Request, fn, *args, **kwargs):
        """Run a prompt-scoring call (an echo, a constrained choice) under the same admission
        control as generation: at most ``max_queue`` waiting (then 429), one at a time on the
        engine beside the batcher, cut at ``request_timeout_s`` (504) or when the client
        disconnects (``None``); the call stops between its steps (``should_stop``), so its
        thread is free again at once. Its memory is bounded inside the call (the scoring
        budget of :mod:`calm_runtime._scoring`)."""
        loop = asyncio.get_running_loop()
        if self._scoring_gate is None:
            self._scoring_gate = asyncio.Semaphore(1)
        if self._scoring_waiting >= self.config.max_queue:
            raise APIError(429, f"{self._scoring_waiting} scoring requests are waiting (the "
                           "limit is --max-queue); retry later", type="rate_limit_error",
                           code="queue_full")
        deadline = loop.time() + self.config.request_timeout_s
        stop = threading.Event()
        gone = asyncio.ensure_future(_client_gone(request.receive))
        self._scoring_waiting += 1
        waiting = True
        try:
            try:
                await asyncio.wait_for(self._scoring_gate.acquire(),
                                       timeout=max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise self._scoring_timeout() from None
            self._scoring_waiting -= 1
            waiting = False
            try:
                task = asyncio.ensure_future(run_in_threadpool(
                    functools.partial(fn, *args, should_stop=stop.is_set, **kwargs)))
                done, _ = await asyncio.wait({task, gone},
                                             timeout=max(0.0, deadline - loop.time()),
                                             return_when=asyncio.FIRST_COMPLETED)
                if task in done:
                    return task.result()
                stop.set()
                with contextlib.suppress(ScoringStopped, CalmError):
                    await task  # returns at the call's next step
                self.metrics.cancelled.inc()
                if gone in done and gone.exception() is None:
                    return None
                raise self._scoring_timeout()
            finally:
                self._scoring_gate.release()
        finally:
            if waiting:
                self._scoring_waiting -= 1
            gone.cancel()

    def _scoring_timeout(self) -> APIError:
        return APIError(504, f"the request did not finish within "
                        f"{self.config.request_timeout_s:g} s; retry with shorter prompts or "
                        "fewer choices", type="timeout_error", code="timeout")

    def _timeout(self, jobs: list[Job]) -> APIError:
        for job in jobs:
            self.batcher.cancel(job)
        return APIError(504, f"the request did not finish within "
                        f"{self.config.request_timeout_s:g} s; retry or ask for fewer tokens",
                        type="timeout_error", code="timeout")

    def _observe(self, result) -> None:
        for token in result.generation.tokens:
            self.metrics.token_confidence.observe(token.confidence)
        self.metrics.sequence_confidence.observe(result.generation.sequence_confidence)
        if result.p_true is not None:
            self.metrics.p_true.observe(result.p_true)

    def _envelope(self, rid: str, kind: str, chunk: bool = False) -> dict:
        obj = {"completion": "text_completion",
               "chat": "chat.completion.chunk" if chunk else "chat.completion"}[kind]
        return {"id": rid, "object": obj, "created": int(time.time()),
                "model": self.config.served_name, "system_fingerprint": self.fingerprint}

    async def _results(self, jobs: list[Job], request: Request):
        """The jobs' results; ``None`` when the client disconnected first (the rows are then
        stopped), a 504 past the timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.request_timeout_s
        waiter = asyncio.gather(*(j.future for j in jobs), return_exceptions=True)
        gone = asyncio.ensure_future(_client_gone(request.receive))
        waiting = {waiter, gone}
        try:
            while True:
                done, _ = await asyncio.wait(waiting, timeout=max(0.0, deadline - loop.time()),
                                             return_when=asyncio.FIRST_COMPLETED)
                if waiter in done:
                    return waiter.result()
                if gone in done:
                    if gone.exception() is None:
                        self.abandon(jobs)
                        return None
                    waiting = {waiter}  # the connection cannot be watched: wait for the answer
                    continue
                raise self._timeout(jobs)
        except asyncio.CancelledError:  # the server is stopping this request
            self.abandon(jobs)
            raise
        finally:
            gone.cancel()

    async def constrained(self, encoded: list[list[int]], questions: list[str],
                          choices: list[str], req, kind: str, request: Request):
        """A constrained choice: the answer is the most probable of ``choices``; the
        ``calm`` object carries the calibrated ``option_probabilities`` (in the given order).
        Cloze: each choice's text continues the prompt as given; letter: the choices are
        listed as ``A. ...`` after the question (the prompt, or the last user message)."""
        options = req.calm or CalmOptions()
        mode = options.choice_mode or self.lm.choice_mode  # the request's, else the engine's
        out = []
        for index, (ids, question) in enumerate(zip(encoded, questions, strict=True)):
            try:
                if mode == "cloze":
                    picked = await self.scoring(request, self.lm.choose_continuation, ids,
                                                choices)
                else:
                    if not question.strip():
                        raise APIError(400, "letter-mode choice needs a question: a non-empty "
                                       "prompt or user message", param="calm.choice_mode")
                    picked = await self.scoring(request, _one_pass(self.lm.choose), question,
                                                choices, "letter", chat=False)
            except CalmError as exc:
                raise APIError(400, str(exc)) from None
            if picked is None:  # the client went away: nobody to answer
                return Response(status_code=CLIENT_CLOSED)
            text = choices[picked.prediction]
            extension = {"option_probabilities": [float(p) for p in picked.probabilities],
                         "confidence": picked.confidence, "choice_mode": mode,
                         "variant": picked.variant,
                         "answer_temperature": picked.answer_temperature,
                         "calibrated": self.calibrated}
            below = (options.abstain_below if options.abstain_below is not None
                     else self.lm.abstain_below)  # the request's, else the engine's
            if below is not None:
                extension["abstained"] = picked.confidence < below
                extension["abstain_below"] = below
            choice = {"index": index, "finish_reason": "stop", "logprobs": None,
                      "calm": extension}
            if kind == "completion":
                choice["text"] = text
            else:
                choice["message"] = {"role": "assistant", "content": text}
            out.append(choice)
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        body = self._envelope(f"{prefix}-{uuid.uuid4().hex}", kind)
        prompt_tokens = sum(len(ids) for ids in encoded)
        body.update(choices=out, usage={"prompt_tokens": prompt_tokens, "completion_tokens": 0,
                                        "total_tokens": prompt_tokens})
        return body

    async def echo(self, prompts: list[str], req, request: Request):
        """``echo`` with ``max_tokens`` 0: every prompt token's calibrated log-probability
        (and ``logprobs`` alternatives), text offsets and no generated text."""
        top = req.logprobs or 0
        choices, prompt_tokens = [], 0
        for index, prompt in enumerate(prompts):
            try:
                scored = await self.scoring(request, self.lm.prompt_logprobs, prompt, top=top,
                                            raw_logprobs=req.wants_raw)
            except CalmError as exc:
                raise APIError(400, str(exc), param="prompt") from None
            if scored is None:  # the client went away: nobody to answer
                return Response(status_code=CLIENT_CLOSED)
            prompt_tokens += len(scored)
            choices.append(await run_in_threadpool(self._echo_choice, index, prompt, scored,
                                                   req, top))
        body = self._envelope(f"cmpl-{uuid.uuid4().hex}", "completion")
        body.update(choices=choices, usage={"prompt_tokens": prompt_tokens,
                                            "completion_tokens": 0,
                                            "total_tokens": prompt_tokens})
        # a long echo with alternatives is megabytes of JSON: encoded off the event loop
        content = await run_in_threadpool(_encode_json, body)
        return Response(content=content, media_type="application/json")

    def _echo_choice(self, index: int, prompt: str, scored, req, top: int) -> dict:
        choice = {"index": index, "text": prompt, "finish_reason": "length",
                  "logprobs": echo_logprobs(scored, top) if req.logprobs is not None
                  else None}
        choice["calm"] = {"calibrated": self.calibrated}
        if req.wants_raw:
            choice["calm"]["raw_logprobs"] = echo_logprobs(scored, top, raw=True)
        return choice

    async def complete(self, jobs: list[Job], req, kind: str, request: Request):
        results = await self._results(jobs, request)
        if results is None:  # nobody to answer
            return Response(status_code=CLIENT_CLOSED)
        for result in results:
            if isinstance(result, CalmError):
                raise APIError(400, str(result))
            if isinstance(result, asyncio.CancelledError):
                raise APIError(503, "the request was cancelled by the server; retry",
                               type="server_error", code="cancelled")
            if isinstance(result, BaseException):
                raise result
        choices = []
        for index, result in enumerate(results):
            self._observe(result)
            g = result.generation
            choice = {"index": index, "finish_reason": FINISH_REASONS[g.finish_reason]}
            if kind == "completion":
                choice["text"] = g.text
                choice["logprobs"] = (None if req.logprobs is None
                                      else completion_logprobs(g.tokens, req.logprobs))
            else:
                choice["message"] = {"role": "assistant", "content": g.text, "refusal": None}
                choice["logprobs"] = (chat_logprobs(g.tokens, req.top_logprobs or 0,
                                                    token_bytes=self.lm.tokenizer.token_bytes)
                                      if req.logprobs else None)
            choice["calm"] = {**choice_extension(g, result.p_true, req.wants_p_true),
                              "calibrated": self.calibrated}
            if req.wants_raw:
                choice["calm"]["raw_logprobs"] = (
                    completion_logprobs(g.tokens, req.logprobs, raw=True)
                    if kind == "completion"
                    else chat_logprobs(g.tokens, req.top_logprobs or 0, raw=True,
                                       token_bytes=self.lm.tokenizer.token_bytes))
            choices.append(choice)
        prompt = sum(len(j.ids) for j in jobs)
        completion = sum(len(r.generation.tokens) for r in results)
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        return {**self._envelope(f"{prefix}-{uuid.uuid4().hex}", kind), "choices": choices,
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                          "total_tokens": prompt + completion},
                "calm": self.identity}

    async def stream(self, jobs: list[Job], req, kind: str):
        """SSE events: one chunk per token, a final chunk per choice, usage, ``[DONE]``.

        The text of a chunk is released only once no stop string can still begin in it, so
        the chunks' texts join to exactly the non-streaming text. Closed early (the client
        left), it stops the unfinished rows.
        """
        rid = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
        deadline = time.monotonic() + self.config.request_timeout_s
        stops = req.stops()
        hold = max((len(s) for s in stops), default=1) - 1
        usage = [0, 0]
        ended = False  # the stream ran to its end (an error event included)

        def chunk(index: int, text: str | None, logprobs, finish, extension) -> dict:
            choice = {"index": index}
            if kind == "completion":
                choice["text"] = text or ""
            else:
                choice["delta"] = {} if text is None else {"content": text}
            choice.update(logprobs=logprobs, finish_reason=finish, calm=extension)
            return {**self._envelope(rid, kind, chunk=True), "choices": [choice]}

        try:
            for index, job in enumerate(jobs):
                if kind == "chat":
                    first = chunk(index, None, None, None, None)
                    first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                    yield _event(first)
                full, sent, offset = "", 0, 0
                while True:
                    token = await asyncio.wait_for(job.tokens.get(), deadline - time.monotonic())
                    if token is END:
                        break
                    full += token.text
                    upto = len(full) - hold
                    for stop in stops:
                        at = full.find(stop, max(0, sent - hold))
                        if at >= 0:
                            upto = min(upto, at)
                    text = full[sent:upto] if upto > sent else ""
                    sent = max(sent, upto)
                    if kind == "completion":
                        logprobs = (None if req.logprobs is None
                                    else completion_logprobs([token], req.logprobs, offset))
                    else:
                        logprobs = (chat_logprobs([token], req.top_logprobs or 0,
                                                  token_bytes=self.lm.tokenizer.token_bytes)
                                    if req.logprobs else None)
                    extension = {"token_confidence": token.confidence}
                    if req.wants_raw:
                        extension["raw_logprobs"] = (
                            completion_logprobs([token], req.logprobs, offset, raw=True)
                            if kind == "completion"
                            else chat_logprobs([token], req.top_logprobs or 0, raw=True,
                                               token_bytes=self.lm.tokenizer.token_bytes))
                    offset += len(token.text)
                    yield _event(chunk(index, text, logprobs, None, extension))
                result = await job.future
                self._observe(result)
                g = result.generation
                yield _event(chunk(index, g.text[sent:] if kind == "completion" or
                                   len(g.text) > sent else None, None,
                                   FINISH_REASONS[g.finish_reason],
                                   {**choice_extension(g, result.p_true, req.wants_p_true),
                                    "calibrated": self.calibrated}))
                usage[0] += len(job.ids)
                usage[1] += len(g.tokens)
            if req.stream_options and req.stream_options.include_usage:
                yield _event({**self._envelope(rid, kind, chunk=True), "choices": [],
                              "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1],
                                        "total_tokens": sum(usage)}})
            ended = True
            yield _event("[DONE]")
        except asyncio.TimeoutError:
            ended = True
            error = self._timeout(jobs)
            self.metrics.errors.labels(error.type).inc()
            yield _event(error.body())
        except CalmError as exc:  # the request's input was refused while it ran (P(True))
            ended = True
            self.metrics.errors.labels("invalid_request_error").inc()
            yield _event(APIError(400, str(exc)).body())
        except Exception as exc:  # headers are sent: report in-band, log the details
            ended = True
            logger.error("a streaming request failed", exc_info=exc)
            self.metrics.errors.labels("server_error").inc()
            yield _event(APIError(500, "the server failed on this request; the details are "
                                  "in its log", type="server_error").body())
        finally:
            self.abandon(jobs, client_left=not ended)


def _encode_json(body: dict) -> bytes:
    return json.dumps(body, ensure_ascii=False, allow_nan=False,
                      separators=(",", ":")).encode("utf-8")


def _one_pass(fn):
    """``fn`` for :meth:`_Server.scoring`: one forward pass, too short to stop inside."""
    def call(*args, should_stop=None, **kwargs):
        return fn(*args, **kwargs)
    return call


async def _client_gone(receive) -> None:
    """Return once the client has disconnected (called after the body was read, when the
    server's ``receive`` waits for the disconnect)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        await asyncio.sleep(0.05)  # a server that repeats empty messages: do not spin
