"""Prompt formats shared by training, export and the runtime (so all score the same text).

* cloze mode: context ``"Question: {question}\\nAnswer:"``, continuation ``" {option}"``;
* letter mode: the question, the options as ``"A. text"`` lines, then ``"Answer:"``; the
  option tokens are ``" A"``, ``" B"``, ... (``"A"``, ... after a chat template, where the
  answer starts a fresh assistant turn);
* P(True): a built-in template by name (:func:`calm_runtime.modes.builtin_p_true_templates`,
  from ``templates/p_true.json``: data, not code), overridable by passing a template mapping
  with the same keys.

The cloze variants an option's scores are combined by, and what a P(True) template is, are
the modes' (:mod:`calm_runtime.modes`); this module writes the prompts.
"""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence

import numpy as np

from calm_runtime.errors import ConfigError
from calm_runtime.modes import (
    CHOICE_MODES,
    CLOZE_VARIANTS,
    DEFAULT_CLOZE_VARIANT,
    PTrueTemplate,
    builtin_p_true_templates,
)

__all__ = [
    "p_true_template",
    "cloze_context",
    "cloze_continuation",
    "letter_prompt",
    "option_letters",
    "CHOICE_MODES",
    "cloze_option_scores",
    "cloze_variant_for",
    "option_char_count",
]

DEFAULT_P_TRUE_TEMPLATE = "kadavath"


def p_true_template(template: str | Mapping | PTrueTemplate | None = None) -> PTrueTemplate:
    """A built-in template by name (default ``kadavath``), or a custom mapping."""
    if isinstance(template, PTrueTemplate):
        return template
    if template is None:
        template = DEFAULT_P_TRUE_TEMPLATE
    if isinstance(template, Mapping):
        return PTrueTemplate.from_dict(template)
    builtin = builtin_p_true_templates()
    if template not in builtin:
        raise ConfigError(f"unknown P(True) template {template!r}; choose one of "
                          f"{', '.join(sorted(builtin))} or pass a custom template mapping")
    return PTrueTemplate.from_dict({"name": template, **builtin[template]})


def cloze_context(question: str) -> str:
    return f"Question: {question}\nAnswer:"


def cloze_continuation(option: str) -> str:
    return f" {option}"


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
