"""The calibration adapter artifact (schema version 1): a directory on disk.

    adapter/
      calm_adapter.json           manifest (schema_version, kind, base model identity, ...)
      calibration.safetensors     tau [V] f32, shift [V] f32, temperature [] f32,
                                  optional answer_temperature [] f32
      lora/                       optional peft LoRA folder (adapter_config.json + weights)

It is the one contract between ``calm_training`` (which writes it) and ``calm_export`` /
``calm_runtime`` (which read it). Reading is strict: every malformed input is a typed
:class:`~calm_runtime.errors.CalmError` with a one-line message, and nothing is written
unless the whole artifact is valid.
"""

from __future__ import annotations

import datetime as _dt
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import __version__
from ._fs import atomic_directory, resolve_inside, sha256_file
from ._manifest import check_keys, finite_number, read_manifest, write_json
from .calibration import apply_calibration, fused_head
from .errors import ArtifactError, IncompatibleModelError

__all__ = [
    "ADAPTER_SCHEMA_VERSION",
    "MANIFEST_NAME",
    "TENSORS_NAME",
    "ModelIdentity",
    "CalibrationAdapter",
    "tokenizer_sha256",
]

ADAPTER_SCHEMA_VERSION = 1
MANIFEST_NAME = "calm_adapter.json"
TENSORS_NAME = "calibration.safetensors"
LORA_DIR = "lora"

#: migrations[v] upgrades a version-v manifest dict to version v+1 (none exist yet).
MIGRATIONS: dict[int, Any] = {}

_TOP_KEYS = {"schema_version", "kind", "created_by", "created_at", "base_model", "method",
             "summary", "tensors", "lora", "metrics", "provenance", "p_true_template"}
_REQUIRED_TOP = {"schema_version", "kind", "created_by", "base_model", "method", "tensors"}
_MODEL_KEYS = {"name", "vocab_size", "tokenizer_sha256"}
_TENSOR_KEYS = {"tau", "shift", "temperature", "answer_temperature"}
_REQUIRED_TENSORS = {"tau", "shift", "temperature"}


