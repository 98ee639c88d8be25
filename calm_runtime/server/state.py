"""The serving state: what one app holds (engine, batcher, metrics, key and identity),
shared by the request intake (intake.py), the response writers (responses.py), the body
guard (guard.py) and the OpenAPI document (openapi.py)."""

from __future__ import annotations

import hashlib
import hmac
import logging
import time

from fastapi import Request
from fastapi.responses import JSONResponse

from calm_runtime import modes
from calm_runtime.formats.engine import ENGINE_MANIFEST_NAME
from calm_runtime.inference.lm import CalibratedLM
from calm_runtime.server.batcher import Job, StepScheduler
from calm_runtime.server.config import ServeConfig
from calm_runtime.server.metrics import ServerMetrics
from calm_runtime.server.protocol import APIError

__all__ = ["ServerState", "ECHO_MAX_ENTRIES", "PROMPT_CHARS_PER_TOKEN"]

logger = logging.getLogger(__name__)

#: the most log-probabilities one echo may return (prompt tokens x (1 + alternatives),
#: twice with raw_logprobs): about 20 MB of JSON
ECHO_MAX_ENTRIES = 500_000
#: a prompt (a chat request: its messages' text together) may hold at most this many
#: characters per token of the server's prompt-token limit; longer ones get a 400 before
#: tokenising. Text averages 3-5 characters per token, so only pathological prompts (say,
#: long runs of one character) that would fit in tokens are refused by it.
PROMPT_CHARS_PER_TOKEN = 32


class ServerState:
    """The state one app holds: engine, batcher, metrics, key and identity."""

    def __init__(self, config: ServeConfig, lm: CalibratedLM) -> None:
        self.config = config
        self.lm = lm
        self.metrics = ServerMetrics()
        self.batcher = StepScheduler(
            lm, max_batch_size=config.max_batch_size, window_s=config.batch_window_ms / 1000,
            max_queue=config.max_queue, max_step_prefill_tokens=config.max_step_prefill_tokens,
            metrics=self.metrics)
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
        fitted = (lm.manifest.export or {}).get("prompt_format")
        if (fitted == "plain" and lm.tokenizer.has_chat_template
                and modes.mode(lm.choice_mode).chat_prompts):
            logger.warning("%s: its calibration was fitted on plain-text letter prompts; "
                           "/v1/chat/completions renders the chat template, a format the fit "
                           "did not see (fit with the default --chat to calibrate chat "
                           "traffic)", lm.manifest.root)
        self.identity = {"engine": config.served_name, "engine_manifest_sha256": digest,
                         "engine_kind": manifest.kind, "backend": lm.backend.description,
                         "source_model": manifest.source.get("model", {}).get("name"),
                         "calibration": {**manifest.calibration,
                                         "fused": manifest.head_calibrated}}

    @property
    def has_key(self) -> bool:
        return self._key is not None

    def authorize(self, request: Request) -> None:
        if self._key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                 self._key.encode()):
            raise APIError(401, "invalid or missing API key; send 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    def error_response(self, exc: APIError, headers: dict | None = None) -> JSONResponse:
        self.metrics.errors.labels(exc.type).inc()
        headers = dict(headers or {})
        if exc.status == 429:
            headers["Retry-After"] = "1"
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers or None)

    def abandon(self, jobs: list[Job], client_left: bool = True) -> None:
        """Stop the request's unfinished rows; count the request when its client left."""
        live = [job for job in jobs if not job.future.done()]
        for job in live:
            self.batcher.cancel(job)
        if live and client_left:
            self.metrics.cancelled.inc()
            logger.info("a client went away; stopped %d unfinished row(s) of its request",
                        len(live))
