"""Prompt formats shared by training, export and the runtime (so all score the same text).

* cloze mode: context ``"Question: {question}\\nAnswer:"``, continuation ``" {option}"``;
* letter mode: the question, the options as ``"A. text"`` lines, then ``"Answer:"``; the
  option tokens are ``" A"``, ``" B"``, ... (``"A"``, ... after a chat template, where the
  answer starts a fresh assistant turn);
* P(True): named templates from ``templates/p_true.json`` (data, not code), overridable
  by passing a template mapping with the same keys.
"""

from __future__ import annotations

import json
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from calm_runtime.errors import ConfigError
from calm_runtime.modes import CHOICE_MODES

__all__ = [
    "PTrueTemplate",
    "p_true_template",
    "p_true_template_names",
    "cloze_context",
    "cloze_continuation",
    "letter_prompt",
    "option_letters",
    "CHOICE_MODES",
    "CLOZE_VARIANTS",
    "DEFAULT_CLOZE_VARIANT",
    "cloze_option_scores",
    "cloze_variant_for",
    "option_char_count",
]

_TEMPLATE_FILE = Path(__file__).resolve().parents[1] / "templates" / "p_true.json"
DEFAULT_P_TRUE_TEMPLATE = "kadavath"


@dataclass(frozen=True)
class PTrueTemplate:
    """A P(True) prompt: ``template`` with ``{question}`` and ``{answer}``, and two tokens."""

    name: str
    template: str
    true_token: str
    false_token: str
    description: str = ""

    def render(self, question: str, answer: str) -> str:
        return self.template.format(question=question, answer=answer)

    def to_dict(self) -> dict:
        return {"name": self.name, "template": self.template, "true_token": self.true_token,
                "false_token": self.false_token, "description": self.description}

    @classmethod
    def from_dict(cls, data: Mapping) -> PTrueTemplate:
        allowed = {"name", "template", "true_token", "false_token", "description"}
        unknown = sorted(set(data) - allowed)
        missing = sorted({"template", "true_token", "false_token"} - set(data))
        if unknown or missing:
            raise ConfigError(f"P(True) template has unknown keys {unknown} / lacks {missing}; "
                              f"use the keys {sorted(allowed)}")
        text = str(data["template"])
        if "{question}" not in text or "{answer}" not in text:
            raise ConfigError("P(True) template must contain {question} and {answer}; fix the "
                              "template text")
        return cls(name=str(data.get("name", "custom")), template=text,
                   true_token=str(data["true_token"]), false_token=str(data["false_token"]),
                   description=str(data.get("description", "")))


@lru_cache(maxsize=1)
def _builtin_templates() -> dict[str, dict]:
    return json.loads(_TEMPLATE_FILE.read_text(encoding="utf-8"))


def p_true_template_names() -> list[str]:
    return sorted(_builtin_templates())


def p_true_template(template: str | Mapping | PTrueTemplate | None = None) -> PTrueTemplate:
    """A built-in template by name (default ``kadavath``), or a custom mapping."""
    if isinstance(template, PTrueTemplate):
        return template
    if template is None:
        template = DEFAULT_P_TRUE_TEMPLATE
    if isinstance(template, Mapping):
        return PTrueTemplate.from_dict(template)
    builtin = _builtin_templates()
    if template not in builtin:
        raise ConfigError(f"unknown P(True) template {template!r}; choose one of "
                          f"{', '.join(sorted(builtin))} or pass a custom template mapping")
    return PTrueTemplate.from_dict({"name": template, **builtin[template]})


def cloze_context(question: str) -> str:
    return f"Question: {question}\nAnswer:"


def cloze_continuation(option: str) -> str:
    return f" {option}"


#: How a cloze option is scored from the log-probability of its text: ``sum`` (summed),
#: ``mean`` (per token) or ``char`` (per character of the option, lm-eval's ``acc_norm``).
CLOZE_VARIANTS = ("sum", "mean", "char")
#: The one default everywhere (fitting, training, export checks, runtime scoring): per-token
#: mean scores gave the better-calibrated reference model in the project's calibration
#: benchmark (benchmarks/results/calibration.md), which is what DACA relies on.
DEFAULT_CLOZE_VARIANT = "mean"


def cloze_variant_for(asked: str | None, recorded: str | None, *, bound: bool, what: str,
                      fix: str) -> str:
    """The cloze variant to score with, by the one rule every command and the runtime follow.

    An answer temperature is a temperature of the scores of the variant it was fitted on.
    ``recorded`` is the variant an adapter or engine records (``None``: none recorded) and
    ``bound`` whether an answer temperature hangs on it. The recorded variant is the default;
    asking for another one (``asked``) while it is bound is a :class:`ConfigError` naming
    ``what`` and the ``fix``, never a silent switch or a warning. Without a record, the asked
    variant or :data:`DEFAULT_CLOZE_VARIANT`.
    """
    for value in (asked, recorded):
        if value is not None and value not in CLOZE_VARIANTS:
            raise ConfigError(f"unknown cloze variant {value!r}; choose one of "
                              f"{', '.join(CLOZE_VARIANTS)}")
    if asked is None or asked == recorded:
        return recorded or DEFAULT_CLOZE_VARIANT
    if recorded is None or not bound:
        return asked
    raise ConfigError(f"{what}'s answer_temperature was fitted on {recorded!r} cloze scores, "
                      f"not {asked!r}; {fix}")


def option_char_count(option: str) -> int:
    """The character count the ``char`` variant divides by (at least 1)."""
    return max(len(option.strip()), 1)


def cloze_option_scores(logprob_sums, n_tokens, n_chars,
                        variant: str = DEFAULT_CLOZE_VARIANT) -> np.ndarray:
    """Option scores of a :data:`CLOZE_VARIANTS` variant from summed log-probabilities.

    Training fits ``answer_temperature`` on these scores and the runtime applies it to the
    same ones, so both call this function.
    """
    sums = np.asarray(logprob_sums, dtype=np.float64)
    if variant == "sum":
        return sums.copy()
    if variant == "mean":
        return sums / np.maximum(np.asarray(n_tokens), 1)
    if variant == "char":
        return sums / np.maximum(np.asarray(n_chars), 1)
    raise ConfigError(f"unknown cloze variant {variant!r}; choose one of "
                      f"{', '.join(CLOZE_VARIANTS)}")


def option_letters(k: int) -> list[str]:
    if not 2 <= k <= len(string.ascii_uppercase):
        raise ConfigError(f"multiple choice needs 2 to 26 options, got {k}; check the record")
    return list(string.ascii_uppercase[:k])


def letter_prompt(question: str, options: Sequence[str]) -> str:
    lines = [f"Question: {question}"]
    letters = option_letters(len(options))
    lines += [f"{letter}. {text}" for letter, text in zip(letters, options, strict=True)]
    lines.append("Answer:")
    return "\n".join(lines)


def letter_tokens(k: int, *, chat: bool) -> list[str]:
    """The option tokens' text: ``" A"`` after a plain prompt, ``"A"`` after a chat prompt."""
    prefix = "" if chat else " "
    return [prefix + letter for letter in option_letters(k)]
