"""The three scoring modes, decided once (docs/methods.md §2).

* ``cloze``: each option's text is scored as the continuation of a text prompt; its token
  log-probabilities are combined by a cloze *variant* (``sum``, ``mean``, ``char``) and a
  fitted temperature is an *answer temperature* on those option scores;
* ``letter``: the options are listed as ``A. ...`` lines and read from the option letters'
  next-token logits;
* ``p_true``: a yes/no judgement of a proposed answer, read from two tokens' logits.

Letter and P(True) read next-token logits after one prompt (which may go through the chat
template), so a temperature fitted on them is a token-level transform: the adapter's
``temperature``, fused into an engine's head. Files (adapters, engine manifests, reports)
keep storing the mode's name; code turns the name into a :class:`Mode` with :func:`mode`
and asks it, instead of comparing strings. :func:`option_probabilities` is the one option
softmax. What the modes put to a model is decided here too: the cloze variants
(:data:`CLOZE_VARIANTS`, the default :data:`DEFAULT_CLOZE_VARIANT`) and P(True)'s template
(:class:`PTrueTemplate`; the built-in ones are data, ``templates/p_true.json``), so the files
that record them are checked against them. Nothing here imports torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from calm_runtime.calibration import apply_calibration
from calm_runtime.errors import ConfigError

__all__ = ["Mode", "MODES", "MODE_NAMES", "CHOICE_MODES", "mode", "option_probabilities",
           "p_true_probability", "CLOZE_VARIANTS", "DEFAULT_CLOZE_VARIANT", "PTrueTemplate",
           "builtin_p_true_templates", "p_true_template_names"]


@dataclass(frozen=True)
class Mode:
    """What a scoring mode decides; get one with :func:`mode`."""

    #: the name files and the command line use: ``cloze``, ``letter`` or ``p_true``
    name: str
    #: a multiple-choice mode (cloze, letter); ``p_true`` judges one proposed answer
    choice: bool
    #: the scores are next-token logits read after one prompt (letter, p_true): a fitted
    #: temperature is token-level (the adapter's ``temperature``, fusable into an engine's
    #: head) and no cloze variant applies. ``False`` (cloze): option scores combined by a
    #: variant, calibrated by an answer temperature on them
    token_level: bool
    #: what a token-level temperature of this mode is fitted on (``None``: not token-level)
    fitted_on: str | None = None

    @property
    def chat_prompts(self) -> bool:
        """Whether the prompt may go through the chat template: letter and P(True) prompts
        are messages; a cloze prompt is text that each option continues."""
        return self.token_level

    def score_variant(self, asked: str) -> str:
        """The variant to score option scores with: ``asked`` for cloze, else ``"sum"``
        (the raw logits)."""
        return "sum" if self.token_level else asked

    def recorded_variant(self, variant: str | None) -> str | None:
        """The cloze variant an adapter or report records: ``variant`` for cloze, else
        ``None``."""
        return None if self.token_level else variant

    def answer_temperature(self, recorded: float | None) -> float:
        """The temperature of the option softmax: the recorded answer temperature in cloze
        mode (1.0 when none), else 1.0 (a token-level temperature is already applied)."""
        return 1.0 if self.token_level or recorded is None else recorded


CLOZE = Mode("cloze", choice=True, token_level=False)
LETTER = Mode("letter", choice=True, token_level=True,
              fitted_on="the option letters' logits")
P_TRUE = Mode("p_true", choice=False, token_level=True, fitted_on="P(True)'s two letters")
#: every mode by name
MODES = {m.name: m for m in (CLOZE, LETTER, P_TRUE)}
#: the names of every mode (what a fit records)
MODE_NAMES = tuple(MODES)
#: the two ways a multiple-choice question is put to a model (docs/methods.md §2)
CHOICE_MODES = tuple(name for name, m in MODES.items() if m.choice)

#: How a cloze option is scored from the log-probability of its text: ``sum`` (summed),
#: ``mean`` (per token) or ``char`` (per character of the option, lm-eval's ``acc_norm``).
CLOZE_VARIANTS = ("sum", "mean", "char")
#: The one default everywhere (fitting, training, export checks, runtime scoring): per-token
#: mean scores gave the better-calibrated reference model in the project's calibration
#: benchmark (benchmarks/results/calibration.md), which is what DACA relies on.
DEFAULT_CLOZE_VARIANT = "mean"

_TEMPLATE_FILE = Path(__file__).resolve().parent / "templates" / "p_true.json"


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
def builtin_p_true_templates() -> dict[str, dict]:
    """The built-in P(True) templates by name (``templates/p_true.json``), as mappings
    :meth:`PTrueTemplate.from_dict` takes (less their name)."""
    return json.loads(_TEMPLATE_FILE.read_text(encoding="utf-8"))


def p_true_template_names() -> list[str]:
    return sorted(builtin_p_true_templates())


def mode(name: str | Mode, *, choice: bool = False) -> Mode:
    """The :class:`Mode` called ``name`` (a :class:`Mode` is returned as it is: what is
    resolved once travels as the object); a :class:`ConfigError` when there is none (or,
    with ``choice``, when it is not a multiple-choice mode)."""
    allowed = CHOICE_MODES if choice else MODE_NAMES
    if isinstance(name, Mode):
        if name.name not in allowed:
            raise ConfigError(f"mode {name.name!r} is not one of {', '.join(allowed)}")
        return name
    if not isinstance(name, str) or name not in allowed:
        raise ConfigError(f"unknown mode {name!r}; choose one of {', '.join(allowed)}")
    return MODES[name]


def p_true_probability(two_way, temperature: float = 1.0) -> np.ndarray:
    """P(True) from ``[N, 2]`` ``[true, false]`` logits at temperature ``T``: the two-way
    softmax's first entry, ``sigmoid((z_true - z_false) / T)`` (docs/methods.md §2)."""
    z = np.asarray(two_way, dtype=np.float64) / temperature
    return 1.0 / (1.0 + np.exp(np.clip(z[:, 1] - z[:, 0], -700, 700)))


def option_probabilities(scores, temperature: float = 1.0) -> np.ndarray:
    """``softmax(scores / T)`` over the last axis (the options), max-subtracted, in the
    scores' dtype; ``-inf`` scores get probability 0."""
    z = apply_calibration(np.asarray(scores), temperature=temperature)
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)
