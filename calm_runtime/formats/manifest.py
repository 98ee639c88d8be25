"""JSON manifests with an integer schema version, strict keys and ordered migrations.

Shared by the calibration adapter and the engine directory. A manifest written by a newer
calm is refused; an older one is upgraded through small migration functions, one per
version step; unknown keys are refused rather than dropped.

Reading is bounded: a manifest is a regular file of at most :data:`MAX_MANIFEST_BYTES`,
nested at most :data:`MAX_JSON_DEPTH` levels, with finite numbers only, so no manifest can
make a loader recurse, run out of memory or block.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import numbers
import re
import string
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from calm_runtime.calibration import as_float32
from calm_runtime.errors import ArtifactError, SchemaVersionError
from calm_runtime.files import is_file, read_regular_file, resolve_inside, show
from calm_runtime.modes import p_true_template_names

__all__ = ["read_manifest", "write_json", "check_keys", "parse_json", "finite_number",
           "number_in_range", "iso_timestamp", "sha256_hex", "check_p_true_template",
           "MAX_MANIFEST_BYTES", "MAX_JSON_DEPTH"]

Migration = Callable[[dict], dict]

#: The largest manifest calm reads (calm writes a few kilobytes).
MAX_MANIFEST_BYTES = 16 << 20
#: The deepest nesting of objects and lists a manifest may have (calm writes fewer than 10).
MAX_JSON_DEPTH = 100
_SHA256 = re.compile(r"[0-9a-f]{64}")
_ISO_TIME = re.compile(r"(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})(?:\.\d{1,6})?"
                       r"(Z|[+-](\d{2}):(\d{2}))?", re.ASCII)


def write_json(path: Path, payload: Mapping[str, Any]) -> None:
    """Write ``payload`` as stable, human-readable JSON (NaN/Inf refused)."""
    try:
        text = json.dumps(payload, indent=2, sort_keys=True, allow_nan=False,
                          default=_json_default)
    except (ValueError, TypeError, RecursionError) as exc:
        reason = ("it is nested too deeply" if isinstance(exc, RecursionError)
                  else str(exc).splitlines()[0][:200])
        raise ArtifactError(f"cannot write {Path(path).name}: {reason}; manifests hold finite "
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
    unknown = sorted(set(section) - allowed, key=str)
    if unknown:
        raise ArtifactError(f"{where} has unknown key(s) {show(unknown)}; it was written by "
                            f"another tool or edited by hand (allowed: {sorted(allowed)})")
    missing = sorted(required - set(section))
    if missing:
        raise ArtifactError(f"{where} lacks required key(s) {missing}; re-create the artifact")


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not allowed")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses as inf without calling parse_constant
        raise ValueError(f"number {text[:30]} is not finite")
    return value


def _too_deep(value: Any, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def parse_json(raw: bytes, name: str, fix: str) -> Any:
    """Decode JSON from ``raw`` (UTF-8), refusing NaN/Infinity, non-finite numbers and
    nesting deeper than :data:`MAX_JSON_DEPTH`; every failure is one ArtifactError line
    ``{name} is not valid JSON (reason); {fix}``."""
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant,
                          parse_float=_finite_float)
    except UnicodeDecodeError as exc:
        reason = f"not UTF-8: {exc.reason} at byte {exc.start}"
    except json.JSONDecodeError as exc:
        reason = f"{exc.msg}: line {exc.lineno} column {exc.colno}"
    except RecursionError:
        reason = f"nested deeper than {MAX_JSON_DEPTH} levels"
    except (ValueError, MemoryError) as exc:  # NaN, 1e999, an integer of > 4300 digits
        reason = (str(exc).splitlines() or [type(exc).__name__])[0].split(";")[0][:200]
    else:
        if not _too_deep(data, MAX_JSON_DEPTH):
            return data
        reason = f"nested deeper than {MAX_JSON_DEPTH} levels"
    raise ArtifactError(f"{name} is not valid JSON ({reason}); {fix}")


def read_manifest(path: Path, *, current_version: int, migrations: Mapping[int, Migration],
                  what: str) -> dict:
    """Load a manifest, refuse newer schemas, and migrate older ones to ``current_version``.

    ``migrations[v]`` turns a version-``v`` manifest into a version-``v+1`` one.
    """
    path = Path(path)
    if not is_file(path) and not path.is_symlink():
        raise ArtifactError(f"{path} is missing; {path.parent} is not a {what} directory "
                            "(or it was only partly copied)")
    resolve_inside(path.parent, path.name)  # a link out of the folder (or a loop) is refused
    raw = read_regular_file(path, limit=MAX_MANIFEST_BYTES, what=f"{what} manifest")
    data = parse_json(raw, str(path), f"re-create the {what}")
    if not isinstance(data, dict):
        raise ArtifactError(f"{path} must hold a JSON object; re-create the {what}")
    version = data.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ArtifactError(f"{path} has schema_version {show(version)}, expected a positive "
                            f"integer; re-create the {what}")
    if version > current_version:
        raise SchemaVersionError(f"{path} has schema_version {show(version)}, newer than this "
                                 f"calm supports ({current_version}); upgrade calm to read it")
    while version < current_version:
        step = migrations.get(version)
        if step is None:
            raise SchemaVersionError(f"{path} has schema_version {version} and no migration "
                                     f"to {version + 1} exists; re-create the {what}")
        data = step(dict(data))
        version += 1
        data["schema_version"] = version
    return data


# ---------------------------------------------------------------------- value checks
def finite_number(value: Any, name: str, *, positive: bool = False) -> float:
    """Check a manifest or tensor scalar: a real, finite number (and > 0 when asked)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy scalars too
        raise ArtifactError(f"{name} must be a number, got {show(value)}; fix or re-create the "
                            "artifact")
    try:
        value = float(value)
    except (OverflowError, ValueError):  # an integer too large for a float
        raise ArtifactError(f"{name} is {show(value)}, not a finite float; re-fit the "
                            "calibration") from None
    if not math.isfinite(value):
        raise ArtifactError(f"{name} is {value}, not finite; re-fit the calibration")
    if positive and value <= 0:
        raise ArtifactError(f"{name} must be positive, got {value:g}; re-fit the calibration")
    return value


