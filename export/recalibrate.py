"""ECE of the engine being built on multiple-choice data, and ``--recalibrate``.

With calibration data the staged engine answers every question through
:class:`calm_runtime.CalibratedLM` (the runtime's own scoring: same prompts, same option
tokens), once on the validated fp32 graph and once on the final variant (int8 or fp16),
and :func:`calm_runtime.measure.metrics.calibration_report` gives ECE, accuracy, NLL, ... of both.

``--recalibrate`` then refits the temperature on the final graph's own scores with
labeled temperature scaling (:func:`calm_runtime.temperature.fit_temperature_scaling`, NLL):

* cloze mode: the fit is the new ``answer_temperature`` (it acts on option scores, so
  it lives in the manifest, as in ``calm fit``);
* letter mode: the fit ``T_r`` is a token-level temperature. ``z / T_r`` is folded into
  the graph by scaling the head's constants (the bias and the weight, the weight's block
  scales when the head is blockwise int8, or the tied-scale layout's scale vector) by
  ``1 / T_r`` -- exact, as the head is affine -- and the manifest's ``temperature``
  becomes ``T * T_r`` (docs/methods.md §1). The folded engine is scored again and must give
  the old option logits divided by ``T_r`` within the validation tolerance.

The fit and the reported ECE use the same records (in-sample): the numbers show that
calibration survived quantisation on this data, not a held-out estimate.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import Counter
from pathlib import Path

import numpy as np

from calm_runtime import modes
from calm_runtime.data.prompts import cloze_variant_for
from calm_runtime.data.sets import MultipleChoiceRecord, dataset_hash, load_dataset
from calm_runtime.errors import ConfigError, DataError, ExportValidationError, FitError
from calm_runtime.measure import metrics
from calm_runtime.modes import CHOICE_MODES

from .graphs.calm_graph import ONNX_FILE

__all__ = ["CalibrationData", "CalibrationRun", "load_calibration_data", "scoring_settings",
           "head_constants", "fold_temperature", "check_calibration"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CalibrationData:
    """Labeled questions with the most common option count (others are left out)."""

    spec: str
    questions: list[str]
    options: list[list[str]]
    labels: np.ndarray
    dropped: int
    data_hash: str


@dataclasses.dataclass(frozen=True)
class CalibrationRun:
    """The data and how it is scored (``variant`` only in cloze mode)."""

    data: CalibrationData
    mode: str
    variant: str | None


def load_calibration_data(spec: str, limit: int | None = None) -> CalibrationData:
    """Read ``spec`` (any :func:`calm_runtime.data.sets.load_dataset` spec); every record needs
    an answer, and only records with the most common number of options are kept."""
    records = load_dataset(spec)
    if limit is not None:
        records = records[:limit]
    if not records or not isinstance(records[0], MultipleChoiceRecord):
        raise DataError(f"{spec} holds no multiple-choice records; calibration data needs "
                        "question, choices and answer")
    unlabeled = sum(r.answer is None for r in records)
    if unlabeled:
        raise DataError(f"{unlabeled} of {len(records)} records of {spec} have no answer; ECE "
                        "and --recalibrate need an answer index on every record")
    k = Counter(len(r.choices) for r in records).most_common(1)[0][0]
    kept = [r for r in records if len(r.choices) == k]
    if len(kept) < 2:
        raise DataError(f"{spec} has {len(kept)} usable record(s); pass at least 2")
    if len(kept) < len(records):
        logger.info("%d of %d records of %s have other than %d options; left out",
                    len(records) - len(kept), len(records), spec, k)
    return CalibrationData(spec=spec, questions=[r.question for r in kept],
                           options=[list(r.choices) for r in kept],
                           labels=np.array([r.answer for r in kept], dtype=np.int64),
                           dropped=len(records) - len(kept), data_hash=dataset_hash(kept))


def scoring_settings(config, adapter) -> tuple[str, str | None]:
    """``(mode, cloze variant)``: the config's, else the adapter's fit, else cloze / "mean"."""
    record = adapter.fit_record
    mode = config.calibration_mode or (record.mode if record.mode in CHOICE_MODES else "cloze")
    if modes.mode(mode).token_level:  # letter: no cloze variant
        return mode, None
    variant = cloze_variant_for(
        config.calibration_variant, record.cloze_variant,
        bound=record.binds_variant and not config.recalibrate,
        what="the adapter", fix="drop --calibration-variant or pass --recalibrate to refit it")
    return mode, variant


# ---------------------------------------------------------------------- the head's constants
def head_constants(model) -> list[str]:
    """Names of the initializers that scale the logits linearly when multiplied by a factor.

    Walks back from ``logits`` through Cast/Identity: an ``Add`` with one constant (the
    bias), then a ``MatMul`` with a constant weight (read directly or through a Transpose,
    which a scale passes through unchanged), a ``MatMulNBits`` (its block scales)
    or a ``Mul`` with one constant (the tied-scale layout). Raises :class:`ConfigError`
    when the head has another form (e.g. a dynamically quantised head).
    """
    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    constants = {i.name for i in graph.initializer}
    uses = Counter(name for node in graph.node for name in node.input)
    node, targets = producers.get("logits"), []
    while node is not None and node.op_type in ("Cast", "Identity"):
        node = producers.get(node.input[0])
    if node is not None and node.op_type == "Add":
        const = [i for i in node.input if i in constants]
        other = [i for i in node.input if i not in constants]
        if len(const) == 1 and len(other) == 1:
            targets.append(const[0])
            node = producers.get(other[0])
        else:
            node = None
    weight = node.input[1] if node is not None and node.op_type == "MatMul" else ""
    while weight in producers and producers[weight].op_type in ("Transpose", "Identity"):
        weight = producers[weight].input[0]  # a weight laid out by the exporter (scales alike)
    if weight in constants:
        targets.append(weight)
    elif node is not None and node.op_type == "MatMulNBits" and node.input[2] in constants:
        targets.append(node.input[2])
    elif node is not None and node.op_type == "Mul" and sum(i in constants
                                                            for i in node.input) == 1:
        targets.append(next(i for i in node.input if i in constants))
    else:
        what = "no node" if node is None else f"a {node.op_type} node"
        raise ConfigError(f"cannot fold a temperature into this graph's head ({what} where an "
                          "affine head was expected); keep 'lm_head' in fp32 (--int8-exclude "
                          "lm_head) "
                          "or recalibrate in cloze mode")
    shared = [t for t in targets if uses[t] > 1]
    if shared:
        raise ConfigError(f"the head's constant {shared[0]!r} is shared with other nodes; "
                          "export with --head-layout untied to recalibrate in letter mode")
    return targets


def fold_temperature(path: Path, factor: float, *, external: bool) -> list[str]:
    """Multiply the head's constants by ``factor`` in the graph at ``path`` (in place)."""
    import onnx
    from onnx import numpy_helper

    from .graphs.calm_graph import save_onnx

    model = onnx.load(str(path), load_external_data=True)
    targets = head_constants(model)
    for init in model.graph.initializer:
        if init.name in targets:
            array = numpy_helper.to_array(init)
            scaled = (array.astype(np.float64) * factor).astype(array.dtype)
            init.CopyFrom(numpy_helper.from_array(scaled, init.name))
    save_onnx(model, path, external)
    return targets


