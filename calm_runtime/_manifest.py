"""JSON manifests with an integer schema version, strict keys and ordered migrations.

Shared by the calibration adapter and the engine directory. A manifest written by a newer
calm is refused; an older one is upgraded through small migration functions, one per
version step; unknown keys are refused rather than dropped.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .errors import ArtifactError, SchemaVersionError

__all__ = ["read_manifest", "write_json", "check_keys"]

Migration = Callable[[dict], dict]


def write_json(path: Path, payload: Mapping[str, Any]) -> None:
    """Write ``payload`` as stable, human-readable JSON (NaN/Inf refused)."""
    try:
        text = json.dumps(payload, indent=2, sort_keys=True, allow_nan=False,
                          default=_json_default)
    except (ValueError, TypeError) as exc:
        raise ArtifactError(f"cannot write {Path(path).name}: {exc}; manifests hold finite "
                            "numbers, strings, lists and objects only (store NaN/Inf as "
                            "null)") from None
    Path(path).write_text(text + "\n", encoding="utf-8")


def _json_default(value: Any):
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot store {type(value).__name__} in a manifest")


def check_keys(section: Mapping[str, Any], allowed: set[str], required: set[str],
               where: str) -> None:
    unknown = sorted(set(section) - allowed)
    if unknown:
        raise ArtifactError(f"{where} has unknown key(s) {unknown}; it was written by another "
                            f"tool or edited by hand (allowed: {sorted(allowed)})")
    missing = sorted(required - set(section))
    if missing:
        raise ArtifactError(f"{where} lacks required key(s) {missing}; re-create the artifact")


def read_manifest(path: Path, *, current_version: int, migrations: Mapping[int, Migration],
                  what: str) -> dict:
    """Load a manifest, refuse newer schemas, and migrate older ones to ``current_version``.

    ``migrations[v]`` turns a version-``v`` manifest into a version-``v+1`` one.
    """
    if not path.is_file():
        raise ArtifactError(f"{path} is missing; {path.parent} is not a {what} directory "
                            "(or it was only partly copied)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as exc:
        raise ArtifactError(f"{path} is not valid JSON ({exc}); re-create the {what}") from None
    if not isinstance(data, dict):
        raise ArtifactError(f"{path} must hold a JSON object; re-create the {what}")
    version = data.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ArtifactError(f"{path} has schema_version {version!r}, expected a positive "
                            f"integer; re-create the {what}")
    if version > current_version:
        raise SchemaVersionError(f"{path} has schema_version {version}, newer than this calm "
                                 f"supports ({current_version}); upgrade calm to read it")
    while version < current_version:
        step = migrations.get(version)
        if step is None:
            raise SchemaVersionError(f"{path} has schema_version {version} and no migration "
                                     f"to {version + 1} exists; re-create the {what}")
        data = step(dict(data))
        version += 1
        data["schema_version"] = version
    return data


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not allowed")


def finite_number(value: Any, name: str, *, positive: bool = False) -> float:
    """Check a manifest or tensor scalar: a real, finite number (and > 0 when asked)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy scalars too
        raise ArtifactError(f"{name} must be a number, got {value!r}; fix or re-create the "
                            "artifact")
    value = float(value)
    if not math.isfinite(value):
        raise ArtifactError(f"{name} is {value}, not finite; re-fit the calibration")
    if positive and value <= 0:
        raise ArtifactError(f"{name} must be positive, got {value}; re-fit the calibration")
    return value
