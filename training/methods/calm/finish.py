"""What ``calm train`` does once the LoRA (and α, after its gate) is written: a DACA
temperature T of the trained model against a reference, gated like α, and what each part did.

The default reference is the model before the LoRA, whatever it is (a post-trained model
when the model being tuned is one, as SmolLM2-135M-Instruct is): DACA's label-free fit
needs a model that shares the questions and, for a token-level temperature, the tokenizer;
``--reference`` names another one (a pre-trained model, DACA's own premise).
:func:`fit_base_temperature` fits T as ``calm fit daca --adapter OUT --reference REF``
would, on the unlabeled calibration set the training used, with one difference that keeps
the answers: in cloze mode T is the answer temperature on the trained model's own option
scores (a temperature on option scores never changes which option wins), and the
token-level temperature is fitted and recorded but not put into the head (a head
temperature changes the per-token log-probabilities the option scores sum, and with them the
winning option on some questions; :func:`finish` counts how many). In letter mode T is the
head temperature: one logit per option, so it keeps the answers and calibrates the tokens.

:func:`finish` then reads the held-out training questions (``--holdout``, labeled, never
trained on) under each part — the model alone, the LoRA alone, the LoRA with the written α,
and with T — keeps T only when it passes the gate on the hold-out's deciding half
(calm_training.methods.calm.gate, the rule α passed), and reports the readings on the other half.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from pathlib import Path

import numpy as np

from calm_runtime.data.sets import MultipleChoiceRecord
from calm_runtime.errors import CalmError, ConfigError, FitError
from calm_runtime.formats.artifact import CalibrationAdapter
from calm_runtime.measure import metrics
from calm_runtime.modes import option_probabilities

__all__ = ["PART_NAMES", "fit_base_temperature", "measure_parts", "part_lines"]

logger = logging.getLogger(__name__)

#: the readings of :func:`measure_parts`, in the order the parts are added
PART_NAMES = ("base", "lora", "lora+alpha", "lora+alpha+T")
#: cloze mode: the written adapter with the token-level temperature in its head, read only
#: to count the answers a head temperature would change
HEAD_T = "lora+alpha+head-T"
#: ECE bins of the parts' readings (docs/methods.md §5's default)
PART_BINS = 10

#: ``method.daca`` of the adapter written before :func:`finish`: replaced by T's record when it
#: is done, so an adapter whose run stopped in between (killed, out of memory) says so
PENDING = {"fitted": False, "kept": False, "pending": True,
           "reason": "not fitted yet: calm train stopped after training, before its temperature "
                     "fit and hold-out readings; rerun the same command with --resume "
                     "--overwrite"}


def _fit_config(config, *, adapter: str | None, reference: str | None, data: str):
    from calm_training.posthoc.fit_config import FitConfig

    return FitConfig(model=config.model, reference=reference, data=data, mode=config.mode,
                     variant=config.cloze_variant, chat=config.chat, adapter=adapter,
                     batch_size=max(1, config.batch_size), bootstrap=0,
                     max_length=config.max_length, dtype=config.dtype,
                     device=config.device or "auto")


def fit_base_temperature(config, adapter_dir: str | os.PathLike, records: list, *,
                         progress: bool = True) -> tuple[CalibrationAdapter, dict]:
    """The adapter at ``adapter_dir`` with a DACA temperature against ``config.reference``
    (None: the model itself, i.e. the model before the LoRA), fitted on ``records`` (the
    unlabeled calibration set) in ``config.mode``; and the record of the fit.

    Raises :class:`~calm_runtime.errors.CalmError` when no temperature can be fitted (no
    agreement, open-QA calibration data, an optimum at a bound): the caller keeps the
    adapter as it is and says why."""
    from calm_training.methods import method_for_mode
    from calm_training.posthoc.option_fit import check_finite_temperature
    from calm_training.posthoc.plan import FitPlan

    reference = config.reference or config.model
    choice = [r for r in records if isinstance(r, MultipleChoiceRecord)]
    if len(choice) != len(records):
        raise ConfigError("the calibration set holds open-QA records, which have no options to "
                        "fit an option temperature on; fit P(True) afterwards with `calm fit "
                        "daca --mode p_true --adapter OUT`")
    plan = FitPlan.resolve(_fit_config(config, adapter=os.fspath(adapter_dir),
                                       reference=reference,
                                       data=" + ".join(config.calibration)), records=records)
    method = method_for_mode("daca", plan.mode)
    fitted = method.fit(plan, progress=progress, head_temperature=False)
    check_finite_temperature(fitted.fit)
    if fitted.fit.at_bound is not None:
        raise FitError(f"the DACA optimum is at a bound ({fitted.fit.at_bound}) on "
                        f"{fitted.fit.n_used} agreeing questions: the base carries no usable "
                        "signal there")
    base, _ = plan.base
    adapter = dataclasses.replace(base, created_at=None)
    method.write_fit(adapter, fitted, plan)
    record = {"fitted": True, "reference": ("the model before the LoRA" if config.reference is None
                                            else config.reference),
              "reference_identity": plan.reference.identity().to_dict(),
              "mode": config.mode, "variant": plan.recorded_variant,
              "n_questions": fitted.n_calibration, "data_hash": plan.data_hash,
              "fit": fitted.fit.to_dict(), "token_fit": fitted.token_record,
              "temperature": adapter.temperature,
              "answer_temperature": adapter.answer_temperature,
              "token_temperature": (fitted.token_record or {}).get("temperature"),
              "keeps_answers": True}
    adapter.kind = base.kind if base.kind.endswith("+daca") else f"{base.kind}+daca"
    adapter.method = {**base.method, "daca": record}
    adapter.validate()
    return adapter, record


def _probabilities(scores, adapter: CalibrationAdapter | None, token_level: bool):
    """Option probabilities the runtime reads from ``scores`` scored with ``adapter``: in
    cloze mode the answer temperature divides the summed scores; in letter mode every
    temperature is already in the scores (the head carries it)."""
    answer_t = None if adapter is None or token_level else adapter.answer_temperature
    return option_probabilities(scores, answer_t or 1.0)


def measure_parts(config, held: list, adapters: dict, *, progress: bool = True) -> dict:
    """Per-question readings of the labeled ``held`` questions under each of ``adapters``
    (``{name: adapter folder or None for the model alone}``, named as :data:`PART_NAMES`):
    prediction, correctness, confidence and NLL."""
    from calm_training.posthoc.plan import FitPlan

    plan = FitPlan.resolve(_fit_config(config, adapter=None, reference=None,
                                       data="the held-out training questions"),
                           records=held)
    token_level = plan.mode.token_level
    out = {"n": len(held), "parts": {}}
    for name, folder in adapters.items():
        scored = plan.option_scores(adapter_dir=folder, progress=progress)
        adapter = None if folder is None else CalibrationAdapter.from_pretrained(folder)
        probs = _probabilities(scored.scores(plan.variant()), adapter, token_level)
        labels = scored.labels
        rows = np.arange(labels.size)
        prediction = probs.argmax(axis=1)
        nll = -np.log(np.clip(probs[rows, labels], metrics.PROB_EPS, 1.0))
        out["parts"][name] = {"prediction": prediction.tolist(),
                              "correct": (prediction == labels).astype(int).tolist(),
                              "confidence": np.round(probs.max(axis=1), 6).tolist(),
                              "nll": np.round(nll, 6).tolist()}
    return out


def staged_parts(adapter: CalibrationAdapter, written: Path, final: CalibrationAdapter | None,
                 tmp: Path, token_temperature: float | None = None) -> dict:
    """The folders :func:`measure_parts` reads: the model alone, the LoRA alone (the written
    adapter with α at the identity), the written adapter, ``final`` (with T) and, given a
    cloze ``token_temperature``, ``final`` with it in the head (:data:`HEAD_T`)."""
    lora_only = dataclasses.replace(adapter, tau=np.ones_like(adapter.tau),
                                    shift=np.zeros_like(adapter.shift), created_at=None)
    lora_only.save_pretrained(tmp / "lora")
    folders = {"base": None, "lora": tmp / "lora", "lora+alpha": written}
    if final is not None:
        final.save_pretrained(tmp / "final")
        folders["lora+alpha+T"] = tmp / "final"
        if token_temperature is not None:
            head = dataclasses.replace(final, created_at=None,
                                       temperature=final.temperature * token_temperature)
            head.save_pretrained(tmp / "head")
            folders[HEAD_T] = tmp / "head"
    return folders


def summarize(readings: dict, rows: np.ndarray) -> dict:
    """Accuracy, ECE, NLL and mean confidence of each reading of :func:`measure_parts` on the
    hold-out questions ``rows`` (the reporting half)."""
    out = {}
    for name, q in readings["parts"].items():
        conf = np.asarray(q["confidence"])[rows]
        correct = np.asarray(q["correct"])[rows].astype(float)
        nll = np.asarray(q["nll"])[rows]
        out[name] = {"accuracy": float(correct.mean()),
                     "ece": float(metrics.ece(conf, correct, PART_BINS)),
                     "nll": float(nll.mean()), "mean_confidence": float(conf.mean())}
    return out


def gate_temperature(readings: dict, deciding: np.ndarray) -> dict:
    """The gate's decision on T (gate.decide_part) from the deciding half:
    the written adapter with T against without it."""
    from calm_training.methods.calm.gate import decide_part

    with_t, without = readings["parts"]["lora+alpha+T"], readings["parts"]["lora+alpha"]
    pick = lambda q, key: np.asarray(q[key])[deciding]  # noqa: E731
    return decide_part("T", pick(with_t, "nll"), pick(without, "nll"),
                       pick(with_t, "correct"), pick(without, "correct"))


def finish(config, out: Path, calibration: list, held: list | None, *,
           progress: bool = True) -> tuple[CalibrationAdapter, dict]:
    """Fit T (unless ``config.daca`` is off), read every part on ``held`` (a multiple-choice
    hold-out), keep T only if the gate does, and write the result over ``out``
    (atomically). A fit that cannot be made is recorded, not raised: the trained adapter at
    ``out`` stays valid."""
    from calm_training.methods.calm.gate import gate_halves

    written = CalibrationAdapter.from_pretrained(out)
    candidate, record = None, {"fitted": False, "reason": "--no-daca"}
    if config.daca:
        try:
            candidate, record = fit_base_temperature(config, out, calibration, progress=progress)
        except CalmError as exc:
            record = {"fitted": False, "reason": str(exc)}
            logger.warning("no DACA temperature: %s; the adapter is written without one "
                           "(add it with `calm fit daca --adapter %s`)", exc, out)
    parts = None
    choice = bool(held) and all(isinstance(r, MultipleChoiceRecord) for r in held)
    if choice:
        token_t = record.get("token_temperature") if candidate is not None else None
        with tempfile.TemporaryDirectory(prefix="calm-parts-") as tmp:
            folders = staged_parts(written, out, candidate, Path(tmp), token_t)
            readings = measure_parts(config, held, folders, progress=progress)
        deciding, reporting = gate_halves(len(held))
        parts = {"n": len(held), "deciding": int(deciding.size),
                 "reporting": int(reporting.size), "bins": PART_BINS,
                 "parts": summarize(readings, reporting if reporting.size else deciding),
                 "read_on": "reporting" if reporting.size else "deciding",
                 "questions": {name: {k: q[k] for k in ("correct", "nll")}
                               for name, q in readings["parts"].items()}}
        if HEAD_T in readings["parts"]:
            head = np.asarray(readings["parts"][HEAD_T]["prediction"])
            kept = np.asarray(readings["parts"]["lora+alpha+T"]["prediction"])
            record["head_temperature_changes"] = {"answers": int((head != kept).sum()),
                                                  "of": len(held)}
            del parts["parts"][HEAD_T]
        if candidate is not None:
            record["gate"] = gate_temperature(readings, deciding)
    elif candidate is not None:
        record["gate"] = {"kept": True, "reason": (
            "T written ungated: no multiple-choice hold-out to read it on (--holdout 0, or "
            "open-QA training questions)")}
    keep_t = candidate is not None and record["gate"]["kept"]
    if keep_t:
        result = candidate
    else:
        result = dataclasses.replace(written, created_at=None)
        result.method = {**written.method}
    result.method["daca"] = {**record, "kept": keep_t}
    if candidate is not None and not keep_t:
        logger.warning("temperature gate: %s", record["gate"]["reason"])
    if parts is not None:
        result.metrics = {**(result.metrics or {}), "holdout_parts": parts}
    result.lora_path = written.lora_path
    # save_pretrained copies the LoRA folder of ``out`` into its staging folder before the
    # staging folder replaces ``out``
    result.save_pretrained(out, overwrite=True)
    return CalibrationAdapter.from_pretrained(out), result.method["daca"]


def part_lines(record: dict, parts: dict | None) -> list[str]:
    """The last lines of ``calm train``: T, where it came from and whether the gate kept it,
    then each part on the hold-out's reporting half."""
    if record.get("fitted"):
        fit = record["fit"]
        where = (f"answer temperature {record['answer_temperature']:.4g}"
                 if record.get("answer_temperature") else "")
        token = record.get("temperature")
        head = f"token temperature {token:.4g}" if token and token != 1.0 else ""
        said = ", ".join(x for x in (head, where) if x) or f"T {fit['temperature']:.4g}"
        lines = [f"  DACA against {record['reference']}: {said}; agreement "
                 f"{fit['agreement_rate']:.3f} ({fit['n_used']} of {fit['n']} calibration "
                 "questions)"]
        changes = record.get("head_temperature_changes")
        if record.get("token_temperature") and record.get("answer_temperature"):
            lines.append(
                f"  token-level temperature {record['token_temperature']:.4g} fitted, not in "
                "the head: it would change " + (
                    f"{changes['answers']} of {changes['of']} held-out answers"
                    if changes else "some answers") + "; token confidences stay the trained "
                "model's")
        gate = record.get("gate")
        if gate:
            lines.append(f"  {gate['reason']}")
    else:
        lines = [f"  no DACA temperature: {record.get('reason')}"]
    if parts:
        lines.append(f"  held-out training questions that did not decide the gate "
                     f"(n={parts.get('reporting', parts['n'])}; accuracy / ECE / NLL):")
        for name, row in parts["parts"].items():
            lines.append(f"    {name:<13} {row['accuracy']:.3f} / {row['ece']:.3f} / "
                         f"{row['nll']:.3f}")
    return lines
