"""OpenAI's request and response shapes for completions and chat completions.

Requests are validated strictly: unknown fields are refused, as OpenAI does, and no value is
coerced (``"3"``, ``true`` or ``2.0`` is not an integer, ``1`` or ``"true"`` not a boolean;
a number parameter takes any JSON number). Parameters calm cannot honour (``n > 1``,
penalties, ``logit_bias``, ``echo`` except for prompt scoring with ``max_tokens`` 0, ...)
are refused with a 400 that names them rather than silently ignored. Two extensions:
``top_k`` (as vLLM) and a ``calm`` object, ``{"p_true": true}`` to score each choice's
P(True) and ``{"raw_logprobs": true}`` for the model's raw (uncalibrated) log-probabilities
beside the calibrated ones.

Responses follow OpenAI's shapes, ``logprobs`` included (calibrated log-probabilities: the
engine's logits are calibrated). Each choice carries one extension object ``calm`` with the
token confidences, the sequence confidence and, when asked, P(True); each response a
top-level ``calm`` object naming the engine and its calibration (also summarised in
``system_fingerprint``).
"""

from __future__ import annotations

import json
import math
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from calm_runtime.inference.results import Generation, Token
from calm_runtime.inference.sampling import DecodeOptions

__all__ = ["CompletionRequest", "ChatRequest", "ErrorResponse", "APIError", "FINISH_REASONS",
           "Usage", "AssistantMessage", "CompletionChoice", "ChatChoice", "CompletionResponse",
           "ChatCompletionResponse", "completion_logprobs", "chat_logprobs", "echo_logprobs",
           "choice_extension"]

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


#: limits of a constrained choice (``structured_outputs.choice`` / ``guided_choice``)
MIN_CHOICES, MAX_CHOICES, MAX_CHOICE_CHARS = 2, 64, 1000


#: the most bytes an error's message and ``param`` take in the JSON body (escaped, UTF-8):
#: with the rest of the error object, a body stays within 1 KB
MAX_MESSAGE_BYTES = 700
MAX_PARAM_BYTES = 120


def _within(text: str, limit: int) -> str:
    """``text`` cut (with "…") until its JSON form takes at most ``limit`` bytes."""
    def size(t: str) -> int:
        return len(json.dumps(t, ensure_ascii=False).encode())

    if size(text) <= limit:
        return text
    while size(text + "…") > limit:
        text = text[:max(0, int(len(text) * 0.8) - 1)]
    return text + "…"


class APIError(Exception):
    """An error answered with OpenAI's error object and an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None) -> None:
        # an error body stays under 1 KB whatever a request echoes into it (a huge name)
        message = _within(message, MAX_MESSAGE_BYTES)
        if param is not None:
            param = _within(param, MAX_PARAM_BYTES)
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = (
            status, message, type, code, param)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def _takes_int(annotation) -> bool:
    args = typing.get_args(annotation)
    return annotation is int or (int in args and float not in args)


class _Strict(BaseModel):
    # strict: JSON types are taken as they are (an int where a float is asked for is the
    # one conversion strict mode makes, as JSON has one number type)
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _integral_floats(cls, data):
        """JSON Schema's ``integer`` takes ``4.0``: an integral float given for an integer
        field is that integer (anything else stays as given, for strict validation)."""
        if not isinstance(data, dict):
            return data
        out = None
        for name, info in cls.model_fields.items():
            value = data.get(name)
            if isinstance(value, float) and value.is_integer() and _takes_int(info.annotation):
                out = out if out is not None else dict(data)
                out[name] = int(value)
        return data if out is None else out


class StreamOptions(_Strict):
    include_usage: bool = False


class CalmOptions(_Strict):
    p_true: bool = False
    #: how a constrained choice is scored: "cloze" (each choice's text as the continuation
    #: of the prompt) or "letter" (the choices listed as A. B. ... after the prompt)
    choice_mode: Literal["cloze", "letter"] | None = None
    #: report ``abstained: true`` for a constrained choice whose confidence is below this
    abstain_below: float | None = Field(None, ge=0, le=1)
    #: add ``calm.raw_logprobs``: the model's raw (uncalibrated) log-probabilities, in the
    #: same shape as ``logprobs`` (which are calibrated); needs ``logprobs``
    raw_logprobs: bool = False


class StructuredOutputs(_Strict):
    """vLLM's constrained-output parameter; calm takes its ``choice`` form."""

    choice: list[str] | None = None


