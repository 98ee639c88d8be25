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
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import ENGINE_MANIFEST_NAME
from ..errors import CalmError
from ..lm import CalibratedLM
from .batcher import END, Job, MicroBatcher, QueueFull, ShuttingDown
from .config import ServeConfig
from .metrics import CONTENT_TYPE_LATEST, ServerMetrics
from .protocol import (
    FINISH_REASONS,
    APIError,
    ChatRequest,
    CompletionRequest,
    chat_logprobs,
    choice_extension,
    completion_logprobs,
)

__all__ = ["create_app", "app_from_environment", "CONFIG_ENV"]

logger = logging.getLogger(__name__)

#: environment variable through which ``calm serve --workers N`` hands each worker its config
CONFIG_ENV = "CALM_SERVE_CONFIG"
_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


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

    app = FastAPI(title="calm serve", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.calm = server

    @app.exception_handler(APIError)
    async def _api_error(_request, exc: APIError):
        server.metrics.errors.labels(exc.type).inc()
        headers = {"Retry-After": "1"} if exc.status == 429 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, exc: StarletteHTTPException):
        error = APIError(exc.status_code, str(exc.detail), code="not_found"
                         if exc.status_code == 404 else None)
        return await _api_error(_request, error)

    @app.exception_handler(Exception)
    async def _unexpected(_request, exc: Exception):
        logger.error("unexpected error", exc_info=exc)
        return await _api_error(_request, APIError(
            500, "the server failed on this request; the details are in its log",
            type="server_error"))

    @app.middleware("http")
    async def _observe(request: Request, call_next):
        path = request.url.path
        endpoint = path if path in _ENDPOINTS else "other"
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > config.max_body_bytes:
            response = await _api_error(request, _too_large(config))
        else:
            api = path.startswith("/v1/")
            if api:
                server.metrics.in_flight.inc()
            started = time.perf_counter()
            try:
                response = await call_next(request)
            finally:
                if api:
                    server.metrics.in_flight.dec()
            server.metrics.latency.labels(endpoint).observe(time.perf_counter() - started)
        server.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": config.served_name, "queue_depth": server.batcher.depth}

    @app.get("/metrics")
    async def metrics(request: Request):
        server.authorize(request)
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        server.authorize(request)
        return {"object": "list", "data": [{"id": config.served_name, "object": "model",
                                            "created": server.created, "owned_by": "calm",
                                            "calm": server.identity}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        server.authorize(request)
        req = await server.parse(request, CompletionRequest)
        prompts = [req.prompt] if isinstance(req.prompt, str) else list(req.prompt)
        if not prompts or len(prompts) > config.max_queue:
            raise APIError(400, f"prompt must be a string or a list of 1 to {config.max_queue} "
                           "strings", param="prompt")
        limit = server.max_tokens(req.max_tokens, config.default_max_tokens)
        options = server.options(req, top=req.logprobs or 0)
        jobs = [Job(server.encode(p), limit, options, p if req.wants_p_true else None,
                    stream=bool(req.stream)) for p in prompts]
        server.submit(jobs)
        if req.stream:
            return _sse(server.stream(jobs, req, "completion"))
        return await server.complete(jobs, req, "completion")

    @app.post("/v1/chat/completions")
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
        top = (req.top_logprobs or 0) if req.logprobs else 0
        job = Job(server.encode_chat(messages), limit, server.options(req, top=top),
                  users[-1] if req.wants_p_true else None, stream=bool(req.stream))
        server.submit([job])
        if req.stream:
            return _sse(server.stream([job], req, "chat"))
        return await server.complete([job], req, "chat")

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


def _sse(events) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def _event(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


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
        manifest = lm.manifest
        digest = hashlib.sha256((manifest.root / ENGINE_MANIFEST_NAME).read_bytes()).hexdigest()
        self.fingerprint = f"calm-{digest[:16]}"
        self.identity = {"engine": config.served_name, "engine_manifest_sha256": digest,
                         "engine_kind": manifest.kind, "backend": lm.backend.description,
                         "source_model": manifest.source.get("model", {}).get("name"),
                         "calibration": manifest.calibration}

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
        if len(body) > self.config.max_body_bytes:
            raise _too_large(self.config)
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise APIError(400, "the request body is not valid JSON; send a JSON object") \
                from None
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object")
        try:
            req = model.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or None
            raise APIError(400, f"{where}: {first['msg']}" if where else first["msg"],
                           param=where) from None
        if req.model != self.config.served_name:
            raise APIError(404, f"model {req.model!r} is not served here; this server serves "
                           f"{self.config.served_name!r}", param="model",
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

    def options(self, req, *, top: int) -> dict:
        return {"temperature": 1.0 if req.temperature is None else float(req.temperature),
                "top_p": 1.0 if req.top_p is None else float(req.top_p),
                "top_k": req.top_k or 0, "seed": req.seed, "stop": req.stops(),
                "top_alternatives": top}

    def encode(self, prompt: str) -> list[int]:
        try:
            ids = self.lm.encode_prompt(prompt, chat=False)
        except CalmError as exc:
            raise APIError(400, str(exc), param="prompt") from None
        return self._check_prompt(ids)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        try:
            text = self.lm.tokenizer.render_chat(messages)
        except CalmError as exc:
            raise APIError(400, str(exc), param="messages") from None
        return self._check_prompt(self.lm.tokenizer.encode(text, add_bos=False))

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
                job.future.cancel()
            raise APIError(429, f"the server's queue is full ({self.batcher.max_queue} rows "
                           "waiting); retry shortly", type="rate_limit_error",
                           code="queue_full") from None
        except ShuttingDown:
            raise APIError(503, "the server is shutting down; retry on another replica",
                           type="server_error", code="shutting_down") from None

    # ------------------------------------------------------------------ responses
    def _timeout(self, jobs: list[Job]) -> APIError:
        for job in jobs:
            job.future.cancel()
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

    async def complete(self, jobs: list[Job], req, kind: str) -> dict:
        try:
            results = await asyncio.wait_for(asyncio.gather(*(j.future for j in jobs)),
                                             self.config.request_timeout_s)
        except asyncio.TimeoutError:
            raise self._timeout(jobs) from None
        except CalmError as exc:
            raise APIError(400, str(exc)) from None
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
                choice["logprobs"] = (chat_logprobs(g.tokens, req.top_logprobs or 0)
                                      if req.logprobs else None)
            choice["calm"] = choice_extension(g, result.p_true, req.wants_p_true)
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
        the chunks' texts join to exactly the non-streaming text.
        """
        rid = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
        deadline = time.monotonic() + self.config.request_timeout_s
        stops = req.stops()
        hold = max((len(s) for s in stops), default=1) - 1
        usage = [0, 0]

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
                        logprobs = (chat_logprobs([token], req.top_logprobs or 0)
                                    if req.logprobs else None)
                    offset += len(token.text)
                    yield _event(chunk(index, text, logprobs, None,
                                       {"token_confidence": token.confidence}))
                result = await job.future
                self._observe(result)
                g = result.generation
                yield _event(chunk(index, g.text[sent:] if kind == "completion" or
                                   len(g.text) > sent else None, None,
                                   FINISH_REASONS[g.finish_reason],
                                   choice_extension(g, result.p_true, req.wants_p_true)))
                usage[0] += len(job.ids)
                usage[1] += len(g.tokens)
            if req.stream_options and req.stream_options.include_usage:
                yield _event({**self._envelope(rid, kind, chunk=True), "choices": [],
                              "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1],
                                        "total_tokens": sum(usage)}})
            yield _event("[DONE]")
        except asyncio.TimeoutError:
            error = self._timeout(jobs)
            self.metrics.errors.labels(error.type).inc()
            yield _event(error.body())
        except Exception as exc:  # headers are sent: report in-band, log the details
            logger.error("a streaming request failed", exc_info=exc)
            self.metrics.errors.labels("server_error").inc()
            yield _event(APIError(500, "the server failed on this request; the details are "
                                  "in its log", type="server_error").body())
        finally:
            for job in jobs:
                if not job.future.done():
                    job.future.cancel()
