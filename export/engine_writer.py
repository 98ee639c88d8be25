"""The engine directory's non-graph files: tokenizer, genai_config.json and the manifest."""

from __future__ import annotations

import datetime as _dt
import json
import logging
import shutil
import string
from pathlib import Path

from calm_runtime import __version__
from calm_runtime.data.prompts import DEFAULT_P_TRUE_TEMPLATE, p_true_template
from calm_runtime.files import sha256_bytes, sha256_file
from calm_runtime.formats.artifact import (
    MANIFEST_NAME,
    TENSORS_NAME,
    CalibrationAdapter,
)
from calm_runtime.formats.engine import EngineManifest, engine_io_names
from calm_runtime.formats.manifest import write_json

from .graphs.calm_graph import DecoderShape
from .graphs.genai_builder import GENAI_CONFIG, GRAPH_KIND

logger = logging.getLogger("calm_export.pipeline")

__all__ = [
    "tool_versions",
    "TOKENIZER_FILES",
    "copy_tokenizer",
    "special_tokens",
    "option_tokens",
    "write_genai_config",
    "weights_sha256",
    "engine_files",
    "build_manifest",
]

#: Tokenizer files copied verbatim (so tokenizer.json keeps the sha256 the adapter names).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "tokenizer.model", "vocab.json", "merges.txt")
CHAT_TEMPLATE = "chat_template.jinja"
#: option letters whose token ids the manifest records (A-J, the most a MCQA item uses)
OPTION_LETTERS = string.ascii_uppercase[:10]


def copy_tokenizer(model_dir: Path, tokenizer, staging: Path) -> tuple[dict[str, str], str | None]:
    """Copy the tokenizer files; returns ``({name: sha256}, chat template file or None)``."""
    files = {}
    for name in TOKENIZER_FILES:
        source = Path(model_dir) / name
        if source.is_file():
            shutil.copyfile(source, staging / name)
            files[name] = sha256_file(staging / name)
    template = getattr(tokenizer, "chat_template", None)
    if CHAT_TEMPLATE not in files and isinstance(template, str) and template:
        (staging / CHAT_TEMPLATE).write_text(template, encoding="utf-8")
        files[CHAT_TEMPLATE] = sha256_file(staging / CHAT_TEMPLATE)
    return files, (CHAT_TEMPLATE if CHAT_TEMPLATE in files else None)


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def option_tokens(tokenizer, vocab_size: int) -> dict:
    """``{"plain": {" A": id, ...}, "chat": {"A": id, ...}}`` for letters that are one token."""
    result: dict[str, dict[str, int]] = {"plain": {}, "chat": {}}
    for style, prefix in (("plain", " "), ("chat", "")):
        for letter in OPTION_LETTERS:
            ids = _ids(tokenizer, prefix + letter)
            if len(ids) == 1 and 0 <= ids[0] < vocab_size:
                result[style][prefix + letter] = int(ids[0])
    return result


def special_tokens(model_dir: Path, config, tokenizer, vocab_size: int) -> dict:
    """bos / eos / pad ids and whether the tokenizer adds BOS by itself."""
    def valid(value):
        return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size

    eos: list[int] = []
    generation = Path(model_dir) / "generation_config.json"
    sources = [json.loads(generation.read_text()).get("eos_token_id")
               if generation.is_file() else None,
               getattr(config, "eos_token_id", None), tokenizer.eos_token_id]
    for value in sources:
        for item in value if isinstance(value, list) else [value]:
            if valid(item) and item not in eos:
                eos.append(int(item))
    bos = next((v for v in (getattr(config, "bos_token_id", None), tokenizer.bos_token_id)
                if valid(v)), None)
    pad = next((v for v in (tokenizer.pad_token_id, getattr(config, "pad_token_id", None))
                if valid(v)), eos[0] if eos else None)
    encoded = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    add_bos = bool(bos is not None and encoded and encoded[0] == bos)
    return {"bos_token_id": bos, "eos_token_ids": eos, "pad_token_id": pad, "add_bos": add_bos}