class _Common(_Strict):
    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = False
    seed: int | None = Field(None, ge=0)
    user: str | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict | None = None
    calm: CalmOptions | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_choice: list[str] | None = None

    #: the request's constrained choices and stop strings, read once by its checks
    _choices: list[str] | None = PrivateAttr(None)
    _stops: tuple[str, ...] = PrivateAttr(())

    @model_validator(mode="after")
    def _request_checks(self):
        """Every check a request makes on itself, the server aside (its limits are the
        intake's), in one place: the fields the endpoint combines (:meth:`_endpoint_checks`),
        the parameters calm cannot honour, the stop strings, the constrained choices and
        what they exclude, and ``calm.raw_logprobs``'s needs. Each refusal is a 400 naming
        its parameter."""
        self._endpoint_checks()
        bad = self.unsupported()
        if bad:
            raise APIError(400, f"{', '.join(bad)} not supported by calm serve; remove "
                           f"{'it' if len(bad) == 1 else 'them'} from the request",
                           param=bad[0])
        self._stops = self._read_stops()
        self._choices = self._read_choices()
        if self.wants_raw:
            if not self.wants_logprobs:
                raise APIError(400, "calm.raw_logprobs needs logprobs (the raw values come "
                               "beside the calibrated ones); set logprobs", param="calm")
            if self._choices is not None:
                raise APIError(400, "calm.raw_logprobs is for generated or echoed tokens, not "
                               "constrained choices (their option_probabilities are "
                               "calibrated)", param="calm")
        if self._choices is not None:
            self._check_constrained()
        return self

    def _endpoint_checks(self) -> None:
        """The fields an endpoint combines (its request's own rules)."""

    def _read_choices(self) -> list[str] | None:
        given = [c for c in (self.structured_outputs and self.structured_outputs.choice,
                             self.guided_choice) if c is not None]
        if self.structured_outputs is not None and self.structured_outputs.choice is None:
            raise APIError(400, "structured_outputs takes only 'choice' in calm serve",
                           param="structured_outputs")
        if not given:
            return None
        if len(given) == 2:
            raise APIError(400, "send structured_outputs.choice or guided_choice, not both",
                           param="guided_choice")
        choices, param = given[0], ("structured_outputs.choice" if self.structured_outputs
                                    else "guided_choice")
        if not MIN_CHOICES <= len(choices) <= MAX_CHOICES:
            raise APIError(400, f"a constrained choice takes {MIN_CHOICES} to {MAX_CHOICES} "
                           f"choices, got {len(choices)}", param=param)
        for index, choice in enumerate(choices):
            if not choice.strip() or len(choice) > MAX_CHOICE_CHARS:
                raise APIError(400, f"choice {index} must be non-empty text of at most "
                               f"{MAX_CHOICE_CHARS} characters", param=param)
        if len(set(choices)) != len(choices):
            raise APIError(400, "the choices must be distinct", param=param)
        if self.stream:
            raise APIError(400, "a constrained choice is answered whole; send stream: false",
                           param="stream")
        return list(choices)

    def _check_constrained(self) -> None:
        """Refuse, naming it, each field a constrained choice cannot honour: its answer is one
        of the choices, scored whole, with calibrated ``option_probabilities`` in the ``calm``
        object (not token ``logprobs``), never cut by ``stop`` (``max_tokens`` must still be
        within the server's limit: the intake's check)."""
        refused = [("logprobs", self.wants_logprobs, "the calm object's option_probabilities "
                    "are the calibrated distribution over the choices"),
                   ("echo", bool(getattr(self, "echo", False)), "echo scores the prompt only"),
                   ("stop", bool(self._stops), "a choice is answered whole"),
                   ("ignore_eos", bool(self.ignore_eos), "a choice is answered whole"),
                   ("calm.p_true", self.wants_p_true, "the choice's confidence is its "
                    "calibrated option probability"),
                   ("n", (self.n or 1) > 1, "a choice has one answer")]
        for name, given, why in refused:
            if given:
                raise APIError(400, f"{name} is not supported with a constrained choice ({why}); "
                               "drop it", param=name)

    def _read_stops(self) -> tuple[str, ...]:
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if len(stops) > 4 or any(not s for s in stops):
            raise APIError(400, "stop takes at most 4 non-empty strings", param="stop")
        return stops

    def choices(self) -> list[str] | None:
        """The constrained choice list (``structured_outputs.choice`` or the older
        ``guided_choice``), checked; ``None`` when the request is unconstrained."""
        return self._choices

    def unsupported(self) -> list[str]:
        """Parameters set to something calm cannot honour."""
        bad = []
        if self.n not in (None, 1):
            bad.append("n")
        if self.presence_penalty:
            bad.append("presence_penalty")
        if self.frequency_penalty:
            bad.append("frequency_penalty")
        if self.logit_bias:
            bad.append("logit_bias")
        return bad

    def stops(self) -> tuple[str, ...]:
        return self._stops

    @property
    def wants_p_true(self) -> bool:
        return bool(self.calm and self.calm.p_true)

    def to_decode_options(self, top: int) -> DecodeOptions:
        """The decode options this request asks for, made once at the server's edge and
        carried by the batcher's job to the generation loop (``top``: alternatives per
        token)."""
        return DecodeOptions(
            temperature=1.0 if self.temperature is None else float(self.temperature),
            top_p=1.0 if self.top_p is None else float(self.top_p), top_k=self.top_k or 0,
            seed=self.seed, stop=self.stops(), top_alternatives=top,
            raw_logprobs=self.wants_raw, ignore_eos=bool(self.ignore_eos))

    @property
    def wants_raw(self) -> bool:
        return bool(self.calm and self.calm.raw_logprobs)


