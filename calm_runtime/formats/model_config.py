"""A model's ``config.json``, checked before any weight is read (issue 38, item 3).

``calm-export`` calls :func:`check_model_config` on the resolved model folder (also
available as :func:`calm_runtime.data.models.check_model_config`): transformers builds the
config class from the file (its own field and rotary validation), and calm bounds the
sizes, requires a layer and heads that divide, so that a hostile or broken config is one
:class:`~calm_runtime.errors.ModelSourceError` line instead of a numpy allocation of
gigabytes, an IndexError after the export ran, or a raw transformers traceback.
transformers is imported only when a config is checked.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

from calm_runtime.errors import ArtifactError, ModelSourceError
from calm_runtime.extras import install_hint
from calm_runtime.files import read_regular_file, show

__all__ = ["check_model_config", "MAX_CONFIG_VOCAB_SIZE", "MAX_CONFIG_HIDDEN_SIZE",
           "MAX_CONFIG_INTERMEDIATE_SIZE", "MAX_CONFIG_LAYERS", "MAX_CONFIG_HEADS",
           "MAX_CONFIG_HEAD_DIM", "MAX_CONFIG_CONTEXT", "MAX_CONFIG_BYTES"]

# The sizes a model's config.json may state, checked before any weight is read. Each bound
# is several times the largest released model's value (in the comment) and far below what
# would exhaust memory or time before the weights load: the vocabulary sizes the adapter's
# per-token arrays, layers and heads the graph's inputs and KV cache, the context the
# runtime's limits. All are within the engine manifest's own MODEL_NUMBER_LIMIT (2**24).
#: 2,097,152 tokens: 8x Gemma-3's 262,144, the largest vocabulary of a released LLM
MAX_CONFIG_VOCAB_SIZE = 1 << 21
#: 65,536: 4x Llama-3.1-405B's hidden size of 16,384
MAX_CONFIG_HIDDEN_SIZE = 1 << 16
#: 524,288: 7x the widest released MLP (Nemotron-4-340B's 73,728)
MAX_CONFIG_INTERMEDIATE_SIZE = 1 << 19
#: 1,024: 8x Llama-3.1-405B's 126 layers
MAX_CONFIG_LAYERS = 1 << 10
#: 1,024 (query or key/value heads): 8x Llama-3.1-405B's 128 query heads
MAX_CONFIG_HEADS = 1 << 10
#: 4,096: 16x the widest released head (Gemma's 256)
MAX_CONFIG_HEAD_DIM = 1 << 12
#: 16,777,216 positions: the engine manifest's MODEL_NUMBER_LIMIT, above Llama-4 Scout's 10M
MAX_CONFIG_CONTEXT = 1 << 24
#: a config.json is a few kB; one of more than 16 MiB is not a model's config
MAX_CONFIG_BYTES = 16 << 20

#: the decoder config's size attributes: (attribute, bound, required)
_CONFIG_SIZES = (
    ("vocab_size", MAX_CONFIG_VOCAB_SIZE, True),
    ("hidden_size", MAX_CONFIG_HIDDEN_SIZE, True),
    ("intermediate_size", MAX_CONFIG_INTERMEDIATE_SIZE, False),
    ("num_hidden_layers", MAX_CONFIG_LAYERS, True),
    ("num_attention_heads", MAX_CONFIG_HEADS, True),
    ("num_key_value_heads", MAX_CONFIG_HEADS, False),
    ("head_dim", MAX_CONFIG_HEAD_DIM, False),
    ("max_position_embeddings", MAX_CONFIG_CONTEXT, False),
)
_CONFIG_FIX = "or use the model's original config.json"
#: the rotary settings' keys in config.json: transformers 5 takes ``rope_scaling`` (the
#: older name) over ``rope_parameters`` when it is set
_ROPE_KEYS = ("rope_scaling", "rope_parameters")


def check_model_config(folder: str | os.PathLike) -> None:
    """Refuse a model folder whose ``config.json`` cannot describe a real decoder, before any
    weight is read: the file is a JSON object transformers builds its config class from (its
    own field and rotary validation; a rotary warning that a value "must" be otherwise
    counts as a failure), the sizes are integers within the ``MAX_CONFIG_*`` bounds, at
    least one layer, the query heads a multiple of the key/value heads, and the hidden size
    a multiple of the heads where the family derives the head size from it (no explicit
    ``head_dim``). Every failure is one :class:`~calm_runtime.errors.ModelSourceError` line
    naming the field, the value and the fix."""
    path = Path(folder) / "config.json"
    try:
        raw = read_regular_file(path, limit=MAX_CONFIG_BYTES, what="model config.json")
        data = json.loads(raw.decode("utf-8"))
    except ArtifactError as exc:
        raise ModelSourceError(str(exc)) from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        reason = getattr(exc, "msg", None) or type(exc).__name__
        raise ModelSourceError(f"{path} is not valid JSON ({reason}); fix it, {_CONFIG_FIX}") \
            from None
    if not isinstance(data, dict):
        raise ModelSourceError(f"{path} must hold a JSON object, got {type(data).__name__}; "
                               f"fix it, {_CONFIG_FIX}")
    config = _transformers_config(folder, path, data)
    text = config.get_text_config(decoder=True)
    nested = text is not config
    raw_text = data.get("text_config") if nested else data
    raw_text = raw_text if isinstance(raw_text, dict) else {}
    prefix = "text_config." if nested else ""
    aliases = getattr(text, "attribute_map", {}) or {}

    def field(attribute: str) -> str:  # the key config.json spells it with (n_layer, ...)
        return prefix + aliases.get(attribute, attribute)

    sizes: dict[str, int] = {}
    for attribute, limit, required in _CONFIG_SIZES:
        value = getattr(text, attribute, None)
        if value is None and not required:
            continue
        for item in value if isinstance(value, list) and value else [value]:
            if isinstance(item, bool) or not isinstance(item, int):
                problem = f"is not an integer in [1, {limit:,}]"
            elif item < 1:
                problem = "must be at least 1"
            elif item > limit:
                problem = f"is beyond any real model (at most {limit:,})"
            else:
                continue
            raise ModelSourceError(f"{path}: {field(attribute)} {_show(value)} {problem}; "
                                   f"fix {field(attribute)}, {_CONFIG_FIX}")
        if not isinstance(value, list):
            sizes[attribute] = value
    heads = sizes.get("num_attention_heads")
    if heads is None:  # per-layer head counts (a list): transformers' own checks only
        return
    kv_heads = sizes.get("num_key_value_heads", heads)
    if heads % kv_heads:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ModelSourceError(
            f"{path}: {field('num_key_value_heads')} {kv_heads} does not divide "
            f"{field('num_attention_heads')} {heads} (each key/value head serves a whole group "
            f"of query heads); set {field('num_key_value_heads')} to one of {divisors}, "
            f"{_CONFIG_FIX}")
    if raw_text.get("head_dim") is None and sizes.get("hidden_size", 0) % heads:
        raise ModelSourceError(
            f"{path}: {field('hidden_size')} {sizes['hidden_size']} is not a multiple of "
            f"{field('num_attention_heads')} {heads} ({text.model_type} derives the head size "
            f"from them, config.json states no head_dim); fix either, {_CONFIG_FIX}")


def _transformers_config(folder, path: Path, data: dict):
    """transformers' config class for the folder (AutoConfig, never remote code), its own
    validation's failures and rotary warnings as one ModelSourceError line."""
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ModelSourceError("transformers is not installed; reading a model's config needs "
                               f"the export extra: {install_hint('export')}") from None

    rope_log = logging.getLogger("transformers.modeling_rope_utils")
    warnings_seen: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            # "... must be ...", "Missing ...": a value the rotary embedding cannot use; the
            # advice (an implied factor, unrecognized keys it ignores) is not a failure
            if " must " in message or message.startswith("Missing"):
                warnings_seen.append(message)

    handler = _Collect(level=logging.WARNING)
    saved = rope_log.level, rope_log.propagate
    rope_log.addHandler(handler)
    rope_log.setLevel(logging.WARNING)
    rope_log.propagate = False
    try:
        config = AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
        _check_rope_values(config.get_text_config(decoder=True), path)
    except ModelSourceError:
        raise
    except Exception as exc:  # noqa: BLE001 - transformers' validators raise many kinds
        raise ModelSourceError(_config_refusal(path, data, exc)) from None
    finally:
        rope_log.removeHandler(handler)
        rope_log.setLevel(saved[0])
        rope_log.propagate = saved[1]
    if warnings_seen:
        key = _rope_key(data)
        raise ModelSourceError(f"{path}: {key} {_show(_raw_value(data, key))} is refused by "
                               f"transformers' rotary validation ({warnings_seen[0]}); fix "
                               f"{key}, {_CONFIG_FIX}")
    return config


