"""The serving logic behind the routes: authorisation, validation against the limits,
encoding, admission (queue, timeouts, disconnects) and the response builders."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import logging
import threading
import time

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from ..engine import ENGINE_MANIFEST_NAME
from ..errors import CalmError
from ..lm import CalibratedLM
from ..scoring_passes import ScoringStopped
from .batcher import Job, MicroBatcher, QueueFull, ShuttingDown
from .config import ServeConfig
from .guard import _too_large
from .json_body import _SURROGATE_ESCAPE, _clip, _error_param, _load_json, _lone_surrogate
from .metrics import ServerMetrics
from .protocol import (
    APIError,
)
from .responses import _client_gone, _Responses, out_of_memory

logger = logging.getLogger(__name__)

#: the most log-probabilities one echo may return (prompt tokens x (1 + alternatives),
#: twice with raw_logprobs): about 20 MB of JSON
ECHO_MAX_ENTRIES = 500_000
#: a prompt (a chat request: its messages' text together) may hold at most this many
#: characters per token of the server's prompt-token limit; longer ones get a 400 before
#: tokenising. Text averages 3-5 characters per token, so only pathological prompts (say,
#: long runs of one character) that would fit in tokens are refused by it.
PROMPT_CHARS_PER_TOKEN = 32

# ---------------------------------------------------------------------- OpenAPI
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


class _Server(_Responses):
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
            encoded.append(self._check_prompt(ids, label))
        return encoded

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of the rendered conversation (blocking: call it on a worker thread)."""
        try:
            ids = self.lm.tokenizer.encode_chat(
                messages, allow_special_tokens=self.config.allow_special_tokens)
        except CalmError as exc:
            raise APIError(400, str(exc), param="messages") from None
        return self._check_prompt(ids, "the conversation", "messages")

    def _check_prompt(self, ids: list[int], label: str = "the prompt",
                      param: str = "prompt") -> list[int]:
        if len(ids) > self.max_prompt:
            raise APIError(400, f"the prompt is {len(ids)} tokens; this server takes at most "
                           f"{self.max_prompt}; shorten it", code="context_length_exceeded")
        try:  # a prompt no prefill pass can hold is refused before it is queued
            self.lm.check_prefill(len(ids), label, "--max-prefill-tokens")
        except CalmError as exc:
            raise APIError(400, str(exc), param=param,
                           code="context_length_exceeded") from None
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
        budget of :mod:`calm_runtime.scoring_passes`)."""
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
                    try:
                        return task.result()
                    except MemoryError as exc:
                        raise out_of_memory(exc) from None
                stop.set()
                with contextlib.suppress(ScoringStopped, CalmError, MemoryError):
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
