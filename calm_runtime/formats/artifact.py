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
import math
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from calm_runtime._version import __version__
from calm_runtime.calibration import (
    SHIFT_LIMIT,
    TAU_RANGE,
    TEMPERATURE_RANGE,
    apply_calibration,
    as_float32,
    fused_head,
)
from calm_runtime.errors import ArtifactError, IncompatibleModelError
from calm_runtime.files import (
    atomic_directory,
    check_tree,
    inside_copier,
    is_dir,
    is_file,
    resolve_inside,
    show,
    show_name,
)
from calm_runtime.formats._adapter_checks import (
    MAX_VOCAB_SIZE,
    check_abstention,
    check_range,
    float32_array,
    load_tensors,
    non_empty_string,
    optional_mapping,
)
from calm_runtime.formats.fit_record import FitRecord
from calm_runtime.formats.manifest import (
    check_keys,
    check_p_true_template,
    iso_timestamp,
    number_in_range,
    read_manifest,
    sha256_hex,
    write_json,
)
from calm_runtime.formats.tokenizer_file import (
    tokenizer_sha256,
)
from calm_runtime.modes import MODES

__all__ = [
    "ADAPTER_SCHEMA_VERSION",
    "MANIFEST_NAME",
    "TENSORS_NAME",
    "ModelIdentity",
    "CalibrationAdapter",
    "tokenizer_sha256",
    "describe_calibrated_outputs",
    "outputs_in_mode",
]

ADAPTER_SCHEMA_VERSION = 1
MANIFEST_NAME = "calm_adapter.json"
TENSORS_NAME = "calibration.safetensors"
LORA_DIR = "lora"

#: migrations[v] upgrades a version-v manifest dict to version v+1 (none exist yet).
MIGRATIONS: dict[int, Any] = {}

_TOP_KEYS = {"schema_version", "kind", "created_by", "created_at", "base_model", "method",
             "summary", "tensors", "lora", "metrics", "provenance", "p_true_template",
             "abstention", "logits"}
_REQUIRED_TOP = {"schema_version", "kind", "created_by", "base_model", "method", "tensors"}
_MODEL_KEYS = {"name", "vocab_size", "tokenizer_sha256", "served"}
_SERVED_KEYS = {"endpoint", "served_model"}


