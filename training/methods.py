"""The methods of ``calm fit`` / ``calm eval --compare`` and of ``calm train``, each decided
once (docs/methods.md §3, §4).

:data:`FIT_METHODS` maps a post-hoc method's name to a :class:`FitMethod`: what it needs
(a reference model, labels), whether it is vector scaling, DACA-masked or has a
token-level counterpart, where it is fitted (option scores, P(True)'s two-way logits), the
adapter kind it writes and the function of :mod:`calm_training.posthoc.daca` (or
:mod:`calm_training.posthoc.platt`) that fits it. :data:`TRAIN_METHODS` maps a training method's
name to a :class:`TrainMethod`: the α it learns (none: θ only), its outer step
(:mod:`calm_training.calm.bilevel`), its lower objective and the adapter kind;
:data:`UPPER_OBJECTIVES` the upper objectives ``f`` (``--upper``). The rest of
calm_training asks these objects and never compares a method's name; the CLI's choices
and the configs' validation are the names listed here. torch-free (the outer steps import
:mod:`calm_training.calm.bilevel` when they run).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np

from calm_runtime.errors import ConfigError
from calm_training.posthoc import daca
from calm_training.posthoc.platt import fit_platt

__all__ = ["ADAPTER_METHODS", "FIT_METHODS", "FitMethod", "KINDS", "LABEL_FREE", "METHODS",
           "P_TRUE_METHODS", "THETA_ONLY", "TRAIN_METHODS", "TRAIN_METHOD_NAMES", "TrainMethod",
           "UPPER_OBJECTIVES", "UPPER_SPECS", "UpperObjective", "compared_methods", "fit_method",
           "option_method", "p_true_method", "train_method", "upper_objective"]


# ---------------------------------------------------------------------------- calm fit
@dataclass(frozen=True)
class FitMethod:
    """One post-hoc method of ``calm fit`` / ``calm eval --compare``."""

    name: str
    #: label-free: fitted against a pre-trained reference model's scores (``--reference``)
    needs_reference: bool = False
    #: fitted against the calibration split's answers
    needs_labels: bool = False
    #: vector scaling (a weight and a bias per option), else one temperature
    vector: bool = False
    #: DACA's agreement mask (naive: every question, no mask)
    masked: bool = False
    #: has a token-level counterpart (a cloze fit then also fits the answer positions'
    #: next-token temperature, calm_training.posthoc.token_fit)
    token_level: bool = False
    #: fits on option scores ``[N, K]``: ``(reference, scores)`` label-free, else
    #: ``(scores, labels)``; None: not an option-level method (or the unfitted baseline)
    option_fit: Callable | None = None
    #: fits on P(True)'s ``[true, false]`` logits: ``(reference P(True), P(True))``
    #: label-free, else ``(two-way logits, correctness)``; None: none
    p_true_fit: Callable | None = None
    #: compared in the multiple-choice modes (cloze, letter) / in P(True) mode
    choice: bool = True
    p_true: bool = False
    #: ``calm fit`` writes it as an adapter
    writes_adapter: bool = True
    #: picks an abstention threshold on a base adapter rather than fitting a calibration
    abstention: bool = False
    #: why ``calm fit`` writes no adapter for it (the start of the error line)
    refusal: str | None = None

    @property
    def label_free(self) -> bool:
        return self.needs_reference

    @property
    def baseline(self) -> bool:
        """The uncalibrated baseline: nothing to fit."""
        return self.option_fit is None and self.p_true_fit is None and not self.abstention

    @property
    def kind(self) -> str:
        """The adapter kind it writes (after the base adapter's: ``calm+daca``)."""
        return self.name.replace("-", "_")

    def fits_in(self, scoring) -> bool:
        """Whether it is compared in the scoring mode ``scoring`` (a
        :class:`calm_runtime.modes.Mode`)."""
        return self.choice if scoring.choice else self.p_true

    def fit_options(self, scores, *, reference=None, labels=None):
        """The fit on option scores ``scores`` ``[N, K]`` (None for the baseline)."""
        if self.option_fit is None:
            return None
        if self.needs_reference:
            return self.option_fit(reference, scores)
        return self.option_fit(scores, labels)

    def fit_p_true(self, two_way, *, reference=None, correct=None, p_true=None):
        """The fit on two-way logits ``two_way`` ``[N, 2]`` (None for the baseline):
        label-free methods fit ``p_true(two_way)`` to ``p_true(reference)``."""
        if self.p_true_fit is None:
            return None
        if self.needs_reference:
            return self.p_true_fit(p_true(reference), p_true(two_way))
        return self.p_true_fit(two_way, correct)


def _ts_p_true(two_way, correct):
    """Temperature scaling of ``[true, false]`` logits: the label is index 0 when correct."""
    return daca.fit_temperature_scaling(two_way, (1 - np.asarray(correct)).astype(int))


_FIT = (
    FitMethod("vanilla", p_true=True, writes_adapter=False,
              refusal="vanilla is the uncalibrated baseline"),
    FitMethod("naive", needs_reference=True, token_level=True, p_true=True,
              option_fit=partial(daca.fit_daca_temperature, mask=False),
              p_true_fit=partial(daca.fit_daca_p_true, mask=False)),
    FitMethod("daca", needs_reference=True, masked=True, token_level=True, p_true=True,
              option_fit=partial(daca.fit_daca_temperature, mask=True),
              p_true_fit=partial(daca.fit_daca_p_true, mask=True)),
    FitMethod("daca-vector", needs_reference=True, masked=True, vector=True,
              option_fit=daca.fit_daca_vector_scaling),
    FitMethod("ts", needs_labels=True, token_level=True, p_true=True,
              option_fit=daca.fit_temperature_scaling, p_true_fit=_ts_p_true),
    FitMethod("ts-vector", needs_labels=True, vector=True, option_fit=daca.fit_vector_scaling),
    FitMethod("threshold", needs_labels=True, choice=False, abstention=True),
    FitMethod("platt", needs_labels=True, choice=False, p_true=True, p_true_fit=fit_platt,
              writes_adapter=False,
              refusal="Platt scaling is compared by calm eval --compare but not written as "
                      "an adapter yet (it needs a shift on the true token)"),
)
FIT_METHODS: dict[str, FitMethod] = {m.name: m for m in _FIT}
#: the methods compared in the multiple-choice modes (the label-free ones need a reference
#: model, the others labels) and in P(True) mode
METHODS = tuple(m.name for m in _FIT if m.choice)
P_TRUE_METHODS = tuple(m.name for m in _FIT if m.p_true)
LABEL_FREE = tuple(m.name for m in _FIT if m.choice and m.needs_reference)
#: what ``calm fit METHOD`` takes
ADAPTER_METHODS = tuple(m.name for m in _FIT if m.writes_adapter)


def fit_method(name: str) -> FitMethod:
    """The method ``name`` of ``calm fit`` (a :class:`ConfigError` when unknown)."""
    if name not in FIT_METHODS:
        raise ConfigError(f"unknown method {name!r}; choose one of {', '.join(ADAPTER_METHODS)}")
    return FIT_METHODS[name]


def option_method(name: str) -> FitMethod:
    """The method ``name`` as fitted on option scores (cloze, letter)."""
    if name not in METHODS:
        raise ConfigError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}")
    return FIT_METHODS[name]


