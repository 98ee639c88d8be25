"""``FitPlan``: one ``calm fit`` / ``calm eval`` run, resolved once.

:meth:`FitPlan.resolve` turns a :class:`~calm_training.posthoc.fit_config.FitConfig` into
what the run works on: its scoring :class:`~calm_runtime.modes.Mode`, the model and the
reference as :class:`~calm_training.scoring.sources.ModelSource` objects (each resolved
once; a served one connects once, on first use, and every later step reuses that
connection), the records, the calibration/test split, the prompt format and the adapter a
fit goes on top of. :mod:`calm_training.fit`, :mod:`calm_training.posthoc.p_true`
and :mod:`calm_training.posthoc.evaluate` hand this plan, or the values they need from it,
to their helpers, never the config.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from calm_runtime.data.prompts import p_true_template
from calm_runtime.data.sets import (
    MultipleChoiceRecord,
    OpenQARecord,
    dataset_hash,
    load_dataset,
    split_indices,
)
from calm_runtime.errors import ConfigError, DataError
from calm_runtime.formats.artifact import CalibrationAdapter, ModelIdentity
from calm_runtime.modes import Mode, PTrueTemplate
from calm_training.posthoc.fit_config import FitConfig
from calm_training.posthoc.fit_report import Metrics
from calm_training.scoring.sources import ModelSource, resolve_source

__all__ = ["FitPlan"]


@dataclass(eq=False)
class FitPlan:
    """A run's settings resolved into what it works on (see the module's docstring)."""

    config: FitConfig
    mode: Mode
    model: ModelSource
    reference: ModelSource | None
    #: records handed over by the caller (``calm train``'s own calibration set), all of them
    #: the calibration split; None: ``config.data``'s, split by ``calibration_fraction``
    given: list | None = None

    @classmethod
    def resolve(cls, config: FitConfig, *, records: list | None = None) -> FitPlan:
        def source(role: str) -> ModelSource | None:
            spec = getattr(config, role)
            if spec is None:
                return None
            return resolve_source(spec, model_name=getattr(config, f"{role}_name"),
                                  placement=(config.dtype, config.device),
                                  api_key_env=config.api_key_env,
                                  concurrency=config.concurrency, timeout=config.timeout,
                                  max_retries=config.max_retries)

        return cls(config=config, mode=config.scoring_mode, model=source("model"),
                   reference=source("reference"), given=records)

    # ------------------------------------------------------------------------ settings
    @property
    def metrics(self) -> Metrics:
        return Metrics(n_bins=self.config.n_bins, bootstrap=self.config.bootstrap)

    @property
    def served(self) -> bool:
        """Whether the model or the reference is a served model."""
        return any(s is not None and s.served for s in (self.model, self.reference))

    def require_reference(self) -> ModelSource:
        """The reference, or a one-line error (before any scoring) when there is none."""
        if self.reference is None:
            raise ConfigError("label-free methods need a reference (pre-trained) model; pass "
                              "--reference, e.g. gemma-3-270m")
        return self.reference

    @cached_property
    def chat(self) -> bool:
        """Whether the run's prompts go through the model's chat template. Cloze prompts
        are always text; letter and P(True) prompts follow ``--chat`` (unset: the chat
        template when the model has one; a served model has one when it answers chat
        completions), the same rule for a local, exported or served model."""
        return self.mode.chat_prompts and self.model.chat(self.config.chat)

    @property
    def prompt_format(self) -> str:
        """``"chat"`` or ``"plain"``: how the run's prompts reach the model (:attr:`chat`),
        as an adapter records it."""
        return "chat" if self.chat else "plain"

    @cached_property
    def p_true_template(self) -> PTrueTemplate:
        """P(True) mode: the template the models judge answers with (``--p-true-template``),
        read once; what a P(True) adapter records."""
        return p_true_template(self.config.p_true_template)

    @cached_property
    def base(self) -> tuple[CalibrationAdapter, ModelIdentity]:
        """``(adapter, identity)``: the adapter the fit goes on top of (``--adapter``, checked
        against the model; else the identity adapter) and the model's identity, read once."""
        adapter_dir = self.config.adapter
        self.model.check_adapter(adapter_dir)
        identity = self.model.identity()
        adapter = (CalibrationAdapter.from_pretrained(adapter_dir) if adapter_dir
                   else CalibrationAdapter.identity(identity))
        adapter.base_model.check_compatible(identity)
        return adapter, identity

    # ------------------------------------------------------------------------ data
    @cached_property
    def records(self) -> list:
        """The data's records (the first ``--limit``), of the kind the mode scores:
        multiple-choice records in cloze and letter mode, open-QA records in P(True) mode."""
        data = self.config.data
        if self.given is not None:
            records = list(self.given)
        elif self.score_logs:  # the model's log holds the questions it scored
            records = list(self.score_logs["model"].records)
        else:
            records = load_dataset(data)
        want, other = ((MultipleChoiceRecord, "open-QA") if self.mode.choice
                       else (OpenQARecord, "multiple-choice"))
        if records and not isinstance(records[0], want):
            need = ("post-hoc option calibration needs multiple-choice data (question, "
                    "choices, answer)" if self.mode.choice
                    else "P(True) mode needs open-QA data (question, answers)")
            raise DataError(f"{data} holds {other} records; {need}")
        limit = self.config.limit
        return records[:limit] if limit else records

    @cached_property
    def data_hash(self) -> str:
        """The hash of :attr:`records` (what an adapter and a report record of the data)."""
        return dataset_hash(self.records)

    @cached_property
    def split(self) -> tuple[np.ndarray, np.ndarray]:
        """``(calibration, test)`` indices into :attr:`records` (``calm_runtime.data.sets``'s
        seeded split; every given record is a calibration record)."""
        if self.given is not None:
            return np.arange(len(self.records)), np.arange(0)
        return split_indices(len(self.records), self.config.calibration_fraction,
                             self.config.seed)

    # ------------------------------------------------------------------------ scores
    @cached_property
    def score_logs(self) -> dict:
        """``{"model": log, "reference": log}`` read from ``--model-scores`` /
        ``--reference-scores`` (lm-eval sample logs, checked to score the same documents);
        empty when the models are run."""
        from calm_training.scoring.lm_eval_logs import log_path, paired, read_samples

        config = self.config
        if config.model_scores is None:
            return {}
        logs = {"model": read_samples(log_path(config.model_scores))}
        if config.reference_scores is not None:
            logs["reference"] = read_samples(log_path(config.reference_scores))
            paired(logs["model"], logs["reference"])
        return logs

    def log_option_scores(self, role: str):
        """The option scores of ``role`` from its lm-eval log (cut to ``--limit``), with the
        model's own tokenizer counting the continuations' tokens for the ``mean`` variant
        (nothing is run); a :class:`ConfigError` when the role has no log."""
        if role not in self.score_logs:
            raise ConfigError(f"--model-scores gives the model's scores from a log, so the "
                              f"{role}'s must come from one too: pass --{role}-scores "
                              "lm-eval:PATH (a log of the same task)")
        log = self.score_logs[role]
        tokenizer = None
        if self.variant(role) == "mean" and not self.mode.token_level:
            source = self.model if role == "model" else self.require_reference()
            tokenizer = source.tokenizer()
        scores = log.option_scores(self.mode.name, tokenizer)
        n = len(self.records)
        for name in ("values", "n_tokens", "n_chars", "labels"):
            setattr(scores, name, getattr(scores, name)[:n])
        return scores

    def option_scores(self, role: str = "model", *, adapter_dir: str | os.PathLike | None = None,
                      progress: bool = True):
        """The option scores of :attr:`records` by the model (or the reference), with
        ``adapter_dir``'s calibration applied while scoring; from the score cache when
        possible (from its lm-eval log with ``--model-scores``)."""
        from calm_training.scoring.cache import cached_option_scores

        if self.score_logs:
            if adapter_dir is not None:
                raise ConfigError("scores read from an lm-eval log cannot be re-scored with "
                                  "an adapter; fit without --adapter, or score the model "
                                  "itself")
            return self.log_option_scores(role)
        source = self.model if role == "model" else self.require_reference()
        config = self.config
        return cached_option_scores(source, self.records, mode=self.mode,
                                    adapter_dir=adapter_dir, chat=config.chat,
                                    batch_size=config.batch_size, progress=progress,
                                    max_length=config.max_length)

    def judgements(self, *, progress: bool = True) -> dict:
        """P(True) mode: the model's answers to :attr:`records`, their correctness, and each
        model's two-way P(True) logits
        (:func:`~calm_training.scoring.judgements.open_qa_judgements`; cached on disk)."""
        from calm_training.scoring.judgements import open_qa_judgements

        config = self.config
        return open_qa_judgements(self.records, self.model, self.reference,
                                  template=self.p_true_template, chat=config.chat,
                                  batch_size=config.batch_size, max_length=config.max_length,
                                  progress=progress)

    def variant(self, role: str = "model") -> str:
        """The score variant read for ``role``: the reference's own cloze variant when one
        is set, the run's otherwise (letter scores have one)."""
        config = self.config
        asked = (config.reference_variant or config.variant) if role == "reference" \
            else config.variant
        return self.mode.score_variant(asked)

    @property
    def recorded_variant(self) -> str | None:
        """The cloze variant an adapter records (``None`` in the token-level modes)."""
        return self.mode.recorded_variant(self.config.variant)