@dataclass(frozen=True)
class ModelIdentity:
    """Which base model an artifact belongs to.

    ``served`` marks a model calibrated through an OpenAI-compatible API
    (``{"endpoint": base URL, "served_model": name}``, never a key): its vocabulary is
    unknown, so ``vocab_size`` is 0 and the adapter holds temperatures only (empty ``tau``
    and ``shift``), applied to the log-probabilities the server returns.
    """

    name: str
    vocab_size: int
    tokenizer_sha256: str | None = None
    served: dict | None = None

    @classmethod
    def served_model(cls, endpoint: str, served_model: str) -> ModelIdentity:
        return cls(name=served_model, vocab_size=0, served={"endpoint": endpoint,
                                                            "served_model": served_model})

    def to_dict(self) -> dict:
        out = {"name": self.name, "vocab_size": self.vocab_size,
               "tokenizer_sha256": self.tokenizer_sha256}
        if self.served is not None:
            out["served"] = dict(self.served)
        return out

    def check_compatible(self, other: ModelIdentity, what: str = "adapter") -> None:
        """Raise :class:`IncompatibleModelError` unless ``other`` is the same model family."""
        if (self.served is None) != (other.served is None):
            raise IncompatibleModelError(
                f"the {what} is for {'a served' if self.served else 'a local'} model "
                f"({self.name}) but the model is {'served' if other.served else 'local'} "
                f"({other.name}); use an {what} made for this model")
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
    #: ``calm fit threshold``: ``{"threshold": t, ...}``; answers below ``t`` are marked
    #: abstained by the runtime and the server (the rest is provenance of the choice)
    abstention: dict | None = None
    #: ``True``: tau and shift act on centred logits ``z - mean_v z`` (docs/methods.md §1,
    #: the manifest's ``"logits": "centered"``); ``False``: on raw logits (no key written)
    centered: bool = False
    #: a peft LoRA folder (inside a loaded artifact, or a source folder to copy on save)
    lora_path: Path | None = None
    created_by: str = f"calm {__version__}"
    created_at: str | None = None

    def __post_init__(self) -> None:
        self.validate()  # also turns tau and shift into float32 arrays

    # ------------------------------------------------------------------ construction
    @classmethod
    def identity(cls, base_model: ModelIdentity, **kwargs: Any) -> CalibrationAdapter:
        vocab = base_model.vocab_size
        return cls(base_model=base_model, tau=np.ones(vocab, np.float32),
                   shift=np.zeros(vocab, np.float32), **kwargs)

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Check every field against the documented format; raise :class:`ArtifactError`.

        ``tau`` entries lie in :data:`~calm_runtime.calibration.TAU_RANGE`, ``|shift|`` is
        at most :data:`~calm_runtime.calibration.SHIFT_LIMIT`, the temperatures lie in
        :data:`~calm_runtime.calibration.TEMPERATURE_RANGE` (all compared as float32).
        """
        _check_identity(self.base_model, "base_model")
        # re-coerce: the fields are mutable, and the file must hold what the manifest says
        self.tau = float32_array(self.tau, "tau")
        self.shift = float32_array(self.shift, "shift")
        vocab = self.base_model.vocab_size
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
        low, high = TAU_RANGE
        check_range(self.tau, "tau", as_float32(low), as_float32(high), f"[{low:g}, {high:g}]")
        check_range(np.abs(self.shift), "shift", -math.inf, as_float32(SHIFT_LIMIT),
                     f"[{-SHIFT_LIMIT:g}, {SHIFT_LIMIT:g}]", values=self.shift)
        self.temperature = number_in_range(self.temperature, "temperature", *TEMPERATURE_RANGE)
        if self.answer_temperature is not None:
            self.answer_temperature = number_in_range(self.answer_temperature,
                                                      "answer_temperature", *TEMPERATURE_RANGE)
        self.kind = non_empty_string(self.kind, "kind", "the adapter")
        self.created_by = non_empty_string(self.created_by, "created_by", "the adapter")
        if self.created_at is not None:
            iso_timestamp(self.created_at, "created_at", "the adapter")
        for name in ("method", "metrics", "provenance"):
            setattr(self, name, optional_mapping(getattr(self, name), name, "the adapter"))
        if self.p_true_template is not None:
            check_p_true_template(self.p_true_template, "the adapter", allow_name=True)
        self.abstention = check_abstention(self.abstention, "the adapter")
        if not isinstance(self.centered, bool):
            raise ArtifactError(f"centered must be True or False, got {self.centered!r}; "
                                "re-create the adapter")
        if self.centered and self.base_model.served is not None:
            raise ArtifactError("a served model's adapter has no per-token part to centre; "
                                "fit it without centring")

    # ------------------------------------------------------------------ math
    def calibrate(self, logits):
        """Calibrated logits ``(z / tau + shift) / temperature`` (numpy or torch input;
        ``z`` centred first when :attr:`centered`).

        For a served model's adapter (no per-token part) ``z / temperature`` of whatever
        logits or log-probabilities are given."""
        if self.base_model.served is not None:
            return logits / self.temperature
        tau, shift = self.tau, self.shift
        if not isinstance(logits, np.ndarray):  # torch tensor: move the vectors alongside
            import torch

            tau = torch.as_tensor(tau, device=logits.device, dtype=logits.dtype)
            shift = torch.as_tensor(shift, device=logits.device, dtype=logits.dtype)
        return apply_calibration(logits, tau, shift, self.temperature, center=self.centered)

    def fused_head(self, weight, bias=None):
        """``(W', b')`` for an LM head ``[V, d]`` (numpy or torch), see calibration.fused_head."""
        if self.base_model.served is not None:
            raise IncompatibleModelError(
                f"this adapter calibrates the served model {self.base_model.name} through its "
                "API; it has no LM head to fuse into (fit on a local copy of the model to "
                "export an engine)")
        tau, shift = self.tau, self.shift
        if not isinstance(weight, np.ndarray):
            import torch

            tau = torch.as_tensor(tau, device=weight.device, dtype=weight.dtype)
            shift = torch.as_tensor(shift, device=weight.device, dtype=weight.dtype)
        return fused_head(weight, bias, tau, shift, self.temperature, center=self.centered)

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
        if lora_source is not None:
            if not is_file(lora_source / "adapter_config.json"):
                raise ArtifactError(f"LoRA folder {show_name(str(lora_source))} has no "
                                    "adapter_config.json; save the peft model with "
                                    "save_pretrained first")
            # nothing from outside the LoRA folder may be copied into the artifact
            check_tree(lora_source, what=f"LoRA folder {show_name(str(lora_source))}")
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
        if self.abstention is not None:
            manifest["abstention"] = dict(self.abstention)
        if self.centered:
            manifest["logits"] = "centered"
        target = Path(path)
        with atomic_directory(target, overwrite=overwrite) as staging:
            save_file(tensors, str(staging / TENSORS_NAME))
            if lora_source is not None:
                # links inside the folder are copied as their files; each file is checked
                # again as it is copied, so nothing from outside can come in
                shutil.copytree(lora_source, staging / LORA_DIR, symlinks=False,
                                copy_function=inside_copier(
                                    lora_source, what=f"LoRA folder {show_name(str(lora_source))}"))
            write_json(staging / MANIFEST_NAME, manifest)
            CalibrationAdapter.from_pretrained(staging)  # verify what was written
        if lora_source is not None:
            self.lora_path = target / LORA_DIR
        self.created_at = created_at
        return target

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> CalibrationAdapter:
        """Load and strictly validate an adapter directory (see docs/formats.md)."""
        root = Path(path)
        if not is_dir(root):
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
        identity = ModelIdentity(model["name"], model["vocab_size"],
                                 model.get("tokenizer_sha256"), model.get("served"))
        _check_identity(identity, f"{where} base_model")
        kind = non_empty_string(data["kind"], "kind", where)
        created_by = non_empty_string(data["created_by"], "created_by", where)
        created_at = data.get("created_at")
        if created_at is not None:
            iso_timestamp(created_at, "created_at", where)
        method = optional_mapping(data.get("method"), "method", where)
        metrics = optional_mapping(data.get("metrics"), "metrics", where)
        provenance = optional_mapping(data.get("provenance"), "provenance", where)
        p_true = data.get("p_true_template")
        if p_true is not None:
            check_p_true_template(p_true, where, allow_name=True)
        tensors_section = data["tensors"]
        if not isinstance(tensors_section, dict):
            raise ArtifactError(f"{where}: tensors must be an object; re-create the adapter")
        check_keys(tensors_section, {"file", "entries"}, {"file"}, f"{where} tensors")
        tensor_path = resolve_inside(root, tensors_section["file"])
        arrays = load_tensors(tensor_path, identity.vocab_size,
                               tensors_section.get("entries"), where)
        lora_ref = data.get("lora")
        lora_path = None
        if lora_ref is not None:
            lora_path = resolve_inside(root, lora_ref)
            if not is_file(lora_path / "adapter_config.json"):
                raise ArtifactError(f"{show_name(str(lora_path))} has no adapter_config.json; the "
                                    "LoRA folder is incomplete, re-create the adapter")
            check_tree(lora_path, what=f"{where}: the LoRA folder {show(lora_ref)}")
        answer_t = arrays.get("answer_temperature")
        logits = data.get("logits", "raw")
        if logits not in ("raw", "centered"):
            raise ArtifactError(f"{where}: logits must be \"raw\" or \"centered\", got "
                                f"{show(logits)}; re-create the adapter")
        return cls(
            base_model=identity,
            tau=arrays["tau"],
            shift=arrays["shift"],
            temperature=float(arrays["temperature"].reshape(())),
            answer_temperature=None if answer_t is None else float(answer_t.reshape(())),
            kind=kind,
            method=method,
            metrics=metrics,
            provenance=provenance,
            p_true_template=p_true,
            abstention=check_abstention(data.get("abstention"), where),
            lora_path=lora_path,
            centered=logits == "centered",
            created_by=created_by,
            created_at=created_at,
        )

    # ------------------------------------------------------------------ reporting
    def summary(self) -> dict:
        """A small, human-readable summary (ranges of tau and shift, temperatures)."""
        return {
            "temperature": self.temperature,
            "answer_temperature": self.answer_temperature,
            # a served model's adapter has no per-token part: the identity's ranges
            "tau_min": float(self.tau.min()) if self.tau.size else 1.0,
            "tau_max": float(self.tau.max()) if self.tau.size else 1.0,
            "shift_min": float(self.shift.min()) if self.shift.size else 0.0,
            "shift_max": float(self.shift.max()) if self.shift.size else 0.0,
            "has_lora": self.lora_path is not None,
            "calibrated_outputs": self.calibrated_outputs(),
        }

    @property
    def fit_record(self) -> FitRecord:
        """How this adapter was fitted (mode, cloze variant, answer temperature, choice
        mode), typed: see :class:`~calm_runtime.formats.fit_record.FitRecord`."""
        return FitRecord.parse(self.method, self.abstention, self.answer_temperature)

    @property
    def cloze_variant(self) -> str | None:
        """``fit_record.cloze_variant``."""
        return self.fit_record.cloze_variant

    @property
    def choice_mode(self) -> str | None:
        """``fit_record.choice_mode``."""
        return self.fit_record.choice_mode

    def has_alpha(self) -> bool:
        """Whether the per-token part (``tau``, ``shift``) is not the identity."""
        return bool((self.tau != 1).any() or (self.shift != 0).any())

    def has_token_calibration(self) -> bool:
        """Whether the fusable part (``tau``, ``shift``, ``temperature``) is not the identity:
        only then are token log-probabilities calibrated."""
        return bool(self.temperature != 1.0 or self.has_alpha())

    def calibrated_outputs(self) -> dict:
        """Which outputs this adapter calibrates, and by which fit: ``{"token_logprobs",
        "option_probabilities", "p_true"}``, each a short description of the fit or ``None``
        (that output is the model's own). Token log-probabilities are calibrated only by the
        fusable part; a cloze ``answer_temperature`` calibrates option probabilities only."""
        return describe_calibrated_outputs(
            kind=self.kind, method=self.method, token=self.has_token_calibration(),
            temperature=self.temperature, answer_temperature=self.answer_temperature)


def describe_calibrated_outputs(*, kind: str, method: Mapping | None, token: bool,
                                temperature: float, answer_temperature: float | None) -> dict:
    """See :meth:`CalibrationAdapter.calibrated_outputs` (also used for engines, from their
    manifest's calibration section)."""
    method = method or {}
    mode = MODES.get(method.get("mode")) if isinstance(method.get("mode"), str) else None
    token_fit = method.get("token_fit") or {}
    if not token:
        token_by = None
    elif token_fit.get("fitted"):
        token_by = (f"{token_fit.get('method')}: token-level temperature "
                    f"{token_fit.get('temperature', temperature):.4g} "
                    f"({token_fit.get('signal', 'answer positions')})")
    elif mode is not None and mode.fitted_on:
        token_by = f"{kind}: temperature {temperature:.4g} fitted on {mode.fitted_on}"
    else:
        token_by = kind
    if answer_temperature is not None:
        option_by = (f"{kind}: cloze answer temperature {answer_temperature:.4g}"
                     + (" on token-calibrated scores" if token else ""))
    else:
        option_by = token_by
    p_true_by = token_by if mode is not None and not mode.choice else None
    return {"token_logprobs": token_by, "option_probabilities": option_by, "p_true": p_true_by}


def outputs_in_mode(outputs: Mapping, mode: str) -> dict:
    """``outputs`` (:func:`describe_calibrated_outputs`) as a choice in ``mode`` applies
    them: in a token-level mode (letter) the option probabilities are the option tokens'
    calibrated log-probabilities, calibrated exactly as token log-probabilities are."""
    out = dict(outputs)
    if MODES[mode].token_level:
        out["option_probabilities"] = out["token_logprobs"]
    return out


def _check_identity(identity: Any, where: str) -> None:
    if not isinstance(identity, ModelIdentity):
        raise ArtifactError(f"{where} must be a ModelIdentity, got {type(identity).__name__}")
    if not isinstance(identity.name, str) or not identity.name:
        raise ArtifactError(f"{where}: name must be a non-empty string, got "
                            f"{show(identity.name)}; fix the manifest")
    vocab = identity.vocab_size
    served = identity.served
    if served is not None:
        if not isinstance(served, Mapping) or set(served) != _SERVED_KEYS or not all(
                isinstance(served[k], str) and served[k] for k in _SERVED_KEYS):
            raise ArtifactError(f"{where}: served must be an object with the strings "
                                f"{sorted(_SERVED_KEYS)}, got {show(served)}; fix the manifest")
        if not served["endpoint"].startswith(("http://", "https://")):
            raise ArtifactError(f"{where}: served.endpoint must be an http(s) URL, got "
                                f"{show(served['endpoint'])}; fix the manifest")
        if vocab != 0 or identity.tokenizer_sha256 is not None:
            raise ArtifactError(f"{where}: a served model's vocab_size is 0 and its "
                                f"tokenizer_sha256 null, got {show(vocab)} and "
                                f"{show(identity.tokenizer_sha256)}; fix the manifest")
        return
    if isinstance(vocab, bool) or not isinstance(vocab, int) or not 1 <= vocab <= MAX_VOCAB_SIZE:
        raise ArtifactError(f"base_model.vocab_size must be a positive integer of at most "
                            f"{MAX_VOCAB_SIZE}, got {show(vocab)}; fix the manifest")
    sha256_hex(identity.tokenizer_sha256, "tokenizer_sha256", where, optional=True)
