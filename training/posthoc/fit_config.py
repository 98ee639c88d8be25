"""``FitConfig``: what ``calm fit`` / ``calm eval`` fit and evaluate (the methods are
:mod:`calm_training.methods`'s).

It holds every setting of a fit, checked once when it is built (before any method is looked
up): those every method shares, and the few one kind of method reads (``risk``,
``risk_confidence``: the abstention threshold's; ``token_fit``: the temperature methods'
token-level fit), whose flags the module that reads them declares
(:mod:`calm_training.methods.threshold`, :mod:`calm_training.methods.fit_method`:
``add_arguments`` and ``SETTINGS``, gathered by :func:`calm_training.methods.add_fit_arguments`).
Nothing here scores a model; :mod:`calm_training.fit` runs the fits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from calm_runtime import modes
from calm_runtime.data.models import DEFAULT_API_KEY_ENV
from calm_runtime.data.prompts import DEFAULT_P_TRUE_TEMPLATE
from calm_runtime.errors import ConfigError
from calm_runtime.modes import CLOZE_VARIANTS, DEFAULT_CLOZE_VARIANT
from calm_training.scoring.endpoint import (
    DEFAULT_MAX_RETRIES,
    DEFAULT_TIMEOUT,
    check_deadline,
)

__all__ = ["ALL_MODES", "DEFAULT_VARIANT", "FitConfig"]

DEFAULT_VARIANT = DEFAULT_CLOZE_VARIANT  # one default for fitting, training and the runtime
ALL_MODES = modes.MODE_NAMES


@dataclass(frozen=True, kw_only=True)
class FitConfig:
    """What to fit and evaluate.

    Attributes:
        model: the post-trained model to calibrate (a spec for ``resolve_model``, an engine
            folder, or a served model's URL).
        reference: the pre-trained reference model for DACA / naive alignment.
        data: a data spec (``arc-easy``, ``sciq``, a ``.jsonl`` path, ...).
        mode: ``cloze`` or ``letter`` for multiple choice, ``p_true`` for open QA
            (docs/methods.md §2).
        variant: cloze scoring variant (``sum``, ``mean``, ``char``); ignored in letter mode.
        reference_variant: the reference model's cloze variant (default: ``variant``). DACA
            aligns the model with the reference's probabilities, so it can only be as good
            as the reference's own calibration, which depends on how options are scored.
        calibration_fraction: share of the records used for fitting; the rest is the test split.
        seed: seed of the calibration/test split.
        n_bins: bins of ECE/MCE/AECE and the reliability diagram.
        chat: apply the chat template in letter mode (``None``: when the tokenizer has one).
        adapter: an existing adapter (e.g. CALM) to fit on top of; its LoRA and token
            calibration are applied while scoring, the new temperature composes with it.
        batch_size: questions per forward pass while scoring.
        bootstrap: resamples of the ECE's 95% bootstrap interval (0 turns it off).
        limit: use only the first ``limit`` records of the data (quick runs).
        p_true_template: the P(True) template (``p_true`` mode, open-QA data).
        max_length: refuse (one line, naming the record) any scored sequence longer than
            this many tokens; ``None``: the model's context (``max_position_embeddings``).
        model_name, reference_name: the served model names when ``model`` / ``reference``
            are endpoint URLs (``None``: the single model the endpoint lists).
        api_key_env: the environment variable holding the endpoints' API key.
        concurrency: requests in flight per endpoint.
        timeout: seconds one endpoint call may take in all, its retries and their backoff
            included (``--timeout``).
        max_retries: attempts after the first on 429, 5xx, time-outs and connection errors,
            within ``timeout`` (``--max-retries``).
        risk, risk_confidence: ``calm fit threshold``: the selective risk to stay at or
            below, and the probability with which (see :mod:`calm_training.methods.threshold`).
        model_scores, reference_scores: ``lm-eval:PATH``: the model's (the reference's)
            option scores read from an lm-evaluation-harness sample log instead of running it
            (:mod:`calm_training.scoring.lm_eval_logs`); the model's log also gives the
            records, and ``model`` / ``reference`` then only name the models.
        token_fit: cloze mode: fit a token-level temperature first (on the next-token
            distributions, so that the engine's token confidences are calibrated too), then
            the answer temperature on top of it; ``False`` (``--no-token-fit``): the answer
            temperature only, which is all a fit from lm-eval logs can do.
        dtype, device: where a local model (and reference) is loaded and in which precision
            (``--dtype``, ``--device``; ``auto``: the checkpoint's own dtype, CUDA when
            available; calm_runtime/placement.py). Scores are read in float32 either way.
    """

    model: str
    data: str
    reference: str | None = None
    mode: str = "cloze"
    variant: str = DEFAULT_VARIANT
    reference_variant: str | None = None
    calibration_fraction: float = 0.3
    seed: int = 0
    n_bins: int = 10
    chat: bool | None = None
    adapter: str | None = None
    batch_size: int = 8
    bootstrap: int = 1000
    limit: int | None = None
    p_true_template: str = DEFAULT_P_TRUE_TEMPLATE
    max_length: int | None = None
    model_name: str | None = None
    reference_name: str | None = None
    api_key_env: str = DEFAULT_API_KEY_ENV
    concurrency: int = 8
    timeout: float = DEFAULT_TIMEOUT
    max_retries: int = DEFAULT_MAX_RETRIES
    risk: float = 0.1
    risk_confidence: float = 0.95
    model_scores: str | None = None
    reference_scores: str | None = None
    token_fit: bool = True
    dtype: str = "auto"
    device: str = "auto"

    def __post_init__(self) -> None:
        problems = []
        from calm_runtime.placement import check_device, check_dtype

        for name, check in (("dtype", check_dtype), ("device", check_device)):
            try:
                object.__setattr__(self, name, check(getattr(self, name)))
            except ConfigError as exc:
                problems.append(str(exc).split(";")[0])
        if not isinstance(self.token_fit, bool):
            problems.append(f"token_fit must be true or false, got {self.token_fit!r}")
        if not 0 < self.risk < 1:
            problems.append(f"risk {self.risk!r} must lie strictly between 0 and 1")
        if not 0.5 <= self.risk_confidence < 1:
            problems.append(f"risk_confidence {self.risk_confidence!r} must lie in [0.5, 1)")
        if not isinstance(self.concurrency, int) or self.concurrency < 1:
            problems.append(f"concurrency {self.concurrency!r} must be an integer >= 1")
        try:
            check_deadline(self.timeout, self.max_retries)
        except ConfigError as exc:
            problems.append(str(exc).split("; fix")[0])
        if self.max_length is not None and (not isinstance(self.max_length, int)
                                            or self.max_length < 2):
            problems.append(f"max_length {self.max_length!r} must be an integer >= 2")
        if self.mode not in ALL_MODES:
            problems.append(f"mode {self.mode!r} is not one of {', '.join(ALL_MODES)}")
        for name in ("variant", "reference_variant"):
            value = getattr(self, name)
            if value is not None and value not in CLOZE_VARIANTS:
                problems.append(f"{name} {value!r} is not one of {', '.join(CLOZE_VARIANTS)}")
        if not 0 < self.calibration_fraction < 1:
            problems.append(f"calibration_fraction {self.calibration_fraction} is not in (0, 1)")
        if self.n_bins < 1:
            problems.append(f"n_bins {self.n_bins} must be >= 1")
        if self.batch_size < 1:
            problems.append(f"batch_size {self.batch_size} must be >= 1")
        if self.limit is not None and self.limit < 2:
            problems.append(f"limit {self.limit} must be >= 2")
        from calm_training.scoring.lm_eval_logs import is_log_spec

        for name in ("model_scores", "reference_scores"):
            value = getattr(self, name)
            if value is not None and not is_log_spec(value):
                problems.append(f"{name} {value!r} must be lm-eval:PATH (a samples_*.jsonl "
                                "of lm_eval --log_samples)")
        if self.reference_scores is not None and self.model_scores is None:
            problems.append("reference_scores need model_scores too (both models' scores "
                            "come from logs of the same documents)")
        if (self.model_scores is not None and self.mode in ALL_MODES
                and not modes.mode(self.mode).choice):
            problems.append("scores from lm-eval logs are multiple-choice scores; use --mode "
                            "cloze or letter")
        if problems:
            raise ConfigError("; ".join(problems) + "; fix the arguments")

    @property
    def scoring_mode(self) -> modes.Mode:
        """What ``mode`` decides (:class:`calm_runtime.modes.Mode`)."""
        return modes.mode(self.mode)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
