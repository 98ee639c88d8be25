"""The FastAPI application behind ``calm serve``: OpenAI's endpoints over one engine.

    from calm_runtime.server import ServeConfig, create_app
    app = create_app(ServeConfig(engine="engine/"))     # any ASGI server runs it

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (JSON or SSE
streaming), ``GET /v1/models``, ``GET /health`` (never needs the key), ``GET /metrics``
(Prometheus text). Every request is decoded by the :class:`~.batcher.StepScheduler`, so
concurrent requests share one continuously batched decode. Errors are OpenAI error objects:
400 for a bad body or parameter, 401 for a wrong key, 404 for another model or path, 413 for
a body over ``max_body_bytes``, 429 when the queue is full, 503 when a batch ran out of
memory (the next request is served), 504 past ``request_timeout_s``; an unexpected failure
is a 500 whose message hides the traceback (it goes to the log).

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

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException

from calm_runtime._version import __version__
from calm_runtime.errors import CalmError, ConfigError
from calm_runtime.inference.lm import CalibratedLM
from calm_runtime.server.config import ServeConfig
from calm_runtime.server.context import EndpointContext
from calm_runtime.server.guard import Guard
from calm_runtime.server.openapi import openapi_schema, template_tokens
from calm_runtime.server.protocol import APIError
from calm_runtime.server.routes import router
from calm_runtime.server.state import PROMPT_CHARS_PER_TOKEN, ServerState

__all__ = ["create_app", "app_from_environment", "CONFIG_ENV", "PROMPT_CHARS_PER_TOKEN"]

logger = logging.getLogger(__name__)

#: environment variable through which ``calm serve --workers N`` hands each worker its config
CONFIG_ENV = "CALM_SERVE_CONFIG"


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
    app.state.context = EndpointContext.of(server)
    app.add_middleware(Guard, server=server)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
    app.include_router(router)
    app.openapi = lambda: openapi_schema(app, server, template_overhead)  # type: ignore[method-assign]
    return app


async def _api_error(request, exc: APIError):
    return request.app.state.calm.error_response(exc)


async def _http_error(request, exc: StarletteHTTPException):
    return request.app.state.calm.error_response(APIError(
        exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None))


async def _unexpected(request, exc: Exception):
    logger.error("unexpected error", exc_info=exc)
    return request.app.state.calm.error_response(APIError(
        500, "the server failed on this request; the details are in its log",
        type="server_error"))


def app_from_environment() -> FastAPI:
    """The app for ``uvicorn --factory`` workers: the config comes from ``CALM_SERVE_CONFIG``."""
    text = os.environ.get(CONFIG_ENV)
    if not text:
        raise CalmError(f"{CONFIG_ENV} is not set; start the server with `calm serve ENGINE`")
    return create_app(ServeConfig.from_json(text))