# ---------------------------------------------------------------------- scoring
def _lm(manifest, model_root: Path | None = None):
    """A CalibratedLM on the staged engine (the graph from ``model_root`` when given)."""
    from calm_runtime.inference.backends import create_backend
    from calm_runtime.inference.lm import CalibratedLM
    from calm_runtime.inference.tokenization import EngineTokenizer

    view = manifest if model_root is None else dataclasses.replace(manifest, root=model_root)
    return CalibratedLM(manifest, create_backend("onnxruntime", view), EngineTokenizer(manifest))


def _answer(lm, data: CalibrationData, mode: str, variant: str | None):
    """Option scores ``[N, K]`` (before answer_temperature) and probabilities ``[N, K]``."""
    try:
        choices = lm.choose_batch(data.questions, data.options, mode, variant=variant)
    finally:
        lm.close()
    return (np.stack([c.scores for c in choices]), np.stack([c.probabilities for c in choices]))


def check_calibration(manifest, config, run: CalibrationRun, *, fp32_root: Path | None,
                      variant_name: str, external: bool,
                      tolerance) -> tuple[dict, dict, str | None]:
    """ECE of the fp32 and the final graph on ``run``'s data, and the refit.

    ``manifest`` is the staged engine's (root: the staging folder, graph: the final one);
    ``fp32_root`` holds the validated fp32 graph when the final one is a variant.
    ``tolerance(scale)`` bounds the folded head's logit error. Returns ``(calibration
    section updates, report for the manifest's export section, cloze variant or None)``.
    """
    import onnx

    from calm_runtime.temperature import fit_temperature_scaling

    data, mode, variant = run.data, run.mode, run.variant
    fused = modes.mode(mode).token_level  # letter: the refitted temperature goes into the head
    if config.recalibrate and fused:  # fail before scoring if it cannot be folded
        head_constants(onnx.load(str(manifest.path(ONNX_FILE)), load_external_data=False))
    report = {"data": data.spec, "data_hash": data.data_hash, "n": int(data.labels.size),
              "n_options": len(data.options[0]), "dropped": data.dropped, "mode": mode,
              "variant": variant, "n_bins": config.n_bins, "in_sample": config.recalibrate}

    def metrics_of(probs):
        return metrics.calibration_report(probs, data.labels, config.n_bins)

    if fp32_root is not None:
        report["fp32"] = metrics_of(_answer(_lm(manifest, fp32_root), data, mode, variant)[1])
    scores, probs = _answer(_lm(manifest), data, mode, variant)
    report[variant_name] = metrics_of(probs)
    if not config.recalibrate:
        return {}, report, None
    fit = fit_temperature_scaling(scores, data.labels)
    if fit.at_bound is not None or not math.isfinite(fit.temperature):
        raise FitError(f"the recalibration temperature is at a bound ({fit.at_bound}) on "
                       f"{data.labels.size} questions: the engine's scores carry no signal "
                       "there; use more or other data; no engine was written")
    calibration = manifest.calibration
    if not fused:  # cloze: the answer temperature
        before = calibration["answer_temperature"]
        updates = {"answer_temperature": fit.temperature}
        after_probs = modes.option_probabilities(scores, fit.temperature)
        note = (f"answer_temperature refitted on the {variant_name} engine's {variant!r} cloze "
                f"scores of {data.spec} (was {'none' if before is None else f'{before:.6g}'})")
        folded = []
    else:
        before = calibration["temperature"]
        updates = {"temperature": before * fit.temperature}
        folded = fold_temperature(manifest.path(ONNX_FILE), 1.0 / fit.temperature,
                                  external=external)
        new_scores, after_probs = _answer(_lm(manifest), data, mode, variant)
        expected = scores / fit.temperature
        worst = float(np.abs(new_scores - expected).max())
        allowed = tolerance(float(np.abs(expected).max()))
        if not worst <= allowed:
            raise ExportValidationError(f"the head with the folded temperature gives option "
                                        f"logits {worst:.3g} away from the expected ones "
                                        f"(tolerance {allowed:.3g}); no engine was written")
        report["fold_max_abs_diff"] = worst
        note = (f"token-level temperature multiplied by {fit.temperature:.6g}, refitted on the "
                f"{variant_name} engine's letter logits of {data.spec} and folded into the "
                "head")
    report["recalibrated"] = metrics_of(after_probs)
    report["recalibration"] = {"parameter": next(iter(updates)), "before": before,
                               "after": next(iter(updates.values())), "fit": fit.to_dict(),
                               "folded_into": folded, "note": note}
    logger.info("recalibrated: %s; ECE %.4f -> %.4f", note, report[variant_name]["ece"],
                report["recalibrated"]["ece"])
    return updates, report, variant