def write_genai_config(staging: Path, shape: DecoderShape, tokens: dict) -> dict:
    """``genai_config.json`` for onnxruntime-genai (decoder-only, separate past/present)."""
    inputs, outputs = engine_io_names(shape.num_layers)
    config = {
        "model": {
            "bos_token_id": tokens["bos_token_id"],
            "context_length": shape.max_position_embeddings,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": "model.onnx",
                "head_size": shape.head_dim,
                "hidden_size": shape.hidden_size,
                "inputs": {"input_ids": inputs[0], "attention_mask": inputs[1],
                           "position_ids": inputs[2],
                           "past_key_names": "past_key_values.%d.key",
                           "past_value_names": "past_key_values.%d.value"},
                "outputs": {"logits": outputs[0], "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"},
                "num_attention_heads": shape.num_attention_heads,
                "num_hidden_layers": shape.num_layers,
                "num_key_value_heads": shape.num_kv_heads,
            },
            "eos_token_id": tokens["eos_token_ids"],
            "pad_token_id": tokens["pad_token_id"],
            # genai's generic decoder-only runner; the graph carries the architecture itself
            "type": "llama",
            "vocab_size": shape.vocab_size,
        },
        "search": {
            "diversity_penalty": 0.0, "do_sample": False, "early_stopping": True,
            "length_penalty": 1.0, "max_length": shape.max_position_embeddings,
            "min_length": 0, "no_repeat_ngram_size": 0, "num_beams": 1,
            "num_return_sequences": 1, "past_present_share_buffer": False,
            "repetition_penalty": 1.0, "temperature": 1.0, "top_k": 1, "top_p": 1.0,
        },
    }
    write_json(staging / GENAI_CONFIG, config)
    return genai_config_entry(staging)


def genai_config_entry(staging: Path) -> dict:
    """The manifest's ``export.genai_config`` for the file in ``staging``; a builder graph's
    is the builder's own, kept as it is (it describes that graph's inputs and its in-place
    KV buffer)."""
    return {"file": GENAI_CONFIG, "sha256": sha256_file(staging / GENAI_CONFIG)}


def weights_sha256(model_dir: Path) -> str | None:
    """The source weights' identity: the safetensors file's sha256 (or a digest of shards')."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    if len(files) == 1:
        return sha256_file(files[0])
    lines = "".join(f"{f.name} {sha256_file(f)}\n" for f in files)
    return sha256_bytes(lines.encode())


def adapter_source(adapter: CalibrationAdapter | None, adapter_dir: Path | None) -> dict | None:
    """The adapter's identity for the manifest (hashes only when it came from a folder)."""
    if adapter is None:
        return None
    if adapter_dir is None:
        return {"kind": adapter.kind, "path_name": None, "tensors_sha256": None,
                "manifest_sha256": None}
    return {"kind": adapter.kind, "path_name": Path(adapter_dir).resolve().name,
            "tensors_sha256": sha256_file(Path(adapter_dir) / TENSORS_NAME),
            "manifest_sha256": sha256_file(Path(adapter_dir) / MANIFEST_NAME)}


def engine_files(job) -> dict:
    """Write the engine folder's other files into ``job.staging`` (the tokenizer's, with
    ``job.tokenizer_files`` and ``job.chat_template`` set, and the genai config) and return
    the export settings the manifest records (:class:`calm_export.pipeline.ExportJob`)."""
    config, adapter, facts = job.config, job.adapter, job.facts
    job.tokenizer_files, job.chat_template = copy_tokenizer(job.folder, job.tokenizer,
                                                            job.staging)
    if facts["graph"]["kind"] == GRAPH_KIND:
        genai = genai_config_entry(job.staging)
    else:
        genai = write_genai_config(job.staging, job.shape, job.tokens)
    settings = {
        **config.to_dict(), **tool_versions(),
        "exporter_used": facts["exporter"], "external_data": facts["external_data"],
        # "genai-builder" (onnxruntime-genai's builder graph), "ort-fused" (calm's, RMSNorm as
        # ONNX Runtime contrib ops) or "standard"
        "graph": facts["graph"],
        "source_head_tied": job.was_tied, "genai_config": genai,
        # what the family does after its head (export/heads.py)
        "post_head": job.post.to_dict(),
        # optional graph input: project only the last positions
        "logits_to_keep": facts["logits_to_keep"],
        "tensorrt": job.trt_settings,
        # the cloze score answer_temperature was fitted on (runtime reads it)
        "cloze_variant": adapter.cloze_variant,
        # the mode (cloze/letter) the calibration was fitted on: the server's default for
        # constrained choices
        "choice_mode": adapter.choice_mode,
        # chat or plain: the prompt format the calibration was fitted on (calm serve says when
        # chat traffic differs)
        "prompt_format": (adapter.provenance or {}).get("prompt_format"),
        # calm fit threshold: the runtime marks answers below it abstained
        "abstention": adapter.abstention}
    if config.precision.variant:  # int8, int4, fp16: scheme, excluded nodes, sizes, drift
        settings[config.precision.name] = job.variant_facts
    return settings


