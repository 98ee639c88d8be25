"""Reading the log-probabilities of an OpenAI-compatible answer, in either shape.

``/v1/completions`` answers its logprobs as OpenAI's shape (``tokens``, ``token_logprobs``,
``top_logprobs`` as one ``{token: logprob}`` per position, ``text_offset``: OpenAI, vLLM,
SGLang, calm serve) or as the chat shape (``content[]`` of ``{token, logprob, top_logprobs:
[{token, logprob}]}``: llama.cpp's llama-server); chat completions always use the latter.
Every value is checked here before the scorers in :mod:`calm_training.scoring.served` read it.
Standard library only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from calm_training.scoring.endpoint import RemoteError, printable

__all__ = ["NoPromptLogprobs", "TokenLogprobs", "chat_entries", "chat_top_alternatives",
           "checked_logprob", "completion_logprobs", "echo_fields", "echoed_continuation",
           "first_choice", "top_alternatives", "TOP_LOGPROBS"]

#: The most alternatives OpenAI's API returns per position.
TOP_LOGPROBS = 20


class NoPromptLogprobs(RemoteError):
    """An answer to an echo request (``echo: true``, ``max_tokens: 0``) that carries no
    log-probabilities of the prompt's tokens: the endpoint does not echo them (llama.cpp's
    server). ``str()``: what it answered instead, as a clause."""


def first_choice(payload: dict) -> dict:
    choices = payload.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise RemoteError("the completion has no choices; is this an OpenAI-compatible "
                          "completions API?")
    return choices[0]


@dataclass(frozen=True)
class TokenLogprobs:
    """The token log-probabilities of one completion choice, whichever shape they came in.

    ``tokens``, ``values`` (``None`` where the endpoint gave none: the first echoed token)
    and ``top`` (the ``{token text: logprob}`` alternatives, ``{}`` where none) have one
    entry per position; ``offsets`` are the tokens' character offsets in the prompt plus
    completion, or ``None`` where the answer has none (the chat shape never has); ``shape``
    is ``"completions"`` (OpenAI's) or ``"chat"`` (``content[]``)."""

    tokens: list
    values: list
    top: list[dict[str, float]]
    offsets: list | None
    shape: str


def checked_logprob(value, token) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or (
            not math.isfinite(value) and value != -math.inf):
        raise RemoteError(f"the endpoint returned a non-numeric logprob "
                          f"{printable(repr(value))[:40]} for {printable(repr(token))[:40]}")
    return float(value)


def chat_entries(content: list) -> TokenLogprobs:
    """The chat shape: ``[{"token", "logprob", "top_logprobs": [{"token", "logprob"}, ...]},
    ...]`` (llama-server adds ``id`` and ``bytes``, which are not read)."""
    tokens, values, tops = [], [], []
    for entry in content:
        if not isinstance(entry, dict) or not isinstance(entry.get("token"), str):
            raise RemoteError(f"the endpoint returned a malformed logprobs entry "
                              f"{printable(repr(entry))[:80]}")
        tokens.append(entry["token"])
        value = entry.get("logprob")
        values.append(None if value is None else checked_logprob(value, entry["token"]))
        top = {}
        for item in entry.get("top_logprobs") or []:
            token, value = (item.get("token"), item.get("logprob")) if isinstance(item, dict) \
                else (None, None)
            if not isinstance(token, str):
                raise RemoteError(f"the endpoint returned a malformed top_logprobs entry "
                                  f"{printable(repr(item))[:80]}")
            top.setdefault(token, checked_logprob(value, token))
        tops.append(top)
    return TokenLogprobs(tokens, values, tops, None, "chat")


def completion_logprobs(payload: dict) -> TokenLogprobs:
    """The logprobs of a ``/v1/completions`` answer's first choice, from either shape:

    * OpenAI's: ``{"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token:
      logprob}, ...], "text_offset": [...]}`` (OpenAI, vLLM, SGLang, calm serve);
    * the chat shape: ``{"content": [{"token", "logprob", "top_logprobs": [{"token",
      "logprob"}]}]}`` (llama.cpp's llama-server), without text offsets.

    A choice without logprobs (``null``, as llama-server answers when none were computed)
    or with neither shape is a one-line :class:`RemoteError`."""
    logprobs = first_choice(payload).get("logprobs")
    if not isinstance(logprobs, dict):
        raise RemoteError("the completion carries no logprobs; the endpoint must support "
                          "the 'logprobs' parameter of /v1/completions")
    if isinstance(logprobs.get("content"), list) and not any(
            k in logprobs for k in ("tokens", "token_logprobs", "text_offset")):
        return chat_entries(logprobs["content"])
    tokens, values = logprobs.get("tokens"), logprobs.get("token_logprobs")
    top, offsets = logprobs.get("top_logprobs"), logprobs.get("text_offset")
    if not any(isinstance(v, list) for v in (tokens, values, top, offsets)):
        raise RemoteError("the completion's logprobs are in neither shape calm reads "
                          "(tokens/token_logprobs/top_logprobs, or content[]); is this an "
                          "OpenAI-compatible completions API?")
    tops = []
    for position in top if isinstance(top, list) else []:
        if position is not None and not isinstance(position, dict):
            raise RemoteError(f"the endpoint returned a malformed top_logprobs entry "
                              f"{printable(repr(position))[:80]}")
        tops.append({str(k): checked_logprob(v, k) for k, v in (position or {}).items()})
    return TokenLogprobs(tokens if isinstance(tokens, list) else [],
                         values if isinstance(values, list) else [], tops,
                         offsets if isinstance(offsets, list) else None, "completions")


def top_alternatives(payload: dict, body: dict | None = None) -> dict[str, float]:
    """``{token text: logprob}`` at the first generated position (either shape)."""
    top = completion_logprobs(payload).top
    if not top or not top[0]:
        raise RemoteError("the completion's logprobs have no top_logprobs; the endpoint must "
                          f"return up to {TOP_LOGPROBS} alternatives per token")
    return top[0]


def chat_top_alternatives(payload: dict, body: dict | None = None) -> dict[str, float]:
    """``{token text: logprob}`` of the first generated token of a chat completion
    (``logprobs: true`` with ``top_logprobs``)."""
    logprobs = first_choice(payload).get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list) or not content or not isinstance(content[0], dict):
        raise RemoteError("the chat completion carries no logprobs content; the endpoint must "
                          "support logprobs and top_logprobs on /v1/chat/completions")
    top = chat_entries(content[:1]).top[0]
    if not top:
        raise RemoteError("the chat completion's logprobs have no top_logprobs; the endpoint "
                          f"must return up to {TOP_LOGPROBS} alternatives per token")
    return top