def _check_rope_values(config, path: Path) -> None:
    """What transformers' rotary validation lets through but the rotary embedding cannot
    use: a ``rope_theta`` that is not a positive finite number, a ``partial_rotary_factor``
    outside (0, 1]."""
    import math

    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict):
        return
    nested = "rope_type" not in params and "rope_theta" not in params  # per layer type
    layers = [v for v in params.values() if isinstance(v, dict)] if nested else [params]
    for layer in layers:
        for key, high in (("rope_theta", math.inf), ("partial_rotary_factor", 1.0)):
            value = layer.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or not 0 < value <= high:
                what = "a positive number" + ("" if high == math.inf else " up to 1")
                raise ModelSourceError(f"{path}: {key} {_show(value)} in the rotary settings "
                                       f"must be {what}; fix it, {_CONFIG_FIX}")


def _config_refusal(path: Path, data: dict, exc: Exception) -> str:
    """One line for transformers' refusal of a config: the field, its value, the reason."""
    text = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    reason = lines[-1] if lines and lines[0].endswith(":") and len(lines) > 1 else \
        (lines[0] if lines else type(exc).__name__)
    reason = re.sub(r" in \(<class.*", "", re.sub(r"^\w+(Error|Exception): ", "", reason))[:200]
    if "custom code" in reason or "trust_remote_code" in str(text):
        return (f"{path}: auto_map {_show(data.get('auto_map'))} asks for the model's own "
                "Python code, which calm never runs; use a model transformers implements "
                "itself (model_type one of its families)")
    if "does not recognize this architecture" in str(text):
        return (f"{path}: model_type {_show(data.get('model_type'))} is not a family this "
                "transformers knows; fix model_type, or upgrade transformers")
    # the first name in the message that is a key of config.json (or its text_config)
    nested = data.get("text_config") if isinstance(data.get("text_config"), dict) else {}
    known = set(data) | {f"text_config.{k}" for k in nested}
    names = re.findall(r"field '(\w+)'|`(\w+)`", str(text))
    key = next((name for pair in names for name in pair
                if name in known or name in _ROPE_KEYS or f"text_config.{name}" in known), None)
    if key is not None and key not in known and f"text_config.{key}" in known:
        key = f"text_config.{key}"
    hint = ""
    if key in _ROPE_KEYS or "rope" in reason.lower():
        key = _rope_key(data)
        if not isinstance(_raw_value(data, key), (dict, type(None))):
            hint = ("; expected an object such as {\"rope_type\": \"linear\", \"factor\": "
                    "2.0}, or null")
    if key is None:
        return (f"{path}: transformers' {_config_class(data)} refuses it ({reason}); fix "
                f"config.json, {_CONFIG_FIX}")
    return (f"{path}: {key} {_show(_raw_value(data, key))} is refused by transformers "
            f"({reason}{hint}); fix {key}, {_CONFIG_FIX}")


def _config_class(data: dict) -> str:
    try:
        from transformers import CONFIG_MAPPING

        return CONFIG_MAPPING[data.get("model_type")].__name__
    except (ImportError, KeyError, TypeError):
        return "config class"


def _rope_key(data: dict) -> str:
    """The rotary key whose value transformers reads (``rope_scaling`` in older files, which
    wins when set), nested or not."""
    for where in (data, data.get("text_config")):
        if isinstance(where, dict):
            for key in _ROPE_KEYS:
                if where.get(key):
                    return key if where is data else f"text_config.{key}"
    return "rope_parameters"


def _raw_value(data: dict, key: str):
    where, _, name = key.rpartition(".")
    section = data.get(where) if where else data
    return section.get(name) if isinstance(section, dict) else None


def _show(value) -> str:
    return show(value, 80)
