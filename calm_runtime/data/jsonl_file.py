"""Reading a JSONL data file line by line: every problem as ``FILE:LINE: what; the fix``
(``calm data check`` lists them all; :func:`~calm_runtime.data.sets.read_jsonl` stops at the
first). A file that cannot be read at all (missing, a FIFO, a folder) is one
:class:`~calm_runtime.errors.DataError`."""

from __future__ import annotations

import codecs
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path

from calm_runtime.data import olmo_eval_sets
from calm_runtime.errors import DataError
from calm_runtime.files import show

__all__ = ["check_jsonl"]


def check_jsonl(path: str | os.PathLike, parse: Callable[[object], object], *,
                first_only: bool = False) -> tuple[list, list[str]]:
    """The valid records of a JSONL data file and every problem in it, each one line
    ``FILE:LINE: what is wrong; the fix`` (``first_only``: stop at the first). A file that
    cannot be read at all raises :class:`DataError`. ``parse`` makes a record of a line's
    JSON object (:func:`calm_runtime.data.sets.parse_record`), a :class:`DataError` if it
    cannot."""
    path = Path(path)
    raw = _read_data_file(path)
    if raw.startswith(codecs.BOM_UTF8):
        raw = raw[len(codecs.BOM_UTF8):]
    records: list = []
    problems: list[str] = []
    first_line = 0
    for lineno, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            record = _parse_line(line, where, parse)
            if records and record.kind != records[0].kind:
                raise DataError(f"{where}: {record.kind} record in a file whose first record "
                                f"(line {first_line}) is {records[0].kind}; put each kind in "
                                "its own file")
        except DataError as exc:
            problems.append(str(exc))
            if first_only:
                break
            continue
        if not records:
            first_line = lineno
        records.append(record)
    if not records and not problems:
        problems.append(f"{path}: no records (the file is empty or only has blank lines); "
                        "write one JSON object per line")
    return records, problems


def _parse_line(line: bytes, where: str, parse):
    try:
        obj = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        raise DataError(f"{where}: not valid UTF-8; save the file as UTF-8") from None
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno}); write "
                        "exactly one JSON object per line") from None
    except RecursionError:
        raise DataError(f"{where}: invalid JSON (nested too deeply); write one flat JSON "
                        "object per line") from None
    except (ValueError, MemoryError) as exc:  # e.g. an integer of more than 4300 digits
        reason = (str(exc).splitlines() or [type(exc).__name__])[0].split(";")[0][:120]
        raise DataError(f"{where}: invalid JSON ({reason}); write exactly one JSON object "
                        "per line") from None
    try:
        return parse(obj)
    except DataError as exc:
        raise DataError(f"{where}: {exc}") from None


def _read_data_file(path: Path) -> bytes:
    """The bytes of a data file; a FIFO, device or folder is refused, never read."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise DataError(f"{path}: no such file; check the path, or use a named data set "
                        f"({', '.join(olmo_eval_sets.SOURCES)})") from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL character in the path
        reason = getattr(exc, "strerror", None) or str(exc)
        raise DataError(f"{show(str(path))}: cannot be read ({reason}); check the path and its "
                        "permissions") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise DataError(f"{path}: not a regular file (a folder, FIFO or device); give the "
                            "path of a .jsonl file")
        with os.fdopen(os.dup(fd), "rb") as handle:
            return handle.read()
    except OSError as exc:
        raise DataError(f"{path}: cannot be read ({exc.strerror}); check the path and its "
                        "permissions") from None
    finally:
        os.close(fd)
