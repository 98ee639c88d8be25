"""Strict checks of an engine manifest's sections (source, calibration, model, io,
tokenizer, option tokens, validation, export): every problem is a one-line
:class:`~calm_runtime.errors.ArtifactError` naming the key and the fix. The files the
manifest vouches for are checked beyond their hashes in
:mod:`calm_runtime.formats._engine_files`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from calm_runtime.calibration import SHIFT_LIMIT, TAU_RANGE, TEMPERATURE_RANGE
from calm_runtime.errors import ArtifactError
from calm_runtime.files import show
from calm_runtime.formats.manifest import (
    check_keys,
    check_p_true_template,
    finite_number,
    number_in_range,
    sha256_hex,
)
from calm_runtime.modes import CHOICE_MODES, CLOZE_VARIANTS

_SOURCE_KEYS = {"model", "adapter"}
_SOURCE_MODEL_KEYS = {"name", "vocab_size", "tokenizer_sha256", "weights_sha256"}
_SOURCE_ADAPTER_KEYS = {"kind", "path_name", "tensors_sha256", "manifest_sha256"}
_CALIBRATION_KEYS = {"fused", "temperature", "answer_temperature", "tau_min", "tau_max",
                     "shift_min", "shift_max", "adapter_kind"}
#: written since calm 0.1 engines record which outputs are calibrated (older ones derive it)
_CALIBRATION_OPTIONAL = {"outputs"}
_OUTPUT_KEYS = {"token_logprobs", "option_probabilities", "p_true"}
#: the largest layer count, vocabulary, context or width a manifest may state (2**24): the
#: runtime sizes its limits by them, so an absurd value must not switch those off
MODEL_NUMBER_LIMIT = 1 << 24
_MODEL_KEYS = {"file", "files", "num_layers", "num_attention_heads", "num_kv_heads", "head_dim",
               "hidden_size", "vocab_size", "max_position_embeddings", "dtype", "opset",
               "bos_token_id", "eos_token_ids", "pad_token_id", "add_bos"}
_MODEL_OPTIONAL = {"num_attention_heads"}
_IO_KEYS = {"inputs", "outputs"}
_TOKENIZER_KEYS = {"files", "chat_template"}
_OPTION_KEYS = {"plain", "chat"}
_VALIDATION_REQUIRED = {"passed", "max_abs_diff", "tolerance", "greedy_steps", "greedy_match",
                        "batch2_max_abs_diff"}
_DTYPES = ("float32", "float16")


def engine_io_names(num_layers: int, *, position_ids: bool = True
                    ) -> tuple[list[str], list[str]]:
    """The graph's input and output names for ``num_layers`` decoder layers (optimum's);
    a packed graph (``position_ids=False``) takes positions from the mask count."""
    inputs = ["input_ids", "attention_mask"] + (["position_ids"] if position_ids else [])
    outputs = ["logits"]
    for i in range(num_layers):
        inputs += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
        outputs += [f"present.{i}.key", f"present.{i}.value"]
    return inputs, outputs


#: the manifest's sections, in the order they are checked
SECTIONS = ("source", "calibration", "model", "io", "tokenizer", "option_tokens",
            "p_true_template", "export", "validation")


def check_sections(data: Mapping, kind: str, where: str) -> dict[str, dict]:
    """Every section of the manifest ``data`` of an engine of ``kind``, checked, by name."""
    sections = {name: _section(data, name, where) for name in SECTIONS}
    _check_source(sections["source"], f"{where} source")
    _check_calibration(sections["calibration"], f"{where} calibration")
    _check_model(sections["model"], kind, f"{where} model")
    _check_io(sections["io"], sections["model"]["num_layers"], f"{where} io")
    _check_tokenizer(sections["tokenizer"], f"{where} tokenizer")
    _check_option_tokens(sections["option_tokens"], sections["model"]["vocab_size"],
                         f"{where} option_tokens")
    check_p_true_template(sections["p_true_template"], where, allow_name=False)
    _check_export(sections["export"], f"{where} export")
    _check_validation(sections["validation"], f"{where} validation")
    return sections


def _section(data: Mapping, name: str, where: str) -> dict:
    value = data[name]
    if not isinstance(value, Mapping):
        raise ArtifactError(f"{where}: {name} must be an object, got {type(value).__name__}; "
                            "re-export the engine")
    return dict(value)


def _check_source(section: dict, where: str) -> None:
    check_keys(section, _SOURCE_KEYS, _SOURCE_KEYS, where)
    model = section["model"]
    if not isinstance(model, Mapping):
        raise ArtifactError(f"{where}: model must be an object; re-export the engine")
    check_keys(model, _SOURCE_MODEL_KEYS, _SOURCE_MODEL_KEYS, f"{where} model")
    non_empty_text(model["name"], "name", f"{where} model")
    _positive_int(model["vocab_size"], "vocab_size", f"{where} model")
    for key in ("tokenizer_sha256", "weights_sha256"):
        sha256_hex(model[key], key, f"{where} model", optional=True)
    adapter = section["adapter"]
    if adapter is None:
        return
    if not isinstance(adapter, Mapping):
        raise ArtifactError(f"{where}: adapter must be an object or null; re-export the engine")
    check_keys(adapter, _SOURCE_ADAPTER_KEYS, _SOURCE_ADAPTER_KEYS, f"{where} adapter")
    non_empty_text(adapter["kind"], "kind", f"{where} adapter")
    if adapter["path_name"] is not None:
        non_empty_text(adapter["path_name"], "path_name", f"{where} adapter")
    for key in ("tensors_sha256", "manifest_sha256"):
        sha256_hex(adapter[key], key, f"{where} adapter", optional=True)


def head_calibrated(section: Mapping) -> bool:
    """Whether a manifest's calibration section puts a calibration in the head: T, τ or
    shift other than the identity."""
    return bool(section["temperature"] != 1.0 or section["tau_min"] != 1.0
                or section["tau_max"] != 1.0 or section["shift_min"] != 0.0
                or section["shift_max"] != 0.0)


def _check_calibration(section: dict, where: str) -> None:
    check_keys(section, _CALIBRATION_KEYS | _CALIBRATION_OPTIONAL, _CALIBRATION_KEYS, where)
    outputs = section.get("outputs")
    if outputs is not None:
        if not isinstance(outputs, Mapping):
            raise ArtifactError(f"{where}: outputs must be an object; re-export the engine")
        check_keys(outputs, _OUTPUT_KEYS, _OUTPUT_KEYS, f"{where} outputs")
        for key in sorted(_OUTPUT_KEYS):
            if outputs[key] is not None and not isinstance(outputs[key], str):
                raise ArtifactError(f"{where} outputs: {key} must be a string or null, got "
                                    f"{show(outputs[key])}; re-export the engine")
    if not isinstance(section["fused"], bool):
        raise ArtifactError(f"{where}: fused must be true or false (whether the head carries "
                            f"a calibration), got {show(section['fused'])}; re-export the engine")
    _number(section["temperature"], "temperature", where, bounds=TEMPERATURE_RANGE)
    if section["answer_temperature"] is not None:
        _number(section["answer_temperature"], "answer_temperature", where,
                bounds=TEMPERATURE_RANGE)
    for low_key, high_key, bounds in (("tau_min", "tau_max", TAU_RANGE),
                                      ("shift_min", "shift_max", (-SHIFT_LIMIT, SHIFT_LIMIT))):
        low = _number(section[low_key], low_key, where, bounds=bounds)
        high = _number(section[high_key], high_key, where, bounds=bounds)
        if low > high:
            raise ArtifactError(f"{where}: {low_key} {low:g} is above {high_key} {high:g}; "
                                "re-export the engine")
    if section["fused"] is False and head_calibrated(section):
        raise ArtifactError(f"{where}: fused is false but the calibration is not the identity "
                            f"(T={section['temperature']:g}); re-export the engine")


def _check_model(section: dict, kind: str, where: str) -> None:
    check_keys(section, _MODEL_KEYS, _MODEL_KEYS - _MODEL_OPTIONAL, where)
    for key in ("num_layers", "num_kv_heads", "head_dim", "hidden_size", "vocab_size",
                "max_position_embeddings", "opset"):
        _positive_int(section[key], key, where)
        if section[key] > MODEL_NUMBER_LIMIT:
            raise ArtifactError(f"{where}: {key} {section[key]} is beyond any real model "
                                f"(at most {MODEL_NUMBER_LIMIT:,}); re-export the engine")
    if "num_attention_heads" in section:
        _positive_int(section["num_attention_heads"], "num_attention_heads", where)
    if not isinstance(section["dtype"], str) or section["dtype"] not in _DTYPES:
        raise ArtifactError(f"{where}: dtype {show(section['dtype'])} is not one of "
                            f"{list(_DTYPES)}")
    files = _file_map(section["files"], "files", where)
    if not isinstance(section["file"], str) or section["file"] not in files:
        raise ArtifactError(f"{where}: file {show(section['file'])} is not listed in files; "
                            "re-export the engine")
    expected = "model.onnx" if kind == "onnx" else None
    if expected and section["file"] != expected:
        raise ArtifactError(f"{where}: an onnx engine's file must be {expected!r}, got "
                            f"{show(section['file'])}")
    if "model.onnx" not in files:
        raise ArtifactError(f"{where}: files must list model.onnx; re-export the engine")
    vocab = section["vocab_size"]
    for key in ("bos_token_id", "pad_token_id"):
        if section[key] is not None:
            _token_id(section[key], key, vocab, where)
    eos = section["eos_token_ids"]
    if not isinstance(eos, list):
        raise ArtifactError(f"{where}: eos_token_ids must be a list of token ids, got "
                            f"{show(eos)}")
    for value in eos:
        _token_id(value, "eos_token_ids", vocab, where)
    if not isinstance(section["add_bos"], bool):
        raise ArtifactError(f"{where}: add_bos must be true or false, got "
                            f"{show(section['add_bos'])}")


def _check_io(section: dict, num_layers: int, where: str) -> None:
    check_keys(section, _IO_KEYS, _IO_KEYS, where)
    positions = isinstance(section["inputs"], list) and "position_ids" in section["inputs"]
    inputs, outputs = engine_io_names(num_layers, position_ids=positions)
    if section["inputs"] != inputs or section["outputs"] != outputs:
        raise ArtifactError(f"{where}: inputs/outputs are not the names calm-export writes for "
                            f"{num_layers} layers (input_ids, attention_mask, position_ids, "
                            "past_key_values.{i}.key/value -> logits, present.{i}.key/value); "
                            "re-export the engine")


def _check_tokenizer(section: dict, where: str) -> None:
    check_keys(section, _TOKENIZER_KEYS, _TOKENIZER_KEYS, where)
    files = _file_map(section["files"], "files", where)
    if "tokenizer.json" not in files:
        raise ArtifactError(f"{where}: files must list tokenizer.json; re-export the engine")
    template = section["chat_template"]
    if template is not None and (not isinstance(template, str) or template not in files):
        raise ArtifactError(f"{where}: chat_template {show(template)} is not listed in files")


def _check_option_tokens(section: dict, vocab: int, where: str) -> None:
    check_keys(section, _OPTION_KEYS, _OPTION_KEYS, where)
    for style in _OPTION_KEYS:
        mapping = section[style]
        if not isinstance(mapping, Mapping):
            raise ArtifactError(f"{where}: {style} must map option text to a token id")
        seen: dict[int, str] = {}
        for text, token in mapping.items():
            _token_id(token, f"{style}[{show(text, 40)}]", vocab, where)
            if token in seen:
                raise ArtifactError(f"{where}: {style} maps {show(seen[token], 20)} and "
                                    f"{show(text, 20)} to the same token id {token}; options "
                                    "must be distinct tokens; re-export the engine")
            seen[token] = text


def _check_validation(section: dict, where: str) -> None:
    missing = sorted(_VALIDATION_REQUIRED - set(section))
    if missing:
        raise ArtifactError(f"{where} lacks required key(s) {missing}; re-export the engine")
    if section["passed"] is not True:
        raise ArtifactError(f"{where}: the engine did not pass validation; re-export it")
    if section["greedy_match"] is not True:
        raise ArtifactError(f"{where}: greedy_match is {show(section['greedy_match'])}, not "
                            "true: the engine's greedy tokens differ from the reference model's; "
                            "re-export it")
    for key in ("max_abs_diff", "tolerance", "batch2_max_abs_diff"):
        _number(section[key], key, where)
    _positive_int(section["greedy_steps"], "greedy_steps", where)


def _check_export(section: dict, where: str) -> None:
    """The open export section; what the runtime reads from it is checked as strictly as
    the adapter: ``genai_config`` (a hashed file), ``choice_mode``, ``cloze_variant`` and
    ``abstention`` (a threshold in [0, 1], never silently dropped)."""
    from calm_runtime.formats._adapter_checks import check_abstention

    for key, allowed in (("choice_mode", CHOICE_MODES),
                         ("cloze_variant", CLOZE_VARIANTS)):
        value = section.get(key)
        if value is not None and value not in allowed:
            raise ArtifactError(f"{where}: {key} {show(value)} is not one of {list(allowed)}; "
                                "re-export the engine")
    check_abstention(section.get("abstention"), where)
    genai = section.get("genai_config")
    if genai is None:
        return
    if not isinstance(genai, Mapping) or set(genai) != {"file", "sha256"}:
        raise ArtifactError(f"{where}: genai_config must be {{\"file\": NAME, \"sha256\": "
                            f"DIGEST}} or null, got {show(genai)}; re-export the engine")
    if not isinstance(genai["file"], str) or not genai["file"]:
        raise ArtifactError(f"{where}: genai_config.file must be a file name, got "
                            f"{show(genai['file'])}")
    sha256_hex(genai["sha256"], "genai_config.sha256", where)


# ---------------------------------------------------------------------- value checks
def _file_map(value: Any, name: str, where: str) -> dict[str, str]:
    if not isinstance(value, Mapping) or not value:
        raise ArtifactError(f"{where}: {name} must map file names to sha256 digests")
    for key, digest in value.items():
        if not isinstance(key, str) or not key:
            raise ArtifactError(f"{where}: {name} has a file name {show(key)} that is not a "
                                "non-empty string")
        sha256_hex(digest, f"{name}[{show(key, 60)}]", where)
    return dict(value)


def _positive_int(value: Any, name: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ArtifactError(f"{where}: {name} must be a positive integer, got {show(value)}")
    return value


def _token_id(value: Any, name: str, vocab: int, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab:
        raise ArtifactError(f"{where}: {name} must be a token id in [0, {vocab}), got "
                            f"{show(value)}")
    return value


def _number(value: Any, name: str, where: str, *,
            bounds: tuple[float, float] | None = None) -> float:
    try:
        if bounds is None:
            return finite_number(value, name)
        return number_in_range(value, name, *bounds)
    except ArtifactError as exc:
        raise ArtifactError(f"{where}: {exc}") from None


def non_empty_text(value: Any, name: str, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ArtifactError(f"{where}: {name} must be a non-empty string, got {show(value)}")
    return value
