"""`calm eval`: vanilla vs calibrated on the held-out split, with reports and diagrams."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import numpy as np

from calm_runtime.data.prompts import cloze_variant_for
from calm_runtime.errors import ConfigError
from calm_runtime.formats.artifact import CalibrationAdapter
from calm_runtime.measure.plot import write_reliability_diagram, write_risk_coverage
from calm_runtime.modes import option_probabilities
from calm_training.posthoc.fit_config import FitConfig
from calm_training.posthoc.option_fit import metric_row, require_labels
from calm_training.posthoc.plan import FitPlan
from calm_training.scoring.option_scores import OptionScores

__all__ = ["evaluate_adapter", "write_report"]

logger = logging.getLogger(__name__)


def evaluate_adapter(config: FitConfig, adapter_dir: str | os.PathLike, *,
                     progress: bool = True) -> dict:
    """Metrics of the model without and with the adapter on the test split.

    Token-level calibration and LoRA are applied while scoring (as an exported engine
    would); ``answer_temperature`` then scales the option scores in cloze mode.
    """
    adapter = CalibrationAdapter.from_pretrained(adapter_dir)
    scoring = config.scoring_mode
    if not scoring.choice:
        raise ConfigError("calm eval --adapter evaluates multiple-choice answers (cloze or "
                          "letter mode); for P(True) use calm eval --compare --mode p_true")
    if not scoring.token_level:  # the recorded variant or a one-line error, never a switch
        cloze_variant_for(config.variant, adapter.fit_record.cloze_variant,
                          bound=adapter.fit_record.binds_variant, what=str(adapter_dir),
                          fix=f"evaluate with variant {adapter.cloze_variant!r} (calm eval "
                              "does when --variant is not given)")
    base_config = FitConfig(**{**config.to_dict(), "adapter": None})
    plan = FitPlan.resolve(base_config)
    vanilla = plan.option_scores(progress=progress)
    if plan.model.served:  # a served model's adapter holds temperatures only
        calibrated = dataclasses.replace(vanilla, values=vanilla.values / adapter.temperature)
    else:
        calibrated = plan.option_scores(adapter_dir=adapter_dir, progress=progress)
    _, test = plan.split
    k = int(np.bincount(vanilla.n_options).argmax())
    test = test[vanilla.n_options[test] == k]
    answer_t = scoring.answer_temperature(adapter.answer_temperature)
    rows, panels = {}, {}
    for name, scores, temperature in (("vanilla", vanilla, 1.0),
                                      (adapter.kind, calibrated, answer_t)):
        probs = option_probabilities(scores.scores(plan.variant())[test, :k], temperature)
        rows[name], panels[name] = metric_row(probs, _labels(scores, test), plan.metrics)
    rows[adapter.kind]["fit"] = _applied(adapter, scoring)
    return {"config": base_config.to_dict() | {"adapter": config.adapter},
            "adapter": str(adapter_dir),
            "adapter_kind": adapter.kind, "n_test": int(test.size), "n_options": k,
            # the adapter's own fit size (what it was fitted on, as it records it)
            "n_calibration": (adapter.provenance.get("split") or {}).get("n"),
            "calibrated_outputs": adapter.calibrated_outputs(),
            "methods": rows, "_panels": panels}


def _applied(adapter: CalibrationAdapter, scoring) -> dict:
    """What the adapter's row applies, for the table's T column: the cloze answer temperature
    where the adapter has one (cloze mode), else the token-level temperature the scores were
    read with; ``alpha`` where per-token τ or shift are applied too."""
    alpha = adapter.has_alpha()
    if not scoring.token_level and adapter.answer_temperature is not None:
        temperature = scoring.answer_temperature(adapter.answer_temperature)
        if adapter.has_token_calibration():
            return {"temperature": temperature, "token_temperature": adapter.temperature,
                    "alpha": alpha}
        return {"temperature": temperature}
    return {"temperature": adapter.temperature, "alpha": alpha}


def _labels(scores: OptionScores, test: np.ndarray) -> np.ndarray:
    return require_labels(scores.labels[test], "test")


def write_report(report: dict, out_dir: str | os.PathLike, stem: str,
                 diagram: bool = True) -> dict[str, Path]:
    """Write ``{stem}.json`` (and ``{stem}.png``, the reliability diagrams) into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    panels = report.get("_panels", {})
    payload = {k: v for k, v in report.items() if k != "_panels"}
    written = {}
    json_path = out / f"{stem}.json"
    tmp = json_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, allow_nan=False) + "\n")
    os.replace(tmp, json_path)
    written["json"] = json_path
    if diagram and panels:
        cfg = report["config"]
        title = f"{cfg['model']} on {cfg['data']} ({cfg['mode']}), test split"
        written["png"] = write_reliability_diagram(out / f"{stem}.png", panels,
                                                   n_bins=cfg["n_bins"], title=title)
        written["risk_coverage_png"] = write_risk_coverage(out / f"{stem}-risk-coverage.png",
                                                           panels, title=title)
    return written