def build_manifest(job) -> EngineManifest:
    """Assemble (and check) the manifest of the engine ``job`` builds in ``job.staging``, from
    the job: its kind, model, adapter, files, tokens, template, precision, settings and
    validation report; a packed builder graph (``graph.kind == "genai-builder"``, the
    builder's float32 one) has no position_ids."""
    adapter, identity, shape, staging = job.adapter, job.identity, job.shape, job.staging
    summary = adapter.summary()
    graph = job.export_settings.get("graph") or {}
    packed = graph.get("packed", graph.get("kind") == GRAPH_KIND)
    inputs, outputs = engine_io_names(shape.num_layers, position_ids=not packed)
    return EngineManifest(
        kind=job.kind,
        created_by=f"calm-export {__version__}",
        created_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        source={"model": {"name": identity.name, "vocab_size": identity.vocab_size,
                          "tokenizer_sha256": identity.tokenizer_sha256,
                          "weights_sha256": weights_sha256(job.folder)},
                "adapter": adapter_source(adapter if job.adapter_arg is not None else None,
                                          job.adapter_dir)},
        calibration={"fused": adapter.has_token_calibration(),
                     "temperature": summary["temperature"],
                     "answer_temperature": summary["answer_temperature"],
                     "tau_min": summary["tau_min"], "tau_max": summary["tau_max"],
                     "shift_min": summary["shift_min"], "shift_max": summary["shift_max"],
                     "adapter_kind": adapter.kind,
                     "outputs": adapter.calibrated_outputs()},
        model={"file": job.model_file,
               "files": {name: sha256_file(staging / name) for name in job.model_files},
               "num_layers": shape.num_layers, "num_attention_heads": shape.num_attention_heads,
               "num_kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim,
               "hidden_size": shape.hidden_size, "vocab_size": shape.vocab_size,
               "max_position_embeddings": shape.max_position_embeddings, "dtype": job.dtype,
               "opset": job.facts["opset"], **job.tokens},
        io={"inputs": inputs, "outputs": outputs},
        tokenizer={"files": job.tokenizer_files, "chat_template": job.chat_template},
        option_tokens=option_tokens(job.tokenizer, shape.vocab_size),
        p_true_template=p_true_template(job.template).to_dict(),
        export=job.export_settings,
        validation=job.report,
        root=staging,
    )


def tool_versions() -> dict:
    """``{"versions": {...}}``: the libraries an engine was built with, for its manifest."""
    import onnx
    import torch
    import transformers

    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "onnx": onnx.__version__}
    try:
        import peft

        versions["peft"] = peft.__version__
    except ImportError:
        pass
    return {"versions": versions}


def load_adapter(adapter_arg) -> tuple[CalibrationAdapter | None, Path | None]:
    """``calm-export --adapter``: a folder or an object, checked; ``(None, None)`` for none."""
    if adapter_arg is None:
        return None, None
    if isinstance(adapter_arg, CalibrationAdapter):
        adapter_arg.validate()
        return adapter_arg, None
    path = Path(adapter_arg)
    return CalibrationAdapter.from_pretrained(path), path


def p_true_template_for(config, adapter):
    recorded = adapter.p_true_template
    if config.p_true_template is None:
        return recorded if recorded is not None else DEFAULT_P_TRUE_TEMPLATE
    if recorded is not None:
        from calm_runtime.data.prompts import p_true_template

        if p_true_template(recorded).to_dict() != p_true_template(config.p_true_template).to_dict():
            logger.warning("the adapter was fitted with another P(True) template; the engine "
                           "records the one passed to calm-export")
    return config.p_true_template
