"""The engine artifact (schema version 1): the contract between ``calm_export`` and the runtime.

    engine/
      calm_engine.json        manifest (this module reads, checks and writes it)
      model.onnx              the graph; calibrated logits come out of it (head fused)
      model.onnx.data         external weights, only when the model is large
      model.plan              TensorRT engine (kind "tensorrt" only)
      genai_config.json       so onnxruntime-genai can run the folder as it is
      tokenizer.json, tokenizer_config.json, chat_template.jinja, ...

Graph I/O (optimum's names, so other ONNX LLM runtimes load it too): inputs ``input_ids``,
``attention_mask`` (covers past + current tokens), ``position_ids`` (given explicitly),
``past_key_values.{i}.key`` / ``.value`` ``[batch, num_kv_heads, past, head_dim]``;
outputs ``logits`` ``[batch, seq, vocab]`` float32 (already calibrated) and
``present.{i}.key`` / ``.value`` ``[batch, num_kv_heads, past + seq, head_dim]``. An
optional ``logits_to_keep`` (int64 ``[1]``, an overridable initializer, default 0 = all)
projects only the last positions (docs/formats.md). A *packed* graph (onnxruntime-genai's
builder graph, ``export.graph.kind == "genai-builder"``) has no ``position_ids``: it takes
positions from the mask count and needs each row's tokens at the start of its cache; the
ONNX Runtime backend translates (``backends/_packed_kv.py``).

Reading is strict, like the adapter's: unknown keys and newer schemas are refused, file
references may not leave the directory, and every listed file is checked against its
sha256 (``verify_hashes=True``). What a hash cannot vouch for is checked too: the files
``model.onnx`` reads as external data must be exactly the data files the manifest lists,
and ``genai_config.json`` must agree with the model section. This module imports neither
torch nor onnx.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from calm_runtime.errors import ArtifactError
from calm_runtime.files import is_dir, is_file, resolve_inside, sha256_file, show, show_name
from calm_runtime.formats._engine_checks import (
    MODEL_NUMBER_LIMIT,
    check_sections,
    engine_io_names,
    head_calibrated,
    non_empty_text,
)
from calm_runtime.formats._engine_files import check_external_data, check_genai_config
from calm_runtime.formats.manifest import check_keys, iso_timestamp, read_manifest, write_json
from calm_runtime.modes import PTrueTemplate

__all__ = [
    "ENGINE_SCHEMA_VERSION",
    "ENGINE_MANIFEST_NAME",
    "ENGINE_KINDS",
    "EngineManifest",
    "MODEL_NUMBER_LIMIT",
    "engine_io_names",
]

ENGINE_SCHEMA_VERSION = 1
ENGINE_MANIFEST_NAME = "calm_engine.json"
ENGINE_KINDS = ("onnx", "tensorrt")

#: migrations[v] upgrades a version-v manifest dict to version v+1 (none exist yet).
MIGRATIONS: dict[int, Any] = {}

_TOP_KEYS = {"schema_version", "kind", "created_by", "created_at", "source", "calibration",
             "model", "io", "tokenizer", "option_tokens", "p_true_template", "export",
             "validation"}
@dataclass(frozen=True)
class EngineManifest:
    """A parsed, checked ``calm_engine.json``; sections are plain dicts (see the module doc).

    ``root`` is the engine directory the manifest belongs to (``None`` before it is
    written). Use :meth:`load` to read an engine and :meth:`write` to save one.
    """

    kind: str
    created_by: str
    created_at: str
    source: dict
    calibration: dict
    model: dict
    io: dict
    tokenizer: dict
    option_tokens: dict
    p_true_template: dict
    export: dict
    validation: dict
    root: Path | None = field(default=None, compare=False)
    schema_version: int = ENGINE_SCHEMA_VERSION

    # ------------------------------------------------------------------ reading
    @classmethod
    def load(cls, path: str | Path, *, verify_hashes: bool = True) -> EngineManifest:
        """Read and check an engine directory; with ``verify_hashes`` every file is hashed."""
        root = Path(path)
        if not is_dir(root):
            raise ArtifactError(f"engine directory {root} does not exist; pass the folder "
                                "written by calm-export")
        if not (root / ENGINE_MANIFEST_NAME).exists():
            _point_to_export(root)
        data = read_manifest(root / ENGINE_MANIFEST_NAME, current_version=ENGINE_SCHEMA_VERSION,
                             migrations=MIGRATIONS, what="calm engine")
        manifest = cls.from_dict(data, root=root, where=str(root / ENGINE_MANIFEST_NAME))
        manifest.verify_files(verify_hashes=verify_hashes)
        return manifest

    @classmethod
    def from_dict(cls, data: Mapping, *, root: Path | None = None,
                  where: str = ENGINE_MANIFEST_NAME) -> EngineManifest:
        """Check a manifest dict (already migrated to the current schema) and wrap it."""
        check_keys(data, _TOP_KEYS, _TOP_KEYS, where)
        if data["schema_version"] != ENGINE_SCHEMA_VERSION:
            raise ArtifactError(f"{where}: schema_version {show(data['schema_version'])} is not "
                                f"{ENGINE_SCHEMA_VERSION}; re-export the engine")
        kind = data["kind"]
        if not isinstance(kind, str) or kind not in ENGINE_KINDS:
            raise ArtifactError(f"{where}: kind {show(kind)} is not one of "
                                f"{list(ENGINE_KINDS)}; it was not written by calm-export")
        created_by = non_empty_text(data["created_by"], "created_by", where)
        created_at = iso_timestamp(data["created_at"], "created_at", where)
        sections = check_sections(data, kind, where)
        return cls(kind=kind, created_by=created_by, created_at=created_at, root=root,
                   **sections)

    def verify_files(self, *, verify_hashes: bool = True) -> None:
        """Check that every listed file is inside the engine, present and (optionally) intact."""
        if self.root is None:
            raise ArtifactError("this manifest has no engine directory; load it with "
                                "EngineManifest.load(path)")
        for name, digest in self.listed_files().items():
            path = resolve_inside(self.root, name)
            if not is_file(path):
                raise ArtifactError(f"{self.root}: {show_name(name)} is missing (or not a regular "
                                    "file); the engine is incomplete (partly copied?), copy the "
                                    "whole folder or re-export it")
            if not verify_hashes:
                continue
            try:
                actual = sha256_file(path)
            except OSError as exc:
                raise ArtifactError(f"{self.root}: {show_name(name)} cannot be read "
                                    f"({exc.strerror or type(exc).__name__}); check its "
                                    "permissions, or copy the engine again") from None
            if actual != digest:
                raise ArtifactError(f"{self.root}: {show_name(name)} does not match its sha256 in "
                                    f"{ENGINE_MANIFEST_NAME}; the file is truncated or corrupted, "
                                    "copy the engine again or re-export it with calm-export")
        self.verify_contents()

    def verify_contents(self) -> None:
        """What the hashes cannot vouch for, checked on every load: ``genai_config.json``
        agrees with the model section (sizes, context at most the model's, no negative or
        absurd values; onnxruntime-genai runs the folder by it), and the files ``model.onnx``
        reads as external data are exactly the data files ``model.files`` lists and hashes
        (read from the graph's protobuf, no weights loaded)."""
        if self.root is None:
            raise ArtifactError("this manifest has no engine directory; load it with "
                                "EngineManifest.load(path)")
        check_external_data(self.root, self.model, ENGINE_MANIFEST_NAME)
        genai = self.export.get("genai_config")
        if isinstance(genai, Mapping):
            check_genai_config(resolve_inside(self.root, genai["file"]), self.model,
                               ENGINE_MANIFEST_NAME)

    def listed_files(self) -> dict[str, str]:
        """Every file the manifest vouches for, ``{relative name: sha256}``."""
        files = dict(self.model["files"])
        files.update(self.tokenizer["files"])
        genai = self.export.get("genai_config")
        if isinstance(genai, Mapping):  # checked by from_dict: a file name and its sha256
            files[genai["file"]] = genai["sha256"]
        return files

    # ------------------------------------------------------------------ writing
    def to_dict(self) -> dict:
        return {"schema_version": self.schema_version, "kind": self.kind,
                "created_by": self.created_by, "created_at": self.created_at,
                "source": self.source, "calibration": self.calibration, "model": self.model,
                "io": self.io, "tokenizer": self.tokenizer, "option_tokens": self.option_tokens,
                "p_true_template": self.p_true_template, "export": self.export,
                "validation": self.validation}

    def write(self, directory: str | Path) -> Path:
        """Check the manifest and write ``calm_engine.json`` into ``directory``."""
        directory = Path(directory)
        data = self.to_dict()
        EngineManifest.from_dict(data, root=directory)
        path = directory / ENGINE_MANIFEST_NAME
        write_json(path, data)
        return path

    # ------------------------------------------------------------------ conveniences
    def path(self, name: str) -> Path:
        """An engine file by its relative name, refusing anything outside the directory."""
        if self.root is None:
            raise ArtifactError("this manifest has no engine directory; load it with "
                                "EngineManifest.load(path)")
        return resolve_inside(self.root, name)

    @property
    def model_path(self) -> Path:
        return self.path(self.model["file"])

    @property
    def num_layers(self) -> int:
        return self.model["num_layers"]

    @property
    def vocab_size(self) -> int:
        return self.model["vocab_size"]

    @property
    def packed(self) -> bool:
        """The graph has no ``position_ids``: each row's tokens sit at the start of its cache
        and positions come from the mask count (onnxruntime-genai's builder graph)."""
        return "position_ids" not in self.io["inputs"]

    @property
    def answer_temperature(self) -> float | None:
        return self.calibration["answer_temperature"]

    @property
    def head_calibrated(self) -> bool:
        """Whether the graph's head carries a calibration (T, τ or shift other than the
        identity). Engines written before ``fused`` said so recorded ``true`` always: the
        values decide."""
        return head_calibrated(self.calibration)

    @property
    def calibrated_outputs(self) -> dict:
        """Which outputs the engine calibrates and by which fit (see
        :meth:`~calm_runtime.formats.artifact.CalibrationAdapter.calibrated_outputs`); engines
        written before this was recorded derive it from the fused values."""
        recorded = self.calibration.get("outputs")
        if recorded is not None:
            return dict(recorded)
        from calm_runtime.formats.artifact import describe_calibrated_outputs

        c = self.calibration
        return describe_calibrated_outputs(
            kind=c["adapter_kind"], method=None, token=self.head_calibrated,
            temperature=c["temperature"],
            answer_temperature=c["answer_temperature"])

    def p_true(self) -> PTrueTemplate:
        return PTrueTemplate.from_dict(self.p_true_template)


def _point_to_export(root: Path) -> None:
    """A folder that is not an engine but something calm-export reads or writes: say what it
    is and how to get an engine from it (the generic message follows otherwise)."""
    if (root / "calm_checkpoint.json").is_file():
        raise ArtifactError(f"{root} is a calibrated transformers checkpoint (calm-export "
                            "--format hf), not an engine; serve it with vLLM, SGLang or TGI, "
                            "or export an engine for calm serve with calm-export --format onnx")
    if (root / "calm_adapter.json").is_file():
        raise ArtifactError(f"{root} is a calibration adapter, not an engine; build one with "
                            f"calm-export --model MODEL --adapter {root} --out ENGINE")
    if (root / "config.json").is_file():
        raise ArtifactError(f"{root} is a transformers model folder, not an engine; build one "
                            f"with calm-export --model {root} [--adapter ADAPTER] --out ENGINE")


# ---------------------------------------------------------------------- section checks
