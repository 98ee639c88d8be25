"""``calm score URL``: a served model's multiple-choice answers scored as ``calm eval``
scores them, reported as ``calm score`` reports an engine (calm's ``calm.commands`` entry
point ``score_served``; the runtime's CLI finds it there)."""

from __future__ import annotations

import dataclasses
import re

from calm_runtime import modes
from calm_runtime.data.prompts import cloze_variant_for
from calm_runtime.data.sets import MultipleChoiceRecord
from calm_runtime.errors import ConfigError, DataError
from calm_runtime.formats.artifact import CalibrationAdapter
from calm_runtime.formats.fit_record import FitRecord
from calm_runtime.measure.score import choices_report, require_labels
from calm_training.posthoc.fit_config import FitConfig
from calm_training.posthoc.plan import FitPlan
from calm_training.scoring.cache import cached_option_scores

__all__ = ["score_served"]


def score_served(args, records) -> tuple[dict, str]:
    """``calm score URL``: the served model's option scores as ``calm eval`` gets them
    (:func:`calm_training.scoring.cache.cached_option_scores`), the adapter's temperatures
    applied as ``calm eval`` applies them, and the report
    :func:`calm_runtime.measure.score.choices_report` makes for an engine; returns the
    report and the report file's name stem."""
    if records and not isinstance(records[0], MultipleChoiceRecord):
        raise ConfigError(f"{args.data} holds open-QA records; calm score scores a served "
                          "model's multiple-choice answers only; for P(True) use calm eval "
                          f"--mode p_true --model {args.engine}")
    if not records:
        raise DataError("no records to score; check the data file or split")
    require_labels(records)
    adapter = CalibrationAdapter.from_pretrained(args.adapter) if args.adapter else None
    if adapter is not None and adapter.base_model.served is None:
        raise ConfigError(f"{args.adapter} is an adapter for the local model "
                          f"{adapter.base_model.name}; a served model takes one fitted with "
                          f"calm fit --model {args.engine} (or export an engine with it)")
    record = adapter.fit_record if adapter is not None else FitRecord()
    scoring = modes.mode(args.mode)
    variant = cloze_variant_for(
        args.variant, record.cloze_variant,
        bound=not scoring.token_level and record.binds_variant,
        what=str(args.adapter), fix="drop --variant to use the recorded one, or fit an adapter "
                                    f"with calm fit --variant {args.variant}")
    config = FitConfig(model=args.engine, data=args.data, mode=args.mode, variant=variant,
                       n_bins=args.bins, chat=args.chat, model_name=args.model_name,
                       api_key_env=args.api_key_env, concurrency=args.concurrency,
                       timeout=args.timeout, max_retries=args.max_retries)
    plan = FitPlan.resolve(config)
    endpoint = plan.model.endpoint
    if adapter is not None:
        recorded_at = adapter.base_model.served
        if (recorded_at["endpoint"], recorded_at["served_model"]) != (endpoint.base_url,
                                                                      endpoint.model):
            raise ConfigError(
                f"{args.adapter} was fitted for {recorded_at['served_model']!r} at "
                f"{recorded_at['endpoint']}, not {endpoint.model!r} at {endpoint.base_url}; "
                "score the model it was fitted for, or fit one for this one")
    scores = cached_option_scores(endpoint, records, mode=plan.mode, chat=args.chat,
                                  progress=not args.quiet)
    answer_t = 1.0
    if adapter is not None:  # a served model's adapter holds temperatures only
        scores = dataclasses.replace(scores, values=adapter.calibrate(scores.values))
        answer_t = scoring.answer_temperature(adapter.answer_temperature)
    probs = modes.option_probabilities(scores.scores(plan.variant()), answer_t)
    report = choices_report([row[:len(r.choices)] for row, r in zip(probs, records, strict=True)],
                            [r.answer for r in records], mode=args.mode,
                            variant=scoring.recorded_variant(variant),
                            answer_temperature=answer_t, n_bins=args.bins)
    report.update(backend=f"served model {endpoint.model!r} at {endpoint.base_url}",
                  served_model=endpoint.model, adapter=args.adapter,
                  temperature=adapter.temperature if adapter is not None else 1.0)
    if scoring.token_level:  # letters a served model may not return
        report["floored"] = int(scores.floored or 0)
    return report, re.sub(r"[^A-Za-z0-9._-]+", "_", endpoint.model) or "served"
