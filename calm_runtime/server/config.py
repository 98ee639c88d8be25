"""``ServeConfig``: every setting of ``calm serve`` in one checked, JSON-ready record.

It lives outside ``calm_runtime.server`` so that the command line reads its defaults without
the serve extra (FastAPI); the server imports it from here.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from calm_runtime.errors import ConfigError

__all__ = ["ServeConfig"]


@dataclass(frozen=True)
class ServeConfig:
    """What the server loads and the limits it enforces.

    Attributes:
        engine: the engine directory (fixed at start; no request can choose another).
        model_name: the model id clients send and ``/v1/models`` lists (default: the
            engine folder's name).
        backend, threads: passed to :meth:`CalibratedLM.load`.
        max_batch_size: most rows in the running batch (1 decodes one request at a time).
        batch_window_ms: on an idle server, how long the first request waits for others to
            arrive with it (one prefill for a burst).
        max_step_prefill_tokens: the most prompt tokens admitted into the running batch at
            one step boundary (what one boundary's prefill may stall the running rows for;
            a longer prompt goes in alone, at a boundary with nothing else to admit).
        max_queue: most rows waiting for a batch; beyond it requests get HTTP 429.
        request_timeout_s: a request not finished by then gets HTTP 504.
        max_tokens_limit: the largest ``max_tokens`` a request may ask for.
        default_max_tokens: ``max_tokens`` when a completions request gives none (chat
            requests default to ``max_tokens_limit``).
        max_prompt_tokens: the longest prompt accepted (default: the model's context - 1);
            a prompt of more than ``PROMPT_CHARS_PER_TOKEN`` (32) characters per token of it
            is refused before tokenising (:mod:`calm_runtime.server.app`).
        max_body_bytes: the largest request body accepted: counted as it arrives (chunked
            bodies too), HTTP 413 and the connection closed as soon as it is passed.
        max_prefill_tokens: the most tokens (rows x padded length) one prefill or scoring
            pass takes, with a working set of at most 64 KiB per token of it (attention
            scores and logits): larger batches are split into groups of rows, longer prompts
            into pieces on top of their KV cache; a prompt that cannot fit even alone gets
            HTTP 400 before any work (vLLM's ``--max-num-batched-tokens``;
            :class:`~calm_runtime.inference.generation.PrefillBudget`).
        api_key_env: name of the environment variable that holds the bearer API key
            (``None``: no key). The key itself never enters this record.
        verify_hashes: hash the engine files at load.
        allow_special_tokens: encode special-token text inside chat messages as the special
            tokens themselves (as transformers does); by default it is plain text, so a
            message cannot forge a turn.
        header_timeout_s: a request's headers must arrive within this, from the connection's
            start or its previous response; then the connection is closed (HTTP 408 when
            part of a request came) (:mod:`calm_runtime.server.connections`).
        body_timeout_s: a request's body must arrive within this after its headers, else
            HTTP 408 and the connection is closed.
        max_connections: most open connections; past it the oldest one not running a
            request is closed (lowered to fit the process's file descriptor limit).
        max_connections_per_client: the same, per client address.
    """

    engine: str
    model_name: str | None = None
    backend: str = "onnxruntime"
    threads: int | None = None
    max_batch_size: int = 64
    batch_window_ms: float = 5.0
    max_step_prefill_tokens: int = 512
    max_queue: int = 64
    request_timeout_s: float = 120.0
    max_tokens_limit: int = 512
    default_max_tokens: int = 16
    max_prompt_tokens: int | None = None
    max_body_bytes: int = 1_000_000
    max_prefill_tokens: int = 4096
    api_key_env: str | None = None
    verify_hashes: bool = True
    allow_special_tokens: bool = False
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 512
    max_connections_per_client: int = 128

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_step_prefill_tokens", "max_queue",
                     "max_tokens_limit", "default_max_tokens", "max_body_bytes",
                     "max_prefill_tokens", "max_connections", "max_connections_per_client"):
            _positive_int(getattr(self, name), name)
        for name in ("threads", "max_prompt_tokens"):
            if getattr(self, name) is not None:
                _positive_int(getattr(self, name), name)
        for name, low in (("batch_window_ms", 0.0), ("request_timeout_s", 1e-3),
                          ("header_timeout_s", 1e-3), ("body_timeout_s", 1e-3)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < low:
                raise ConfigError(f"{name} must be a finite number >= {low}, got {value!r}")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ConfigError(f"default_max_tokens {self.default_max_tokens} exceeds "
                              f"max_tokens_limit {self.max_tokens_limit}; lower it or raise the "
                              "limit")

    @property
    def served_name(self) -> str:
        # the name as given (a link named "current" serves as "current"), "." resolved
        return self.model_name or Path(os.path.abspath(self.engine)).name

    def api_key(self) -> str | None:
        """The API key from ``api_key_env`` (read at call time), or ``None`` without one."""
        if self.api_key_env is None:
            return None
        value = os.environ.get(self.api_key_env, "")
        if not value:
            raise ConfigError(f"the environment variable {self.api_key_env} that should hold the "
                              "API key is empty or unset; export it or drop --api-key-env")
        if not (value.isascii() and value.isprintable()):
            raise ConfigError(f"the API key in {self.api_key_env} holds characters other than "
                              "printable ASCII, which HTTP clients encode in different ways "
                              "(Latin-1 or UTF-8) so some could never match; use an ASCII key")
        return value

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ServeConfig:
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown serve setting(s) {unknown}; known: {sorted(known)}")
        return cls(**data)


def _positive_int(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
