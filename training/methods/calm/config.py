"""Settings of a CALM training run (docs/methods.md §4): :class:`CalmConfig` and the names
of its choices. torch-free, like the other config modules (fit_config, export's config)."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field

from calm_runtime.errors import ConfigError
from calm_runtime.modes import CHOICE_MODES, CLOZE_VARIANTS, DEFAULT_CLOZE_VARIANT
from calm_training.methods import (
    KINDS,
    THETA_ONLY,
    TRAIN_METHODS,
    UPPER_OBJECTIVES,
    UPPER_SPECS,
    TrainMethod,
    train_method,
)
from calm_training.methods import TRAIN_METHOD_NAMES as METHODS
from calm_training.methods.calm import data as calm_data

__all__ = ["AS_SPECIFIED", "METHODS", "THETA_ONLY", "OPTIMIZERS", "INNER_OPTIMIZERS", "PHI_MODES",
           "UPPER_PARAMS", "ALPHA_TOKENS", "ALPHA_LOGITS", "UPPER_OBJECTIVES", "DEFAULT_LR",
           "DEFAULT_INNER_LR", "KINDS", "LEGACY_SETTINGS", "CalmConfig"]

# METHODS (the training methods), THETA_ONLY (those without α and without a warm start),
# KINDS (their adapter kinds) and UPPER_OBJECTIVES: calm_training.methods decides each

OPTIMIZERS = ("adam", "sgd")
#: the inner solver of BOME's θ~ (bilevel.INNER_OPTIMIZERS, torch-free here)
INNER_OPTIMIZERS = ("sgd", "adam")
#: inner step sizes when none is given: Adam's steps are about the rate per coordinate
DEFAULT_INNER_LR = {"sgd": 0.01, "adam": 1e-3}
#: what τ divides: the raw logits, or the logits centred on their vocabulary mean
#: (docs/methods.md §1; the adapter records it)
ALPHA_LOGITS = ("raw", "centered")
PHI_MODES = ("grad", "value")  # the same as bilevel.PHI_MODES (torch-free here)
UPPER_PARAMS = ("all", "alpha")
ALPHA_TOKENS = ("all", "options")
#: (LoRA, α) outer learning rates when none is given: plain SGD needs steps about a hundred
#: times larger than Adam's per-coordinate normalised ones. SGD's 0.1 is the rate the CALM
#: replication's probe on the training split chose for SciQ (on ARC-Easy 0.5 came out ahead
#: by 0.005 nats of option NLL; on SciQ 0.5 diverged); α's keeps the ratio 0.2
#: (benchmarks/results/calm_replication.md)
DEFAULT_LR = {"sgd": (0.1, 0.02), "adam": (1e-3, 5e-3)}
#: the method as the paper states it (docs/methods.md §4), in one named configuration:
#: ``calm train --as-specified`` applies these, then any ``--set``/``--holdout``/``--daca``
#: given with it. Raw logits ``z·exp(−log τ) + l`` (no centring), ``−H`` over the vocabulary
#: at the answer positions, the BOME step on (θ, α) with ``∇_θ f`` from the first step (no
#: frozen-α warm start), plain gradient inner steps and plain SGD outer steps, α over the
#: whole vocabulary, and α and no temperature written as trained (no hold-out gate, no
#: DACA temperature: the paper has neither).
AS_SPECIFIED = {"alpha_logits": "raw", "entropy": "vocab", "upper_params": "all",
                "warm_start_steps": 0, "inner_optimizer": "sgd", "optimizer": "sgd",
                "momentum": 0.0, "alpha_tokens": "all", "upper": "entropy",
                "holdout": 0, "daca": False}
#: settings added after runs were recorded, with the behaviour those runs had before the
#: setting existed (a recorded run without the key ran with this value, not the default)
LEGACY_SETTINGS = {"inner_optimizer": "sgd", "alpha_logits": "raw", "upper": "entropy",
                   "reference": None, "holdout": 0.0, "daca": False}


_REQUIRED = object()


def _setting(default=_REQUIRED, help: str = "", *, flag: str = "option", choices=None):
    """A :class:`CalmConfig` field with what ``calm train`` makes of it
    (``calm_training.train_cli``): ``flag`` is ``"option"`` (an option of its own, shown by
    ``--help``), ``"set"`` (an ablation or tuning knob, given as ``--set NAME=VALUE`` and
    listed by ``--help-settings``) or ``"command"`` (an option the command declares itself);
    ``help`` is its one help line, ``choices`` its allowed values."""
    metadata = {"help": help, "flag": flag, "choices": choices}
    if default is _REQUIRED:
        return field(metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True, kw_only=True)
class CalmConfig:
    """Settings of one CALM training run.

    Attributes:
        model: the model to fine-tune (packaged name, folder or .gguf; ``resolve_model``).
        train: labeled training data specs (``NAME:train``, see :mod:`.data`).
        calibration: unlabeled calibration data specs (``NAME:unlabeled``).
        method: one of :data:`METHODS`.
        mode: ``cloze`` (CE on the correct option's text) or ``letter`` (CE on its letter)
            for multiple-choice records; open-QA records always use their answer text.
        chat: letter mode only: apply the chat template (``None``: when the tokenizer has one).
        steps: outer steps (optimizer updates).
        batch_size: global training examples per step (all ranks and micro-batches).
        calibration_batch_size: global calibration examples per step (default batch_size).
        grad_accumulation: micro-batches per rank and step (bounds memory; same result).
        inner_steps: ``T_inner``, gradient steps on the LoRA copy ``θ~`` per outer step.
        inner_lr: step size of those inner steps (``None``: :data:`DEFAULT_INNER_LR` of the
            inner optimizer).
        inner_optimizer: ``adam`` (a fresh Adam per outer step: θ~ moves by about
            ``inner_lr`` per coordinate, so the coupling ``∇_α q`` is not zero) or ``sgd``
            (plain gradient descent, the BOME paper's inner solver).
        outer_lr: learning rate of the outer optimiser for the LoRA weights (``None``: the
            optimizer's default, :data:`DEFAULT_LR`).
        alpha_lr: learning rate for α (``None``: the optimizer's default).
        optimizer: ``sgd`` (with ``momentum`` 0 it is the step BOME's guarantee is about) or
            ``adam`` for the outer update (``None``: ``sgd`` for the CALM methods, ``adam`` for
            plain ``lora``, the usual fine-tuning recipe and the replication's baseline).
        momentum: SGD momentum (default 0: momentum carries earlier directions into the
            step and voids the guarantee that it decreases q).
        phi: ``grad`` (``φ = η‖∇q‖²``) or ``value`` (``φ = η q``).
        eta: ``η`` of ``φ``.
        warm_start_steps: the first this many of ``steps`` are plain LoRA steps (Adam at
            ``warm_start_lr``, α fixed at the identity) before the method's own steps
            (``None``: half of ``steps``; never for ``lora``).
        warm_start_lr: Adam's learning rate during the warm start.
        init_lora: start θ from this peft LoRA folder (or a calm adapter with ``lora/``).
        entropy: the upper objective: ``options`` (entropy of the K-option distribution the
            evaluation reads) or ``vocab`` (full next-token entropy at the answer positions).
        cloze_variant: the cloze score variant of the options entropy (``sum``, ``mean``,
            ``char``), the one evaluation uses.
        upper_params: ``all`` (f's gradient moves θ and α) or ``alpha`` (α only; θ then
            moves through ``λ∇q``).
        alpha_tokens: ``all`` (τ, l over the whole vocabulary) or ``options`` (only the
            tokens of the options/answers in the training and calibration data).
        alpha_l2: weight of the penalty ``Σ (log τ)² + l²`` added to f (0: none).
        alpha_logits: ``centered`` (τ divides ``z − mean_v z``: a per-token temperature
            around a reference point) or ``raw`` (τ divides the raw logits).
        upper: ``entropy`` (the paper's f, the negative entropy on the calibration set) or
            ``daca`` (calm's extension: DACA's KL to ``reference`` on the questions where
            the two models agree; label-free, with the reference's confidence as target).
        reference: the reference model of ``upper="daca"`` and of the DACA temperature
            fitted after training (``daca``); None: the model itself before the LoRA (the
            temperature's reference; ``upper="daca"`` needs one named).
        daca: after training, fit a DACA temperature of the trained model against
            ``reference`` on the calibration set, in ``mode``, and write it into the same
            adapter (calm_training.methods.calm.finish); False: the adapter has no temperature.
        holdout: training questions held out of training for the do-no-harm gate
            (calm_training.methods.calm.gate) of α and of T: a count (an integer, held out
            whole: training data of fewer than twice as many questions is refused, so the
            default 400 always gives the gate 200 deciding questions) or a share (a float in
            (0, 1), taken as asked; under 200 deciding questions the gate is named weak).
            The first half of the hold-out decides whether α and T are written, the other
            half reports what each part did. 0: no hold-out, α and T written as fitted,
            unmeasured.
        cft_weight: ``cft`` only: ``w`` in ``(1 − w)·CE + w·c·L_cal`` (:mod:`.cft`).
        cft_scale: ``cft`` only: ``c``, the scale of the calibration term.
        cft_bins: ``cft`` only: equal-width confidence bins of ``L_cal``.
        freeze_alpha: keep α at the identity (no α variables at all): the method's exact
            schedule with θ alone, the matched control of an α-learning run. The adapter
            then has kind ``lora``.
        q_window: warn when the mean of q over the last this many steps exceeds the mean
            over the this many before.
        beta: weight of ``f`` in the ``regularization`` ablation (``g + β f``).
        lora_rank, lora_alpha, lora_targets: the peft LoRA (dropout 0, B initialised to 0).
        max_length: longest sequence in tokens (contexts are cut from the left).
        calibration_positions: cloze mode: where the entropy is taken on calibration
            questions: ``options`` (every option-token position of every option, as the
            cloze scores read them) or ``answer`` (where the answer starts; K times cheaper).
        seed: seeds the LoRA initialisation and the batch order.
        limit: use only the first ``limit`` records of each data spec.
        checkpoint_every: write a checkpoint every this many steps (0: never).
        device: ``cpu``, ``cuda``, ``cuda:N`` (default: ``cuda:LOCAL_RANK`` when available).
        dtype: the precision the model is loaded and trained in (``auto``: the checkpoint's
            own, calm_runtime/placement.py); logits are upcast before every objective.
    """

    model: str = _setting(help="the model to fine-tune", flag="command")
    train: tuple[str, ...] = _setting(help="labeled training data specs", flag="command")
    calibration: tuple[str, ...] = _setting(help="unlabeled calibration data specs",
                                            flag="command")
    method: str = _setting(
        "bilevel", "bilevel (CALM, the default); ablations: regularization (min g + beta f, no "
        "constraint), iterate-theta (alternate a LoRA step on g and a step of LoRA and tau/shift "
        "on f), iterate-alpha (alternate a LoRA step on g and a tau/shift step on f), scalar "
        "(one learned temperature); lora = plain LoRA fine-tuning without calibration; cft = "
        "calibration-aware fine-tuning, the training-time baseline", choices=METHODS)
    mode: str = _setting("cloze", "multiple choice: CE on the option text (cloze) or its letter",
                         choices=CHOICE_MODES)
    chat: bool | None = _setting(None, "letter mode: apply the chat template (default: when the "
                                 "tokenizer has one)", flag="command")
    steps: int = _setting(200, "training steps")
    batch_size: int = _setting(8, "training questions per step (over all processes)")
    calibration_batch_size: int | None = _setting(
        None, "questions per step from the calibration data (default: batch_size)",
        flag="set")
    grad_accumulation: int = _setting(1, "micro-batches per rank and step", flag="set")
    inner_steps: int = _setting(
        3, "gradient steps on a copy of the LoRA per step (how far the training objective can "
        "still fall: what keeps tau/shift from hurting it)", flag="set")
    inner_lr: float | None = _setting(
        None, "step size of those steps (default: 0.001 with adam, 0.01 with sgd)", flag="set")
    inner_optimizer: str = _setting(
        "adam", "inner solver of the LoRA copy: adam (a fresh Adam each outer step) or sgd (the "
        "BOME paper's)", choices=INNER_OPTIMIZERS, flag="set")
    outer_lr: float | None = _setting(
        None, "learning rate of the LoRA (default: 0.1 with sgd, 0.001 with adam)", flag="set")
    alpha_lr: float | None = _setting(
        None, "learning rate of tau/shift (default: 0.02 with sgd, 0.005 with adam)", flag="set")
    optimizer: str | None = _setting(
        None, "outer update: sgd (with momentum 0 the step whose decrease of q BOME guarantees) "
        "or adam (default sgd; adam for method lora)", choices=OPTIMIZERS, flag="set")
    momentum: float = _setting(0.0, "SGD momentum (0 is BOME's step)", flag="set")
    phi: str = _setting("grad", "phi = eta*|grad q|^2 (grad) or eta*q (value)",
                        choices=PHI_MODES, flag="set")
    eta: float = _setting(0.5, "how strongly each step keeps the LoRA at its best training "
                          "loss while tau/shift move", flag="set")
    warm_start_steps: int | None = _setting(
        None, "the first N steps are plain LoRA steps (Adam, tau/shift at the identity) "
        "(default: half of steps)", flag="set")
    warm_start_lr: float = _setting(1e-3, "Adam learning rate of the warm start", flag="set")
    init_lora: str | None = _setting(
        None, "start the LoRA from this peft folder or calm adapter (same rank and targets)",
        flag="set")
    entropy: str = _setting(
        "options", "the entropy of upper entropy: of the K-option distribution (options, calm's "
        "reading) or over the vocabulary at the answer positions (vocab, the specified -H)",
        choices=("options", "vocab"), flag="set")
    cloze_variant: str = _setting(DEFAULT_CLOZE_VARIANT, "cloze score variant of the options "
                                  "entropy", choices=CLOZE_VARIANTS, flag="set")
    upper_params: str = _setting(
        "alpha", "what f's gradient moves: all (LoRA and tau/shift: the specified BOME) or alpha "
        "(tau/shift only, an arm)", choices=UPPER_PARAMS, flag="set")
    alpha_tokens: str = _setting(
        "all", "tau/shift over the whole vocabulary (all) or only the tokens of the options and "
        "answers in the data (options)", choices=ALPHA_TOKENS, flag="set")
    alpha_l2: float = _setting(0.0, "weight of a penalty that keeps tau near 1 and shift near 0",
                               flag="set")
    alpha_logits: str = _setting("centered", "what tau divides: centered (logits minus their "
                                 "vocabulary mean) or raw logits", choices=ALPHA_LOGITS,
                                 flag="set")
    upper: str = _setting(
        "entropy", "upper objective: entropy (-H) or daca (KL to the reference where the two "
        "models agree; calm's extension)", choices=UPPER_OBJECTIVES, flag="set")
    reference: str | None = _setting(
        None, "reference model of the DACA temperature fitted after training (and of upper "
        "daca) (default: the model itself before the LoRA, pre-trained or not; a pre-trained "
        "model is DACA's premise)")
    daca: bool = _setting(True, "fit the DACA temperature after training", flag="command")
    holdout: int | float = _setting(
        400, "training questions held out of training for the gate of tau/shift and T: a count "
        "(training data of fewer than twice as many is refused) or a share in (0, 1); half "
        "decide, half report (0: none, everything written ungated)", flag="command")
    freeze_alpha: bool = _setting(
        False, "keep tau/shift at the identity and run the method's schedule with the LoRA "
        "alone: the matched control of a CALM run", flag="set")
    cft_weight: float = _setting(0.5, "cft: w of (1-w)*CE + w*scale*L_cal", flag="set")
    cft_scale: float = _setting(1e-3, "cft: scale of L_cal", flag="set")
    cft_bins: int = _setting(10, "cft: L_cal's bins", flag="set")
    q_window: int = _setting(10, "warn when the training loss's distance from its best grew "
                             "over the last N steps", flag="set")
    beta: float = _setting(1.0, "regularization ablation: weight of the calibration objective",
                           flag="set")
    lora_rank: int = _setting(8, "LoRA rank")
    lora_alpha: float = _setting(16.0, "LoRA alpha", flag="set")
    #: empty: the model's attention projections (q/k/v/o_proj, Phi-3's qkv_proj/o_proj,
    #: GPT-NeoX's query_key_value/dense; _calm_model.default_lora_targets)
    lora_targets: tuple[str, ...] = _setting(
        (), "comma-separated module names to adapt (default: the model's attention "
        "projections)", flag="set")
    max_length: int = _setting(256, "longest sequence in tokens")
    calibration_positions: str = _setting(
        "options", "cloze: entropy at every option-token position (options) or only where the "
        "answer starts (answer)", choices=("options", "answer"), flag="set")
    seed: int = _setting(0, "seed of the LoRA initialisation and the batch order")
    limit: int | None = _setting(None, "use only the first N records of each data spec "
                                 "(default: all)", flag="set")
    checkpoint_every: int = _setting(0, "checkpoint every N steps (0: never)", flag="set")
    device: str | None = _setting(None, "cpu, cuda or cuda:N (default: cuda when available)")
    dtype: str = _setting("auto", "precision the model is loaded and trained in: auto (the "
                          "checkpoint's own), float32, bfloat16 or float16; the objectives are "
                          "computed in float32",
                          choices=("auto", "float32", "bfloat16", "float16"))

    #: added to ‖∇q‖² in λ's denominator: keeps λ finite when θ is at the inner optimum
    LAMBDA_EPSILON = 1e-12

    def __post_init__(self) -> None:
        from calm_runtime.placement import check_dtype

        object.__setattr__(self, "dtype", check_dtype(self.dtype))
        for name in ("train", "calibration", "lora_targets"):
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value))
        method = TRAIN_METHODS.get(self.method)  # None: reported below
        upper = UPPER_SPECS.get(self.upper)
        if self.optimizer is None:
            object.__setattr__(self, "optimizer",
                               method.default_optimizer if method else "sgd")
        problems = []
        if self.method not in METHODS:
            problems.append(f"method {self.method!r} is not one of {', '.join(METHODS)}")
        if self.mode not in CHOICE_MODES:
            problems.append(f"mode {self.mode!r} is not cloze or letter")
        if self.freeze_alpha and method is not None and len(method.alpha) == 1:
            problems.append(f"freeze_alpha with method {self.method!r} would still train its "
                            "one temperature; use method 'lora' for θ alone, or drop "
                            "freeze_alpha")
        if self.optimizer not in OPTIMIZERS:
            problems.append(f"optimizer {self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
        if self.calibration_positions not in calm_data.CALIBRATION_POSITIONS:
            problems.append(f"calibration_positions {self.calibration_positions!r} is not one "
                            f"of {', '.join(calm_data.CALIBRATION_POSITIONS)}")
        if self.phi not in PHI_MODES:
            problems.append(f"phi {self.phi!r} is not one of {', '.join(PHI_MODES)}")
        for name, allowed in (("entropy", calm_data.ENTROPY_KINDS),
                              ("cloze_variant", CLOZE_VARIANTS),
                              ("upper_params", UPPER_PARAMS), ("alpha_tokens", ALPHA_TOKENS),
                              ("inner_optimizer", INNER_OPTIMIZERS),
                              ("alpha_logits", ALPHA_LOGITS), ("upper", UPPER_OBJECTIVES)):
            if getattr(self, name) not in allowed:
                problems.append(f"{name} {getattr(self, name)!r} is not one of "
                                f"{', '.join(allowed)}")
        if (self.warm_start_steps is not None and not _is_int(self.warm_start_steps, 0)) \
                or not _is_int(self.q_window, 2):
            problems.append(f"warm_start_steps must be an integer >= 0 and q_window >= 2, got "
                            f"{self.warm_start_steps!r}, {self.q_window!r}")
        elif _is_int(self.steps, 1) and method is not None and method.warm_start \
                and self.warm_start_steps is not None and self.warm_start_steps >= self.steps:
            problems.append(f"warm_start_steps {self.warm_start_steps} leaves none of the "
                            f"{self.steps} steps to the {self.method} method; raise --steps")
        if self.init_lora is not None and not isinstance(self.init_lora, str):
            object.__setattr__(self, "init_lora", os.fspath(self.init_lora))
        if not self.train or not self.calibration:
            problems.append("give at least one train and one calibration data spec")
        for name in ("steps", "batch_size", "grad_accumulation", "inner_steps", "lora_rank",
                     "max_length"):
            if not _is_int(getattr(self, name), 1):
                problems.append(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        for name in ("calibration_batch_size", "limit"):
            if getattr(self, name) is not None and not _is_int(getattr(self, name), 1):
                problems.append(f"{name} must be an integer >= 1 or None, got "
                                f"{getattr(self, name)!r}")
        if not _is_int(self.checkpoint_every, 0) or not _is_int(self.seed, 0):
            problems.append(f"checkpoint_every and seed must be integers >= 0, got "
                            f"{self.checkpoint_every!r}, {self.seed!r}")
        for name in ("lora_alpha", "warm_start_lr"):
            if not _positive(getattr(self, name)):
                problems.append(f"{name} must be a positive number, got {getattr(self, name)!r}")
        for name in ("outer_lr", "alpha_lr", "inner_lr"):
            if getattr(self, name) is not None and not _positive(getattr(self, name)):
                problems.append(f"{name} must be a positive number or None, got "
                                f"{getattr(self, name)!r}")
        for name in ("eta", "beta", "momentum", "alpha_l2"):
            value = getattr(self, name)
            if not (_positive(value) or value == 0):
                problems.append(f"{name} must be a finite number >= 0, got {value!r}")
        if not (_positive(self.cft_weight) or self.cft_weight == 0) or self.cft_weight > 1:
            problems.append(f"cft_weight must be in [0, 1], got {self.cft_weight!r}")
        if not (_positive(self.cft_scale) or self.cft_scale == 0):
            problems.append(f"cft_scale must be a finite number >= 0, got {self.cft_scale!r}")
        if not _is_int(self.cft_bins, 2):
            problems.append(f"cft_bins must be an integer >= 2, got {self.cft_bins!r}")
        if upper is not None and upper.needs_reference and not self.reference:
            problems.append(f"upper {self.upper} needs a reference model; pass --reference (a "
                            "pre-trained model, e.g. the base of the model you train)")
        if upper is not None and upper.options_only and self.entropy != "options":
            problems.append(f"upper {self.upper} compares option distributions; use --set entropy="
                            "options")
        if self.reference is not None and not isinstance(self.reference, str):
            object.__setattr__(self, "reference", os.fspath(self.reference))
        if not (_is_int(self.holdout, 0) or (isinstance(self.holdout, float)
                                              and 0 <= self.holdout < 1)):
            problems.append(f"holdout must be a count of questions (an integer >= 0) or a "
                            f"share in [0, 1), got {self.holdout!r}")
        if self.momentum >= 1:
            problems.append(f"momentum must be < 1, got {self.momentum!r}")
        if problems:
            raise ConfigError("; ".join(problems) + "; fix the training settings")

    @property
    def train_method(self) -> TrainMethod:
        """What ``method`` decides (:class:`calm_training.methods.TrainMethod`)."""
        return train_method(self.method)

    @property
    def cal_batch_size(self) -> int:
        return self.calibration_batch_size or self.batch_size

    @property
    def theta_lr(self) -> float:
        """The outer learning rate of the LoRA: ``outer_lr`` or the optimizer's default."""
        return self.outer_lr if self.outer_lr is not None else DEFAULT_LR[self.optimizer][0]

    @property
    def inner_step_lr(self) -> float:
        """The inner step size: ``inner_lr`` or the inner optimizer's default."""
        return (self.inner_lr if self.inner_lr is not None
                else DEFAULT_INNER_LR[self.inner_optimizer])

    @property
    def alpha_step_lr(self) -> float:
        """The outer learning rate of α: ``alpha_lr`` or the optimizer's default."""
        return self.alpha_lr if self.alpha_lr is not None else DEFAULT_LR[self.optimizer][1]

    @property
    def warm_steps(self) -> int:
        """Warm-start steps: ``warm_start_steps``, or half of ``steps`` (0 for ``lora`` and
        ``cft``, which have no warm start)."""
        if not self.train_method.warm_start:
            return 0
        return self.warm_start_steps if self.warm_start_steps is not None else self.steps // 2

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


def _is_int(value, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _positive(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)
