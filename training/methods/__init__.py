"""The methods of ``calm fit`` / ``calm eval --compare`` and of ``calm train``: one home a
method family (a module for a post-hoc family: its mathematics, the object that fits and
writes it, its own flags and the settings they set; the folder ``calm/`` for ``calm train``'s
methods), and this registry of them by name (docs/methods.md §3, §4). ``vanilla`` is an
entry here, not a home: it fits nothing.

:data:`FIT_METHODS` maps a post-hoc method's name to its
:class:`~calm_training.methods.fit_method.FitMethod` (``vanilla``, ``daca`` with ``naive``,
``ts``, ``vector`` with ``ts-vector`` and ``daca-vector``, ``threshold``, ``platt``): what it
needs, where it is fitted, :meth:`~calm_training.methods.fit_method.FitMethod.fit` over a
plan and :meth:`~calm_training.methods.fit_method.FitMethod.write` onto an adapter.
:func:`add_fit_arguments` adds the flags of ``calm fit`` a family declares for itself
(``add_arguments``), and :func:`fit_settings` reads back the
:class:`~calm_training.posthoc.fit_config.FitConfig` settings they set (``SETTINGS``).
:data:`TRAIN_METHODS` maps a training method's name to its
:class:`~calm_training.methods.calm.method.TrainMethod` (``calm``'s bilevel method and its
ablations, ``lora``, ``cft``); :data:`UPPER_SPECS` the upper objectives ``f`` (``--set upper``).
The rest of calm_training asks these objects and never compares a method's name; the CLI's
choices and the configs' validation are the names listed here.
"""

from __future__ import annotations

from calm_runtime.errors import ConfigError
from calm_training.methods import fit_method as fit_method_home
from calm_training.methods import threshold as threshold_home
from calm_training.methods.calm.method import (
    BILEVEL,
    CFT,
    DACA_UPPER,
    ENTROPY,
    ITERATE_ALPHA,
    ITERATE_THETA,
    LORA,
    REGULARIZATION,
    SCALAR,
    TrainMethod,
    UpperObjective,
)
from calm_training.methods.daca import DACA, NAIVE
from calm_training.methods.fit_method import FitMethod
from calm_training.methods.platt import PLATT
from calm_training.methods.threshold import THRESHOLD
from calm_training.methods.ts import TS
from calm_training.methods.vector import DACA_VECTOR, TS_VECTOR

__all__ = ["ADAPTER_METHODS", "FIT_METHODS", "FitMethod", "KINDS", "LABEL_FREE", "METHODS",
           "P_TRUE_METHODS", "THETA_ONLY", "TRAIN_METHODS", "TRAIN_METHOD_NAMES", "TrainMethod",
           "UPPER_OBJECTIVES", "UPPER_SPECS", "UpperObjective", "add_fit_arguments",
           "compared_methods", "fit_method", "fit_settings", "method_for_mode", "option_method",
           "p_true_method", "train_method", "upper_objective"]


# ---------------------------------------------------------------------------- calm fit
#: the uncalibrated baseline, compared in every mode and never written
VANILLA = FitMethod("vanilla", p_true=True, writes_adapter=False,
                    refusal="vanilla is the uncalibrated baseline")
_FIT = (VANILLA, NAIVE, DACA, DACA_VECTOR, TS, TS_VECTOR, THRESHOLD, PLATT)
FIT_METHODS: dict[str, FitMethod] = {m.name: m for m in _FIT}
#: the methods compared in the multiple-choice modes (the label-free ones need a reference
#: model, the others labels) and in P(True) mode
METHODS = tuple(m.name for m in _FIT if m.choice)
P_TRUE_METHODS = tuple(m.name for m in _FIT if m.p_true)
LABEL_FREE = tuple(m.name for m in _FIT if m.choice and m.needs_reference)
#: what ``calm fit METHOD`` takes
ADAPTER_METHODS = tuple(m.name for m in _FIT if m.writes_adapter)
#: the homes that declare flags of ``calm fit`` of their own, in the order its help lists them:
#: the abstention threshold's, then the token-level fit's of the temperature methods
#: (:class:`~calm_training.methods.fit_method.FitMethod`'s cloze fit)
_FLAGS = (threshold_home, fit_method_home)


def add_fit_arguments(parser, method: FitMethod) -> None:
    """Add to ``calm fit METHOD``'s ``parser`` the flags the method families declare for
    ``method`` (``applies``): the abstention threshold's for ``threshold``, the token-level
    fit's for the temperature methods."""
    for home in _FLAGS:
        if home.applies(method):
            home.add_arguments(parser)


def fit_settings(args) -> dict:
    """The :class:`~calm_training.posthoc.fit_config.FitConfig` settings those flags set, read
    from the parsed ``args`` (their defaults where the method has no such flag)."""
    import dataclasses

    from calm_training.posthoc.fit_config import FitConfig

    defaults = {f.name: f.default for f in dataclasses.fields(FitConfig)}
    return {name: getattr(args, name, defaults[name]) for home in _FLAGS
            for name in home.SETTINGS}


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


def method_for_mode(name: str, scoring) -> FitMethod:
    """The method ``name`` as ``calm fit`` fits it in the scoring mode ``scoring`` (a
    :class:`calm_runtime.modes.Mode`): a one-line error when that mode does not fit it."""
    method = fit_method(name)
    if method.abstention:
        return method
    return option_method(name) if scoring.choice else p_true_method(name)


def compared_methods(scoring, *, reference: bool, among=None) -> tuple[str, ...]:
    """The methods ``calm eval --compare`` fits in the scoring mode ``scoring`` (those of
    ``among`` only, in its order, when given); the label-free ones only with a reference."""
    names = tuple(FIT_METHODS) if among is None else among
    return tuple(n for n in names if n in FIT_METHODS and FIT_METHODS[n].fits_in(scoring)
                 and (reference or not FIT_METHODS[n].needs_reference))


# ---------------------------------------------------------------------------- calm train
_TRAIN = (BILEVEL, REGULARIZATION, ITERATE_THETA, ITERATE_ALPHA, SCALAR, LORA, CFT)
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


_UPPER = (ENTROPY, DACA_UPPER)
UPPER_SPECS: dict[str, UpperObjective] = {u.name: u for u in _UPPER}
UPPER_OBJECTIVES = tuple(UPPER_SPECS)


def upper_objective(name: str) -> UpperObjective:
    """The upper objective ``name`` (a :class:`ConfigError` when unknown)."""
    if name not in UPPER_SPECS:
        raise ConfigError(f"upper {name!r} is not one of {', '.join(UPPER_OBJECTIVES)}")
    return UPPER_SPECS[name]