class CompletionRequest(_Common):
    prompt: str | list[str]
    #: 0 only with ``echo``: score the prompt, generate nothing
    max_tokens: int | None = Field(None, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    def _endpoint_checks(self) -> None:
        if self.echo and self.max_tokens != 0:
            raise APIError(400, "echo is supported for prompt scoring: send it with "
                           "max_tokens 0 (and logprobs for the alternatives)", param="echo")
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens 0 generates nothing; send echo: true to score "
                           "the prompt, or ask for at least 1 token", param="max_tokens")
        if self.echo and self.stream:
            raise APIError(400, "echo with stream is not supported; send stream: false",
                           param="stream")

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.best_of not in (None, 1):
            bad.append("best_of")
        if self.suffix:
            bad.append("suffix")
        return bad


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponseFormat(_Strict):
    type: Literal["text"]


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)

    def _endpoint_checks(self) -> None:
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if self.wants_p_true and not any(m.role == "user" for m in self.messages):
            raise APIError(400, "P(True) needs a user message to score the answer against",
                           param="messages")

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error object, the body of every error response."""

    error: ErrorDetail


# ---------------------------------------------------------------------- responses
# What the non-streaming endpoints answer (the stream's chunks are built per token in
# responses.py, in the same shapes).
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt: int, completion: int = 0) -> Usage:
        return cls(prompt_tokens=prompt, completion_tokens=completion,
                   total_tokens=prompt + completion)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None


class _Choice(BaseModel):
    index: int
    finish_reason: Literal["stop", "length"]
    #: OpenAI's ``logprobs`` object of the choice (calibrated), or null when not asked
    logprobs: Any = None
    #: calm's extension: token/sequence confidences, P(True), option probabilities, ...
    calm: dict[str, Any]


class CompletionChoice(_Choice):
    text: str


class ChatChoice(_Choice):
    message: AssistantMessage


class _Envelope(BaseModel):
    id: str
    created: int
    model: str
    system_fingerprint: str
    usage: Usage
    #: the engine and its calibration
    calm: dict[str, Any]


class CompletionResponse(_Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ChatCompletionResponse(_Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


def _logprob(confidence: float) -> float:
    return math.log(confidence) if confidence > 0 else -1e4  # JSON has no -inf


def _token_lp(token, raw: bool) -> float | None:
    return token.raw_logprob if raw else token.logprob


def _alt_lp(alternative, raw: bool) -> float:
    return alternative.raw_logprob if raw else _logprob(alternative.confidence)


def completion_logprobs(tokens: list[Token] | tuple[Token, ...], top: int,
                        offset: int = 0, *, raw: bool = False) -> dict:
    """The legacy completions ``logprobs`` object for ``tokens`` (``top`` alternatives);
    ``raw``: the raw (uncalibrated) log-probabilities in the same shape."""
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t.text)
    return {"tokens": [t.text for t in tokens],
            "token_logprobs": [_token_lp(t, raw) for t in tokens],
            "top_logprobs": ([{a.text: _alt_lp(a, raw) for a in (t.top or ())}
                              for t in tokens] if top else None),
            "text_offset": offsets}


def echo_logprobs(tokens, top: int, *, raw: bool = False) -> dict:
    """The completions ``logprobs`` object of a scored prompt (``echo`` with max_tokens 0):
    the first token has no log-probability (nothing predicts it), as in OpenAI's API."""
    return {"tokens": [t.text for t in tokens],
            "token_logprobs": [_token_lp(t, raw) for t in tokens],
            "top_logprobs": ([None if t.top is None else
                              {a.text: _alt_lp(a, raw) for a in t.top} for t in tokens]
                             if top else None),
            "text_offset": [t.offset for t in tokens]}


def chat_logprobs(tokens: list[Token] | tuple[Token, ...], top: int, *,
                  raw: bool = False, token_bytes=None) -> dict:
    """The chat ``logprobs`` object: one entry per token with its ``top_logprobs``;
    ``bytes`` are each token's own bytes (``token_bytes(id)``, the tokenizer's piece), so a
    token that ends inside a UTF-8 character keeps them."""
    def entry(text: str, token_id: int, logprob: float) -> dict:
        raw_bytes = token_bytes(token_id) if token_bytes is not None else text.encode("utf-8")
        return {"token": text, "logprob": logprob, "bytes": list(raw_bytes)}

    content = []
    for t in tokens:
        item = entry(t.text, t.id, _token_lp(t, raw))
        item["top_logprobs"] = [entry(a.text, a.id, _alt_lp(a, raw))
                                for a in (t.top or ())][:top]
        content.append(item)
    return {"content": content, "refusal": None}


def choice_extension(generation: Generation, p_true: float | None, asked: bool) -> dict:
    """The per-choice ``calm`` object."""
    out = {"token_confidences": [t.confidence for t in generation.tokens],
           "sequence_confidence": generation.sequence_confidence,
           "joint_confidence": generation.joint_confidence}
    if asked:
        out["p_true"] = p_true
    return out
