"""The exception hierarchy: one root, a few documented subclasses.

Every message says what was wrong (with the value) and what to do about it, on one line.
CLIs catch :class:`CalmError` only and print ``ErrorName: message`` through :func:`one_line`,
so that a file name or a server's text inside a message can neither break the line nor
drive the terminal.
"""

from __future__ import annotations

__all__ = [
    "CalmError",
    "ConfigError",
    "ArtifactError",
    "SchemaVersionError",
    "IncompatibleModelError",
    "DataError",
    "ModelSourceError",
    "FitError",
    "ExportValidationError",
    "BackendUnavailableError",
    "one_line",
]


def one_line(text: str) -> str:
    """``text`` with every character that is not printable (line breaks, tabs, terminal
    escape sequences and other control characters, invisible format and direction
    characters) written as ``repr`` writes it (``\\n``, ``\\x1b``, ``\\u202e``)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class CalmError(Exception):
    """Root of every error calm raises on purpose."""


class ConfigError(CalmError, ValueError):
    """A configuration value is out of range or inconsistent with another."""


class ArtifactError(CalmError):
    """An adapter or engine directory is malformed, corrupted or unsafe to read."""


class SchemaVersionError(ArtifactError):
    """An artifact was written by a newer calm (or an unknown schema)."""


class IncompatibleModelError(CalmError):
    """An artifact does not belong to the model it is applied to (vocabulary, tokenizer)."""


class DataError(CalmError, ValueError):
    """A data file or record is malformed; the message names the file and line."""


class ModelSourceError(CalmError):
    """A model spec cannot be resolved, installed or converted."""


class FitError(CalmError):
    """A calibration fit cannot produce a trustworthy result (e.g. empty agreement set)."""


class ExportValidationError(CalmError):
    """An exported engine does not match the reference; no engine was written."""


class BackendUnavailableError(CalmError):
    """A requested backend, provider or optional dependency is not available here."""
