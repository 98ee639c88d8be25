"""Checks of the runtime's inputs, shared by generation and judging: one-line errors that
name the input ("prompt 2 of 5") and the fix."""

from __future__ import annotations

import re

import numpy as np

from calm_runtime.errors import ConfigError

_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(text: str, label: str) -> None:
    """Refuse text the tokenizer cannot take: a lone UTF-16 surrogate is not Unicode."""
    found = _SURROGATE.search(text)
    if found is not None:
        raise ConfigError(f"{label} holds a lone UTF-16 surrogate "
                          f"({found.group()!r} at character {found.start()}), which is not "
                          "valid Unicode; pass valid text")


def input_label(kind: str, index: int, count: int) -> str:
    """How an error names input ``index`` of ``count``: "the prompt" or "prompt 2 of 5"."""
    return f"the {kind}" if count == 1 else f"{kind} {index + 1} of {count}"


def non_negative_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name} must be an integer >= 0, got {value!r}")
    return value


def positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return int(value)