def p_true_method(name: str) -> FitMethod:
    """The method ``name`` as fitted on P(True)'s two-way logits."""
    if name not in P_TRUE_METHODS:
        raise ConfigError(f"unknown P(True) method {name!r}; choose one of "
                          f"{', '.join(P_TRUE_METHODS)}")
    return FIT_METHODS[name]


def compared_methods(scoring, *, reference: bool, among=None) -> tuple[str, ...]:
    """The methods ``calm eval --compare`` fits in the scoring mode ``scoring`` (those of
    ``among`` only, in its order, when given); the label-free ones only with a reference."""
    names = tuple(FIT_METHODS) if among is None else among
    return tuple(n for n in names if n in FIT_METHODS and FIT_METHODS[n].fits_in(scoring)
                 and (reference or not FIT_METHODS[n].needs_reference))


# ---------------------------------------------------------------------------- calm train
@dataclass(frozen=True)
class TrainMethod:
    """One training method of ``calm train`` (docs/methods.md §4)."""

    name: str
    #: the adapter kind it writes (``lora`` whatever the method with ``--freeze-alpha``)
    kind: str
    #: α's variables: ``("log_tau", "shift")`` over the vocabulary, ``("log_temperature",)``
    #: one learned temperature, or none (θ alone: plain fine-tuning on its own loss)
    alpha: tuple[str, ...] = ("log_tau", "shift")
    #: the outer step of calm_training.calm.bilevel: ``bome`` (the bilevel method),
    #: ``regularization`` (min g + β f), ``iterate`` (alternate a θ step on g and a step
    #: on f) or ``descent`` (plain gradient steps on g)
    solver: str = "bome"
    #: ``iterate``: the f step moves θ and α (else α only)
    theta_path: bool = False
    #: the lower objective g (a loss of CalmModel.objective): ``ce`` on the answer, or
    #: ``cft``, which reads every option and the starting model's bin accuracies
    lower_loss: str = "ce"

    @property
    def theta_only(self) -> bool:
        """No α and no warm start: plain fine-tuning of θ."""
        return not self.alpha

    @property
    def learns_alpha(self) -> bool:
        return bool(self.alpha)

    @property
    def bilevel(self) -> bool:
        return self.solver == "bome"

    @property
    def warm_start(self) -> bool:
        """Whether its first steps are plain LoRA steps (CalmConfig.warm_steps)."""
        return not self.theta_only

    @property
    def default_optimizer(self) -> str:
        """Adam for plain fine-tuning (the usual recipe), SGD for the CALM methods."""
        return "adam" if self.theta_only else "sgd"

    @property
    def reads_all_options(self) -> bool:
        """Its lower objective reads every option of a training question (and needs the
        starting model's confidence-bin accuracies, CFT's E-step), not the answer only."""
        return self.lower_loss == "cft"

    def step(self, theta, alpha, lower, upper, optimizer, options, *, beta: float, reduce):
        """One outer step (calm_training.calm.bilevel) on ``theta`` and ``alpha``."""
        from calm_training.calm import bilevel

        args = (theta, alpha, lower, upper, optimizer)
        if self.solver == "bome":
            return bilevel.bome_step(*args, options, reduce=reduce)
        if self.solver == "regularization":
            return bilevel.regularization_step(*args, beta, reduce=reduce)
        if self.solver == "iterate":
            return bilevel.iterate_step(*args, theta_path=self.theta_path, reduce=reduce)
        return bilevel.descent_step(*args, reduce=reduce)


