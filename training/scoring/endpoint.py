"""The HTTP side of an OpenAI-compatible endpoint: :class:`Endpoint` (one API call with
retries, one total deadline over all its attempts, a bounded answer, no redirects),
:func:`connect` (checks the served model) and the helpers that keep keys and control
characters out of what calm prints. Standard library only; the scoring on top is in
:mod:`.remote`.

Everything an endpoint sends passes :func:`redact` in :meth:`Endpoint.request` before calm
uses it (the strings of the decoded answer, error bodies, exception texts, headers), so the
API key cannot come back through a server that echoes it into a message, a log or a file.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import random
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field

from calm_runtime.data.models import DEFAULT_API_KEY_ENV, is_endpoint
from calm_runtime.errors import CalmError, ConfigError, one_line
from calm_training.scoring.redaction import (
    MIN_KEY_LENGTH,
    REDACTED,
    redact,
    redact_fields,
)

__all__ = ["DEFAULT_MAX_RETRIES", "DEFAULT_TIMEOUT", "Endpoint", "MAX_RETRIES", "MAX_TIMEOUT",
           "RemoteError",
           "MAX_RESPONSE_BYTES", "abort_requests", "connect", "is_endpoint", "printable",
           "redact", "redact_url"]

#: ``--timeout``: seconds one endpoint call may take in all, every attempt and the backoff
#: between them included: the worst case of a call
DEFAULT_TIMEOUT = 120.0
#: ``--max-retries``: attempts after the first one on 429, 5xx, time-outs and connection
#: errors, within the same total deadline
DEFAULT_MAX_RETRIES = 4
#: the longest ``--timeout`` taken (a day: a deadline beyond it is a typo, and the socket
#: layer cannot represent one near 1e12 s)
MAX_TIMEOUT = 86400.0
#: the most ``--max-retries`` taken
MAX_RETRIES = 100


def _fix(message: str | None) -> str:
    """What to do about a refused request: a server setting the message names, else the
    usual suspects."""
    found = re.search(r"(?:prompt |sample )?logprobs of (\d+), which is greater than max "
                      r"allowed: (\d+)", message or "")
    if found:  # vLLM's cap on returned log-probabilities (default 20)
        return (f"the server returns at most {found.group(2)} log-probabilities per token and "
                f"calm asks for {found.group(1)}; start it with --max-logprobs "
                f"{found.group(1)} (vLLM) or more")
    return "check the model name, the key and the request settings"


class RemoteError(CalmError):
    """The endpoint could not be used: unreachable, refusing, or answering out of protocol.
    ``status``: the HTTP status of a refused request, else ``None``. ``detail``: the error
    message the server sent with its last error answer (redacted), else ``None``."""

    def __init__(self, message: str, status: int | None = None, *,
                 detail: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.detail = detail


@dataclass(frozen=True)
class Endpoint:
    """A served model: ``base_url`` (``.../v1``) and the served ``model`` name.

    The API key is read from ``api_key_env`` when a request is made and is never stored.
    ``timeout`` bounds one call (:meth:`request`) in all: every attempt, and the backoff
    between them, ends by then; ``retries`` more attempts are made within it.
    """

    base_url: str
    model: str
    api_key_env: str = DEFAULT_API_KEY_ENV
    concurrency: int = 8
    timeout: float = DEFAULT_TIMEOUT
    retries: int = DEFAULT_MAX_RETRIES
    backoff: float = 0.5
    #: Called with the seconds to wait before a retry (tests replace it).
    sleep: Callable[[float], None] = field(default=time.sleep, compare=False, repr=False)

    @property
    def identity(self) -> dict:
        """What an adapter records about the model (no key)."""
        return {"endpoint": self.base_url, "served_model": self.model}

    def cache_key(self) -> str:
        return hashlib.sha256(f"{self.base_url}\n{self.model}".encode()).hexdigest()[:32]

    # ------------------------------------------------------------------ HTTP
    def _key(self) -> str | None:
        key = os.environ.get(self.api_key_env)
        if key and (not key.isprintable() or key != key.strip()):
            raise ConfigError(f"the environment variable {self.api_key_env} holds spaces or "
                              "control characters (a line break?); set it to the key alone")
        if key and len(key) < MIN_KEY_LENGTH:
            raise ConfigError(f"the environment variable {self.api_key_env} holds a key of "
                              f"{len(key)} character{'s' if len(key) != 1 else ''}: a key this "
                              "short cannot be kept out of output (calm removes it from "
                              "everything a server sends back, and so short a string occurs "
                              f"in answers by chance); give the server a key of at least "
                              f"{MIN_KEY_LENGTH} characters, or leave {self.api_key_env} "
                              "empty for a server that takes none")
        return key or None

    def request(self, method: str, path: str, body: dict | None = None, *,
                refused: Callable[[int, str | None], bool] | None = None) -> dict:
        """One API call with retries; the decoded JSON object, or a one-line RemoteError.
        ``refused(status, message)``: whether a 429 or 5xx answer (and its error message)
        is a refusal of this request rather than a passing failure: it is raised at once,
        with its ``status``, instead of retried.

        The call has one total deadline, ``timeout`` seconds after it starts: each attempt
        gets what is left of it (its socket timeout and a watchdog that cuts an answer
        still trickling in), and no backoff sleeps past it. The answer is read up to
        :data:`MAX_RESPONSE_BYTES`, redirects are refused (the key would go with them), a
        host that does not resolve is not retried, and every text of the answer passes
        :func:`redact` before anything else sees it."""
        url = self.base_url.rstrip("/") + path
        shown = redact_url(url)
        data = None if body is None else json.dumps(body).encode()
        key = self._key()
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"

        def said(text: str, limit: int = 200) -> str:  # endpoint text, as calm may show it
            return printable(redact(text, key))[:limit]

        deadline = time.monotonic() + self.timeout
        last, last_message, attempts = "no attempt", None, 0
        for attempt in range(self.retries + 1):
            if attempt:
                delay = min(self.backoff * 2 ** (attempt - 1), 30.0) * (1 + random.random() / 4)
                if time.monotonic() + delay >= deadline:
                    break
                self.sleep(delay)
            left = deadline - time.monotonic()
            if left <= 0:
                break
            attempts += 1
            try:
                status, raw = _exchange(method, url, data, headers, left)
            except _Redirect as exc:
                raise RemoteError(f"{shown} answered HTTP {exc.status}, a redirect to "
                                  f"{redact_url(redact(exc.location, key))}; calm does not "
                                  "follow redirects (the API key would go with them): pass "
                                  "the final URL", status=exc.status) from None
            except socket.gaierror as exc:
                raise RemoteError(f"cannot resolve the host of {shown} "
                                  f"({said(str(exc.strerror or exc))}); check the URL") \
                    from None
            except (OSError, http.client.HTTPException) as exc:
                last, last_message = f"{type(exc).__name__}: {said(str(exc))}", None
                continue
            if status >= 400:
                last_message = _error_message(raw, said)
                detail = f" ({last_message})" if last_message else ""
                if (status == 429 or status >= 500) and not (
                        refused is not None and refused(status, last_message)):
                    last = f"HTTP {status}{detail}"
                    continue
                raise RemoteError(f"{shown} answered HTTP {status}{detail}; "
                                  f"{_fix(last_message)}", status=status, detail=last_message)
            try:
                payload = json.loads(raw)
            except (ValueError, RecursionError):
                text = raw[:4096].decode("utf-8", errors="replace")
                raise RemoteError(f"{shown} answered something that is not JSON "
                                  f"({said(text, 80)!r}); is this an OpenAI-compatible "
                                  "API?") from None
            if not isinstance(payload, dict):
                raise RemoteError(f"{shown} answered a JSON {type(payload).__name__}, not an "
                                  "object; is this an OpenAI-compatible API?")
            return _redacted(payload, key)
        if time.monotonic() + 1e-3 >= deadline or attempts < self.retries + 1:
            raise RemoteError(f"{shown} gave no complete answer within {self.timeout:g} s, "
                              f"the deadline of one call ({attempts} attempt"
                              f"{'s' if attempts != 1 else ''} and the backoff between them; "
                              f"last: {last}); check that the server is up and not "
                              "overloaded, or raise --timeout, then rerun (scores already "
                              "received are cached)", detail=last_message)
        raise RemoteError(f"{shown} failed {attempts} times (last: {last}); check that "
                          "the server is up and not overloaded, then rerun (scores already "
                          "received are cached)", detail=last_message)


#: The largest answer read from an endpoint (a completion with logprobs is kilobytes; an
#: echo of a long prompt with alternatives a few megabytes).
MAX_RESPONSE_BYTES = 64 << 20

#: connections in flight, so that an interruption can end them at once (see abort_requests)
_ACTIVE: set = set()
_ACTIVE_LOCK = threading.Lock()


class _Redirect(Exception):
    def __init__(self, status: int, location: str) -> None:
        super().__init__(status, location)
        self.status, self.location = status, location


def _exchange(method: str, url: str, data: bytes | None, headers: dict, timeout: float):
    """``(status, body)`` of one HTTP exchange, ended by a watchdog at ``timeout`` seconds
    after it started whatever the server does (the socket's own timeout is ``timeout`` too);
    a 3xx raises :class:`_Redirect`."""
    parts = urllib.parse.urlsplit(url)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = kind(parts.hostname, parts.port, timeout=timeout)
    expired = threading.Event()
    held: list = []  # the socket: http.client drops conn.sock once a response owns it

    def cut() -> None:
        expired.set()
        for sock in held:
            _shutdown(sock)

    watchdog = threading.Timer(timeout, cut)
    watchdog.daemon = True
    watchdog.start()
    try:
        conn.connect()
        held.append(conn.sock)
        with _ACTIVE_LOCK:
            _ACTIVE.add(conn.sock)
        if expired.is_set():
            raise TimeoutError(f"no complete answer within {timeout:.3g} s")
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        conn.request(method, target, body=data, headers=headers)
        response = conn.getresponse()
        if 300 <= response.status < 400:
            raise _Redirect(response.status, response.getheader("Location") or "?")
        declared = response.getheader("Content-Length")
        if declared and declared.isdigit() and int(declared) > MAX_RESPONSE_BYTES:
            raise RemoteError(f"{redact_url(url)} announced a {int(declared):,}-byte answer, "
                              f"more than calm reads ({MAX_RESPONSE_BYTES:,}); is this an "
                              "OpenAI-compatible API?")
        chunks, size = [], 0
        while True:
            chunk = response.read(1 << 16)
            if not chunk:
                break
            size += len(chunk)
            if size > MAX_RESPONSE_BYTES:
                raise RemoteError(f"{redact_url(url)} answered more than "
                                  f"{MAX_RESPONSE_BYTES:,} bytes; is this an OpenAI-compatible "
                                  "API?")
            chunks.append(chunk)
        if expired.is_set():  # the watchdog's shutdown reads as an early end of the answer
            raise TimeoutError(f"no complete answer within {timeout:.3g} s")
        return response.status, b"".join(chunks)
    except (OSError, http.client.HTTPException):
        if expired.is_set():
            raise TimeoutError(f"no complete answer within {timeout:.3g} s") from None
        raise
    finally:
        watchdog.cancel()
        with _ACTIVE_LOCK:
            for sock in held:
                _ACTIVE.discard(sock)
        conn.close()
        for sock in held:
            sock.close()


def _shutdown(sock) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked reading it
    except OSError:
        pass


def abort_requests() -> None:
    """End every request in flight at once (an interrupted run: nothing waits for them)."""
    with _ACTIVE_LOCK:
        active = list(_ACTIVE)
    for sock in active:
        _shutdown(sock)


def redact_url(url: str) -> str:
    """``url`` without userinfo, query or fragment (where keys hide), control characters
    escaped: what calm prints and records of an endpoint."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or ""
        if parts.port:
            host = f"{host}:{parts.port}"
        shown = urllib.parse.urlunsplit((parts.scheme, host, parts.path, "", ""))
        if parts.query or parts.fragment or parts.username or parts.password:
            shown += " (credentials and query removed)"
    except ValueError:
        shown = "the endpoint URL"
    return printable(shown)


def printable(text: str) -> str:
    """``text`` with control characters (terminal escape sequences, line breaks) escaped as
    ``repr`` escapes them: :func:`calm_runtime.errors.one_line`."""
    return one_line(text)


def _error_message(raw: bytes, said: Callable[[str], str]) -> str | None:
    """The error's message of an error answer, through ``said`` (redacted), or ``None``."""
    try:
        body = json.loads(raw or b"{}")
        message = body.get("error", {}).get("message") if isinstance(body, dict) else None
    except (ValueError, AttributeError, RecursionError):
        message = None
    return said(str(message)) if message else None


def _redacted(payload, key: str | None):
    """``payload`` with :func:`redact_fields` applied to its strings (keys included) in the
    order they come, so that a key spread over consecutive fields goes too, and the value of
    an ``authorization`` key whole."""
    strings: list[str] = []
    stack = [payload]
    while stack:  # iterative: an answer nested as deep as the JSON decoder goes
        value = stack.pop()
        if isinstance(value, str):
            strings.append(value)
        elif isinstance(value, dict):
            for k, v in reversed(value.items()):
                stack += [v, k]
        elif isinstance(value, list):
            stack += reversed(value)
    shown = redact_fields(strings, key)
    if shown == strings and not any(k.lower().endswith("authorization") for k in strings):
        return payload
    replaced = iter(shown)

    def walk(value):
        if isinstance(value, str):
            return next(replaced)
        if isinstance(value, dict):
            out = {}
            for k, v in value.items():
                name, inner = next(replaced), walk(v)
                out[name] = (REDACTED if isinstance(v, str) and k.lower().endswith(
                    "authorization") else inner)
            return out
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    try:
        return walk(payload)
    except RecursionError:
        raise RemoteError("the answer is nested too deeply to read; is this an "
                          "OpenAI-compatible API?") from None


def check_deadline(timeout, retries) -> None:
    """A one-line :class:`ConfigError` unless ``0 < timeout <= MAX_TIMEOUT`` seconds and
    ``0 <= retries <= MAX_RETRIES``."""
    if (isinstance(timeout, bool) or not isinstance(timeout, int | float)
            or not 0 < timeout <= MAX_TIMEOUT):
        raise ConfigError(f"timeout must be > 0 and at most {MAX_TIMEOUT:g} seconds, got "
                          f"{timeout!r}; fix --timeout")
    if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= MAX_RETRIES:
        raise ConfigError(f"max_retries must be an integer from 0 to {MAX_RETRIES}, got "
                          f"{retries!r}; fix --max-retries")


def connect(url: str, *, model_name: str | None = None, api_key_env: str = DEFAULT_API_KEY_ENV,
            concurrency: int = 8, timeout: float = DEFAULT_TIMEOUT,
            retries: int = DEFAULT_MAX_RETRIES) -> Endpoint:
    """The :class:`Endpoint` for ``url``, its served model checked with ``GET /models``.
    ``timeout``: seconds per call, all ``retries`` included (``--timeout``,
    ``--max-retries``)."""
    try:
        parsed = urllib.parse.urlsplit(url)
        parsed.port  # noqa: B018 - a bad port raises here
    except ValueError:
        raise ConfigError(f"{redact_url(url)} is not a valid URL; pass the API's base URL, "
                          "e.g. http://127.0.0.1:8000/v1") from None
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ConfigError(f"{redact_url(url)} is not an http(s) URL; pass the API's base URL, "
                          "e.g. http://127.0.0.1:8000/v1")
    if parsed.username or parsed.password or parsed.query or parsed.fragment:
        raise ConfigError(f"{redact_url(url)}: the URL carries credentials or a query; calm "
                          "never records them: pass the base URL alone and the key through "
                          "--api-key-env VAR")
    if concurrency < 1:
        raise ConfigError(f"concurrency must be >= 1, got {concurrency}")
    check_deadline(timeout, retries)
    endpoint = Endpoint(url.rstrip("/"), model_name or "", api_key_env=api_key_env,
                        concurrency=concurrency, timeout=timeout, retries=retries)
    listing = endpoint.request("GET", "/models")
    served = [m.get("id") for m in listing.get("data") or [] if isinstance(m, dict)]
    served = [s for s in served if isinstance(s, str)]
    if model_name is None:
        if len(served) != 1:
            raise ConfigError(f"{url} serves {len(served)} models ({', '.join(served[:5])}); "
                              "name one with --model-name / --reference-name")
        model_name = served[0]
    if REDACTED in model_name:  # the listing passed redact(): the id held the key
        raise ConfigError(f"{redact_url(url)}: the served model's id holds the API key (in "
                          "some encoding); calm records model ids in adapters and caches: "
                          "serve the model under a name without the key")
    elif served and model_name not in served:
        raise ConfigError(f"{url} does not serve {model_name!r} (it serves "
                          f"{', '.join(served[:5])}); fix --model-name / --reference-name")
    return Endpoint(endpoint.base_url, model_name, api_key_env=api_key_env,
                    concurrency=concurrency, timeout=timeout, retries=retries)