def tokenizer_sha256(model_dir: str | os.PathLike) -> str:
    """The tokenizer's identity: sha256 of ``tokenizer.json`` in a model or engine folder."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise IncompatibleModelError(f"{model_dir} has no tokenizer.json; use a model folder "
                                     "saved with its tokenizer (save_pretrained)")
    return sha256_file(path)


@dataclass(frozen=True)
class ModelIdentity:
    """Which base model an artifact belongs to."""

    name: str
    vocab_size: int
    tokenizer_sha256: str | None = None

    def to_dict(self) -> dict:
        return {"name": self.name, "vocab_size": self.vocab_size,
                "tokenizer_sha256": self.tokenizer_sha256}

    def check_compatible(self, other: ModelIdentity, what: str = "adapter") -> None:
        """Raise :class:`IncompatibleModelError` unless ``other`` is the same model family."""
        if self.vocab_size != other.vocab_size:
            raise IncompatibleModelError(
                f"the {what} is for a vocabulary of {self.vocab_size} tokens ({self.name}) but "
                f"the model has {other.vocab_size} ({other.name}); use an {what} made for "
                "this model")
        if (self.tokenizer_sha256 and other.tokenizer_sha256
                and self.tokenizer_sha256 != other.tokenizer_sha256):
            raise IncompatibleModelError(
                f"the {what}'s tokenizer sha256 {self.tokenizer_sha256[:12]}… differs from the "
                f"model's {other.tokenizer_sha256[:12]}…; use an {what} made for this model")


@dataclass
class CalibrationAdapter:
    """Per-vocabulary temperature ``tau``, shift, scalar temperature and an optional LoRA.

    Use :meth:`identity` for a neutral adapter, :meth:`save_pretrained` /
    :meth:`from_pretrained` for the directory form, :meth:`calibrate` and
    :meth:`fused_head` to apply it (both defer to :mod:`calm_runtime.calibration`).
    """

    base_model: ModelIdentity
    tau: np.ndarray
    shift: np.ndarray
    temperature: float = 1.0
    answer_temperature: float | None = None
    kind: str = "identity"
    method: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    provenance: dict = field(default_factory=dict)
    p_true_template: dict | None = None
    #: a peft LoRA folder (inside a loaded artifact, or a source folder to copy on save)
    lora_path: Path | None = None
    created_by: str = f"calm {__version__}"
    created_at: str | None = None

    def __post_init__(self) -> None:
        self.tau = np.asarray(self.tau, dtype=np.float32)
        self.shift = np.asarray(self.shift, dtype=np.float32)
        self.validate()

    # ------------------------------------------------------------------ construction
    @classmethod
    def identity(cls, base_model: ModelIdentity, **kwargs: Any) -> CalibrationAdapter:
        vocab = base_model.vocab_size
        return cls(base_model=base_model, tau=np.ones(vocab, np.float32),
                   shift=np.zeros(vocab, np.float32), **kwargs)

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Check shapes, finiteness and positivity; raise :class:`ArtifactError`."""
        # re-coerce: the fields are mutable, and the file must hold what the manifest says
        self.tau = np.asarray(self.tau, dtype=np.float32)
        self.shift = np.asarray(self.shift, dtype=np.float32)
        vocab = self.base_model.vocab_size
        if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
            raise ArtifactError(f"base_model.vocab_size must be a positive integer, got "
                                f"{vocab!r}; fix the manifest")
        for name, array in (("tau", self.tau), ("shift", self.shift)):
            if array.shape != (vocab,):
                raise ArtifactError(f"{name} has shape {list(array.shape)} but the vocabulary "
                                    f"has {vocab} tokens; re-fit for this model")
            bad = np.flatnonzero(~np.isfinite(array))
            if bad.size:
                raise ArtifactError(f"{name} has {bad.size} non-finite entries (first at token "
                                    f"id {bad[0]}: {array[bad[0]]}); re-fit or check the artifact")
        bad = np.flatnonzero(self.tau <= 0)
        if bad.size:
            raise ArtifactError(f"tau must be positive; {bad.size} entries are <= 0 (first at "
                                f"token id {bad[0]}: {self.tau[bad[0]]:g}); re-fit or check the "
                                "artifact")
        self.temperature = finite_number(self.temperature, "temperature", positive=True)
        if self.answer_temperature is not None:
            self.answer_temperature = finite_number(self.answer_temperature,
                                                    "answer_temperature", positive=True)

    # ------------------------------------------------------------------ math
    def calibrate(self, logits):
        """Calibrated logits ``(z / tau + shift) / temperature`` (numpy or torch input)."""
        tau, shift = self.tau, self.shift
        if not isinstance(logits, np.ndarray):  # torch tensor: move the vectors alongside
            import torch

            tau = torch.as_tensor(tau, device=logits.device, dtype=logits.dtype)
            shift = torch.as_tensor(shift, device=logits.device, dtype=logits.dtype)
        return apply_calibration(logits, tau, shift, self.temperature)

    def fused_head(self, weight, bias=None):
        """``(W', b')`` for an LM head ``[V, d]`` (numpy or torch), see calibration.fused_head."""
        tau, shift = self.tau, self.shift
        if not isinstance(weight, np.ndarray):
            import torch

            tau = torch.as_tensor(tau, device=weight.device, dtype=weight.dtype)
            shift = torch.as_tensor(shift, device=weight.device, dtype=weight.dtype)
        return fused_head(weight, bias, tau, shift, self.temperature)

    # ------------------------------------------------------------------ persistence
    def save_pretrained(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write the artifact atomically; refuse an existing ``path`` unless ``overwrite``."""
        from safetensors.numpy import save_file

        self.validate()
        tensors = {"tau": self.tau, "shift": self.shift,
                   "temperature": np.asarray(self.temperature, dtype=np.float32)}
        if self.answer_temperature is not None:
            tensors["answer_temperature"] = np.asarray(self.answer_temperature, np.float32)
        lora_source = Path(self.lora_path) if self.lora_path is not None else None
        if lora_source is not None and not (lora_source / "adapter_config.json").is_file():
            raise ArtifactError(f"LoRA folder {lora_source} has no adapter_config.json; save the "
                                "peft model with save_pretrained first")
        created_at = self.created_at or _dt.datetime.now(_dt.timezone.utc).isoformat(
            timespec="seconds")
        manifest = {
            "schema_version": ADAPTER_SCHEMA_VERSION,
            "kind": self.kind,
            "created_by": self.created_by,
            "created_at": created_at,
            "base_model": self.base_model.to_dict(),
            "method": dict(self.method),
            "summary": self.summary(),
            "tensors": {"file": TENSORS_NAME,
                        "entries": {k: {"shape": list(v.shape), "dtype": "float32"}
                                    for k, v in tensors.items()}},
            "lora": LORA_DIR if lora_source is not None else None,
            "metrics": dict(self.metrics),
            "provenance": dict(self.provenance),
            "p_true_template": self.p_true_template,
        }
        target = Path(path)
        with atomic_directory(target, overwrite=overwrite) as staging:
            save_file(tensors, str(staging / TENSORS_NAME))
            if lora_source is not None:
                shutil.copytree(lora_source, staging / LORA_DIR, symlinks=False)
            write_json(staging / MANIFEST_NAME, manifest)
            CalibrationAdapter.from_pretrained(staging)  # verify what was written
        if lora_source is not None:
            self.lora_path = target / LORA_DIR
        self.created_at = created_at
        return target

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> CalibrationAdapter:
        """Load and strictly validate an adapter directory."""
        root = Path(path)
        if not root.is_dir():
            raise ArtifactError(f"adapter directory {root} does not exist; pass the folder "
                                "written by `calm fit` or `calm train`")
        data = read_manifest(root / MANIFEST_NAME, current_version=ADAPTER_SCHEMA_VERSION,
                             migrations=MIGRATIONS, what="calibration adapter")
        where = f"{root / MANIFEST_NAME}"
        check_keys(data, _TOP_KEYS, _REQUIRED_TOP, where)
        model = data["base_model"]
        if not isinstance(model, dict):
            raise ArtifactError(f"{where}: base_model must be an object; re-create the adapter")
        check_keys(model, _MODEL_KEYS, {"name", "vocab_size"}, f"{where} base_model")
        identity = ModelIdentity(str(model["name"]), model["vocab_size"],
                                 model.get("tokenizer_sha256"))
        tensors_section = data["tensors"]
        if not isinstance(tensors_section, dict):
            raise ArtifactError(f"{where}: tensors must be an object; re-create the adapter")
        check_keys(tensors_section, {"file", "entries"}, {"file"}, f"{where} tensors")
        tensor_path = resolve_inside(root, tensors_section["file"])
        arrays = _load_tensors(tensor_path)
        unknown = sorted(set(arrays) - _TENSOR_KEYS)
        if unknown:
            raise ArtifactError(f"{tensor_path} has unknown tensor(s) {unknown}; it was written "
                                f"by another tool (allowed: {sorted(_TENSOR_KEYS)})")
        missing = sorted(_REQUIRED_TENSORS - set(arrays))
        if missing:
            raise ArtifactError(f"{tensor_path} lacks tensor(s) {missing}; re-create the adapter")
        for name in ("temperature", "answer_temperature"):
            if name in arrays and arrays[name].size != 1:
                raise ArtifactError(f"{name} must be a scalar, got shape "
                                    f"{list(arrays[name].shape)}; re-create the adapter")
        lora_ref = data.get("lora")
        lora_path = None
        if lora_ref is not None:
            lora_path = resolve_inside(root, lora_ref)
            if not (lora_path / "adapter_config.json").is_file():
                raise ArtifactError(f"{lora_path} has no adapter_config.json; the LoRA folder is "
                                    "incomplete, re-create the adapter")
        answer_t = arrays.get("answer_temperature")
        return cls(
            base_model=identity,
            tau=arrays["tau"].astype(np.float32, copy=False),
            shift=arrays["shift"].astype(np.float32, copy=False),
            temperature=float(arrays["temperature"].reshape(())),
            answer_temperature=None if answer_t is None else float(answer_t.reshape(())),
            kind=_string(data["kind"], "kind", where),
            method=_mapping(data.get("method"), "method", where),
            metrics=_mapping(data.get("metrics"), "metrics", where),
            provenance=_mapping(data.get("provenance"), "provenance", where),
            p_true_template=data.get("p_true_template"),
            lora_path=lora_path,
            created_by=_string(data["created_by"], "created_by", where),
            created_at=data.get("created_at"),
        )

    # ------------------------------------------------------------------ reporting
    def summary(self) -> dict:
        """A small, human-readable summary (ranges of tau and shift, temperatures)."""
        return {
            "temperature": self.temperature,
            "answer_temperature": self.answer_temperature,
            "tau_min": float(self.tau.min()), "tau_max": float(self.tau.max()),
            "shift_min": float(self.shift.min()), "shift_max": float(self.shift.max()),
            "has_lora": self.lora_path is not None,
        }


def _load_tensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    if not path.is_file():
        raise ArtifactError(f"{path} is missing; the artifact is incomplete, re-create it")
    try:
        arrays = load_file(str(path))
    except (SafetensorError, ValueError, OSError, TypeError, AttributeError) as exc:
        # TypeError/AttributeError: a dtype numpy cannot hold (BF16, F8_*) in the header
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ArtifactError(f"{path} is not a readable safetensors file ({reason}); it is "
                            "truncated or corrupted, re-create the artifact") from None
    for name, array in arrays.items():
        # checked here, not left to numpy: with some libraries loaded numpy reads bf16 too
        if array.dtype != np.float32:
            raise ArtifactError(f"tensor {name!r} in {path} is {array.dtype}, not float32; "
                                "re-create the artifact with float32 tensors")
    return arrays


def _mapping(value: Any, name: str, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ArtifactError(f"{where}: {name} must be an object, got {type(value).__name__}")
    return dict(value)


def _string(value: Any, name: str, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ArtifactError(f"{where}: {name} must be a non-empty string, got {value!r}")
    return value