def number_in_range(value: Any, name: str, low: float, high: float) -> float:
    """A finite number in ``[low, high]`` (bounds compared in their float32 form)."""
    value = finite_number(value, name, positive=low > 0)
    if not as_float32(low) <= value <= as_float32(high):
        raise ArtifactError(f"{name} is {value:g}, outside the allowed range [{low:g}, "
                            f"{high:g}]; re-fit the calibration")
    return value


def iso_timestamp(value: Any, name: str, where: str) -> str:
    """``YYYY-MM-DDTHH:MM:SS`` with optional fraction and ``Z`` / ``±HH:MM`` (a real time)."""
    match = _ISO_TIME.fullmatch(value) if isinstance(value, str) else None
    if match is not None:
        year, month, day, hour, minute, second = (int(g) for g in match.groups()[:6])
        offset_h, offset_m = match.group(8), match.group(9)
        try:
            _dt.datetime(year, month, day, hour, minute, second)
            valid = offset_h is None or (int(offset_h) < 24 and int(offset_m) < 60)
        except ValueError:
            valid = False
        if valid:
            return value
    raise ArtifactError(f"{where}: {name} must be an ISO-8601 time such as "
                        f"'2026-12-01T00:19:31+00:00', got {show(value)}; fix or re-create the "
                        "artifact")


def sha256_hex(value: Any, name: str, where: str, *, optional: bool = False) -> None:
    """A sha256 digest: 64 lowercase hex digits (or ``None`` when ``optional``)."""
    if value is None and optional:
        return
    if not isinstance(value, str) or not _SHA256.fullmatch(value):
        raise ArtifactError(f"{where}: {name} must be a sha256 hex digest (64 lowercase hex "
                            f"digits){' or null' if optional else ''}, got {show(value)}")


_TEMPLATE_KEYS = {"name", "template", "true_token", "false_token", "description"}
_TEMPLATE_REQUIRED = {"template", "true_token", "false_token"}


def check_p_true_template(value: Any, where: str, *, allow_name: bool) -> None:
    """A P(True) template: a mapping with string fields whose ``template`` uses exactly the
    fields ``{question}`` and ``{answer}`` (or, with ``allow_name``, a built-in name)."""
    where = f"{where} p_true_template"
    if isinstance(value, str) and allow_name:
        names = p_true_template_names()
        if value not in names:
            raise ArtifactError(f"{where}: unknown template name {show(value)}; use one of "
                                f"{names} or a template object")
        return
    if not isinstance(value, Mapping):
        kinds = "an object or a built-in name" if allow_name else "an object"
        raise ArtifactError(f"{where} must be {kinds}, got {type(value).__name__}; fix or "
                            "re-create the artifact")
    check_keys(value, _TEMPLATE_KEYS, _TEMPLATE_REQUIRED, where)
    for key in sorted(value):
        if not isinstance(value[key], str):
            raise ArtifactError(f"{where}: {key} must be a string, got {show(value[key])}")
    for key in ("true_token", "false_token"):
        if not value[key]:
            raise ArtifactError(f"{where}: {key} is empty; give the answer token's text")
    try:
        fields = [(field, spec, conversion) for _, field, spec, conversion
                  in string.Formatter().parse(value["template"]) if field is not None]
    except ValueError as exc:
        raise ArtifactError(f"{where}: template is not a valid format string ({exc}); write "
                            "literal braces as {{ and }}") from None
    names = {field for field, _, _ in fields}
    odd = [f for f, spec, conv in fields
           if f not in ("question", "answer") or spec or conv is not None]
    if odd or names != {"question", "answer"}:
        raise ArtifactError(f"{where}: template must contain {{question}} and {{answer}} and "
                            f"no other fields (found {show(sorted(names))}); write literal "
                            "braces as {{ and }}")