def echo_fields(payload: dict, body: dict) -> dict:
    """What the cache keeps of an echoed prompt, checked before it is kept: per-token
    logprobs and text offsets that cover the prompt and nothing after it (an endpoint that
    ignores ``echo`` or ``max_tokens=0`` returns generated tokens instead). An answer with
    no logprobs, or with the chat shape's (generated tokens, no offsets: llama-server), is a
    :class:`NoPromptLogprobs`."""
    if not isinstance(first_choice(payload).get("logprobs"), dict):
        raise NoPromptLogprobs("asked to echo the prompt with logprobs, it answered no "
                               "logprobs")
    parsed = completion_logprobs(payload)
    if parsed.shape == "chat":
        raise NoPromptLogprobs("asked to echo the prompt with logprobs, it answered "
                               "logprobs.content[], the chat shape, of generated tokens only")
    offsets = parsed.offsets
    if offsets is None or not len(parsed.tokens) == len(parsed.values) == len(offsets) or not \
            all(isinstance(o, int) and not isinstance(o, bool) for o in offsets):
        raise RemoteError("the echoed prompt has no per-token logprobs and text offsets; the "
                          "endpoint does not support echo with logprobs — use --mode letter")
    length = len(body["prompt"])
    if not offsets or offsets[0] != 0 or max(offsets) >= length:
        raise RemoteError("the answer's tokens do not cover the prompt (text offsets "
                          f"{offsets[:1]}..{offsets[-1:]} for a prompt of {length} characters): "
                          "the endpoint ignored echo or max_tokens 0 — use --mode letter")
    return {"tokens": parsed.tokens, "token_logprobs": parsed.values, "text_offset": offsets}


def echoed_continuation(fields: dict, start: int) -> list[float]:
    """The log-probabilities of the echoed tokens at or after character ``start``, from what
    :func:`echo_fields` kept."""
    tokens, values, offsets = (fields.get("tokens"), fields.get("token_logprobs"),
                               fields.get("text_offset"))
    if not (isinstance(tokens, list) and isinstance(values, list) and isinstance(offsets, list)
            and len(tokens) == len(values) == len(offsets)):
        raise RemoteError("the echoed prompt has no per-token logprobs and text offsets; the "
                          "endpoint does not support echo with logprobs — use --mode letter")
    picked = []
    for token, value, offset in zip(tokens, values, offsets, strict=True):
        if not isinstance(offset, int):
            raise RemoteError(f"the endpoint returned a text offset {offset!r}")
        if offset >= start:
            if not isinstance(value, int | float):
                raise RemoteError(f"the endpoint returned no logprob for the prompt token "
                                  f"{token!r}; it does not score prompts — use --mode letter")
            picked.append(float(value))
    return picked
