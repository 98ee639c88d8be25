"""The request body as JSON: strict parsing (no NaN/Infinity, no lone surrogates) and the
validation against the request model, whose errors name the field."""

from __future__ import annotations

import json
import re

from pydantic import ValidationError

from calm_runtime.server.protocol import APIError

__all__ = ["json_object", "validated", "clip"]

#: a JSON escape of a UTF-16 surrogate; only then can the parsed body hold a lone one
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


class _NotJSONNumber(ValueError):
    pass


def _not_a_json_number(name: str):
    raise _NotJSONNumber(name)


def json_object(body: bytes) -> dict:
    """The body's JSON object, or a 400: not UTF-8 JSON, not an object, or a string (or key)
    holding a lone UTF-16 surrogate."""
    data = _load_json(body)
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(body.decode("utf-8")):
        where = _lone_surrogate(data)
        if where is not None:
            raise APIError(400, f"{clip(where) or 'a key of the body'} holds a lone UTF-16 "
                           "surrogate (an unpaired \\ud800-\\udfff escape), which is not "
                           "valid Unicode; send valid text", param=clip(where) or None)
    return data


def validated(data: dict, model):
    """``data`` as the request ``model``, or a 400 naming the first field in error."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = _error_param(first, data)
        raise APIError(400, f"{where}: {first['msg']}" if where else first["msg"],
                       param=where) from None


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
    return clip(".".join(parts)) or None


def clip(text: str, size: int = 120) -> str:
    """``text``, cut to ``size`` characters (then ending in ``...``)."""
    return text if len(text) <= size else text[:size] + "..."