#: bilevel: BOME (docs/methods.md §4); regularization: min g + β f; iterate-theta: alternate
#: a θ step on g and a (θ, α) step on f, no coupling; iterate-alpha: alternate a θ step on g
#: and an α step on f, no coupling; scalar: BOME with α one learned temperature; lora: plain
#: LoRA fine-tuning (no α); cft: calibration-aware fine-tuning, the training-time baseline
#: (no α; calm_training.calm.cft)
_TRAIN = (
    TrainMethod("bilevel", kind="calm"),
    TrainMethod("regularization", kind="calm_regularization", solver="regularization"),
    TrainMethod("iterate-theta", kind="calm_iterate_theta", solver="iterate", theta_path=True),
    TrainMethod("iterate-alpha", kind="calm_iterate_alpha", solver="iterate"),
    TrainMethod("scalar", kind="calm_scalar", alpha=("log_temperature",)),
    TrainMethod("lora", kind="lora", alpha=(), solver="descent"),
    TrainMethod("cft", kind="cft", alpha=(), solver="descent", lower_loss="cft"),
)
TRAIN_METHODS: dict[str, TrainMethod] = {m.name: m for m in _TRAIN}
TRAIN_METHOD_NAMES = tuple(TRAIN_METHODS)
#: methods without α and without a warm start (plain fine-tuning of θ on their own loss)
THETA_ONLY = tuple(m.name for m in _TRAIN if m.theta_only)
KINDS = {m.name: m.kind for m in _TRAIN}


def train_method(name: str) -> TrainMethod:
    """The training method ``name`` (a :class:`ConfigError` when unknown)."""
    if name not in TRAIN_METHODS:
        raise ConfigError(f"method {name!r} is not one of {', '.join(TRAIN_METHOD_NAMES)}")
    return TRAIN_METHODS[name]


@dataclass(frozen=True)
class UpperObjective:
    """One upper objective ``f`` of ``calm train`` (``--upper``)."""

    name: str
    #: fitted to a pre-trained reference model's option probabilities (``--reference``)
    needs_reference: bool = False
    #: reads the K-option distribution, so only ``--entropy options``
    options_only: bool = False

    def loss(self, entropy: str) -> str:
        """Its loss of CalmModel.objective on the calibration batches (``entropy``: the
        entropy kind, calm_data.ENTROPY_KINDS)."""
        if self.needs_reference:
            return "daca_kl"
        return "neg_option_entropy" if entropy == "options" else "neg_entropy"


#: entropy: the paper's negative entropy of the option distribution; daca: calm's
#: extension, DACA's agreement-masked KL to a pre-trained reference
_UPPER = (UpperObjective("entropy"),
          UpperObjective("daca", needs_reference=True, options_only=True))
UPPER_SPECS: dict[str, UpperObjective] = {u.name: u for u in _UPPER}
UPPER_OBJECTIVES = tuple(UPPER_SPECS)


def upper_objective(name: str) -> UpperObjective:
    """The upper objective ``name`` (a :class:`ConfigError` when unknown)."""
    if name not in UPPER_SPECS:
        raise ConfigError(f"upper {name!r} is not one of {', '.join(UPPER_OBJECTIVES)}")
    return UPPER_SPECS[name]
