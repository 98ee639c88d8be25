"""The OpenAPI document: the request models with the server's own limits written in."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from calm_runtime.errors import CalmError
from calm_runtime.inference.lm import CalibratedLM
from calm_runtime.server.protocol import (
    MAX_CHOICE_CHARS,
    MAX_CHOICES,
    MIN_CHOICES,
    ChatCompletionResponse,
    ChatRequest,
    CompletionRequest,
    CompletionResponse,
)
from calm_runtime.server.state import ServerState

__all__ = ["openapi_schema", "request_body", "template_tokens", "TOKENS_PER_CHAR",
           "CHAT_MESSAGES_DOCUMENTED"]

#: a character is at most this many tokens (its UTF-8 bytes, under byte-level BPE or byte
#: fallback): what the documented text limits assume
TOKENS_PER_CHAR = 4
#: the messages of a documented chat request (the server takes more that fit)
CHAT_MESSAGES_DOCUMENTED = 8


def template_tokens(lm: CalibratedLM) -> int:
    """Tokens the chat template adds around :data:`CHAT_MESSAGES_DOCUMENTED` messages (the
    documented text limits leave room for them)."""
    if not lm.tokenizer.has_chat_template:
        return 0
    roles = ["system"] + ["user", "assistant"] * CHAT_MESSAGES_DOCUMENTED
    try:
        ids = lm.tokenizer.encode_chat([{"role": r, "content": ""}
                                        for r in roles[:CHAT_MESSAGES_DOCUMENTED]])
    except CalmError:
        return 0
    return len(ids) + 1


def _raw_recoverable(lm: CalibratedLM) -> bool:
    try:
        _ = lm.raw_logit_scale
        return True
    except CalmError:
        return False


def request_body(model) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def openapi_schema(app: FastAPI, server: ServerState, template_overhead: int) -> dict:
    """FastAPI's schema plus the request models (the endpoints parse bodies themselves) with
    this server's limits (``template_overhead``: :func:`template_tokens` of its engine), and,
    with an API key, the bearer scheme on every endpoint but ``/health``."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                             description="OpenAI-compatible completions with calibrated "
                                         "confidences")
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (CompletionRequest, ChatRequest):
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            _document_limits(body, server, template_overhead)
            components[model.__name__] = body
        # the answers' models, as the request models: the routes build their answers through
        # them (responses.py), and the document is written here, in one place
        for path, model in (("/v1/completions", CompletionResponse),
                            ("/v1/chat/completions", ChatCompletionResponse)):
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
            schema["paths"][path]["post"]["responses"]["200"] = {
                "description": "the answer; with stream, server-sent events of chunks of the "
                               "same shape, then [DONE]",
                "content": {"application/json": {"schema": {
                    "$ref": f"#/components/schemas/{model.__name__}"}}}}
        if server.has_key:
            schema["components"]["securitySchemes"] = {"bearer": {"type": "http",
                                                                  "scheme": "bearer"}}
            for path, operations in schema["paths"].items():
                if path != "/health":
                    for operation in operations.values():
                        operation["security"] = [{"bearer": []}]
        app.openapi_schema = schema
    return app.openapi_schema


def _document_limits(body: dict, server: ServerState, template_overhead: int) -> None:
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
    room = max(1, server.max_prompt - (template_overhead if chat else 1))
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
    raw_ok = _raw_recoverable(server.lm)
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
            "ignore_eos": {"enum": [False, None]},
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


