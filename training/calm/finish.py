"""What ``calm train`` does once the LoRA (and α, after its gate) is written: a DACA
temperature of the trained model against its own base, and what each part did.

A LoRA fine-tune of a model is DACA's own regime (docs/methods.md §3): the model before the
LoRA is a reference with the same tokenizer, and a label-free temperature fitted on the
questions where the two agree undoes the confidence the fine-tune added.
:func:`fit_base_temperature` fits it exactly as ``calm fit daca --adapter OUT --reference
BASE`` would — the same scorers, the same token-level fit in cloze mode, the same place in
the adapter — on the unlabeled calibration set the training used, so that ``calm-export``
fuses LoRA, α and T in one step.

:func:`measure_parts` then reads the held-out training questions (``--alpha-holdout``,
labeled, never trained on) four times — the base model, the LoRA alone, the LoRA with the
written α, and the written adapter with T — so the manifest and the command's last lines say
what each part did there (accuracy, ECE, NLL), with the number of questions they rest on.
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
#: ECE bins of the parts' readings (docs/methods.md §5's default)
PART_BINS = 10


def _fit_config(config, *, adapter: str | None, reference: str | None, data: str):
    from calm_training.posthoc.fit_config import FitConfig

    return FitConfig(model=config.model, reference=reference, data=data, mode=config.mode,
                     variant=config.cloze_variant, chat=config.chat, adapter=adapter,
                     batch_size=max(1, config.batch_size), bootstrap=0,
                     max_length=config.max_length)


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
    fitted = method.fit(plan, progress=progress)
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
              "answer_temperature": adapter.answer_temperature}
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
    """Accuracy, ECE, NLL and mean confidence of the labeled ``held`` questions under each of
    ``adapters`` (``{name: adapter folder or None for the model alone}``, named as
    :data:`PART_NAMES`), and the per-question correctness and NLL each reading rests on."""
    from calm_training.posthoc.plan import FitPlan

    plan = FitPlan.resolve(_fit_config(config, adapter=None, reference=None,
                                       data="the held-out training questions"),
                           records=held)
    token_level = plan.mode.token_level
    out = {"n": len(held), "bins": PART_BINS, "parts": {}}
    for name, folder in adapters.items():
        scored = plan.option_scores(adapter_dir=folder, progress=progress)
        adapter = None if folder is None else CalibrationAdapter.from_pretrained(folder)
        probs = _probabilities(scored.scores(plan.variant()), adapter, token_level)
        labels = scored.labels
        rows = np.arange(labels.size)
        conf = probs.max(axis=1)
        correct = probs.argmax(axis=1) == labels
        nll = -np.log(np.clip(probs[rows, labels], metrics.PROB_EPS, 1.0))
        out["parts"][name] = {
            "accuracy": float(correct.mean()),
            "ece": float(metrics.ece(conf, correct.astype(float), PART_BINS)),
            "nll": float(nll.mean()), "mean_confidence": float(conf.mean()),
            "questions": {"correct": correct.astype(int).tolist(),
                          "nll": np.round(nll, 6).tolist()}}
    return out


def staged_parts(adapter: CalibrationAdapter, written: Path, final: CalibrationAdapter | None,
                 tmp: Path) -> dict:
    """The folders :func:`measure_parts` reads: the model alone, the LoRA alone (the written
    adapter with α at the identity), the written adapter, and ``final`` (with T)."""
    lora_only = dataclasses.replace(adapter, tau=np.ones_like(adapter.tau),
                                    shift=np.zeros_like(adapter.shift), created_at=None)
    lora_only.save_pretrained(tmp / "lora")
    folders = {"base": None, "lora": tmp / "lora", "lora+alpha": written}
    if final is not None:
        final.save_pretrained(tmp / "final")
        folders["lora+alpha+T"] = tmp / "final"
    return folders


def finish(config, out: Path, calibration: list, held: list | None, *,
           progress: bool = True) -> tuple[CalibrationAdapter, dict]:
    """Fit T (unless ``config.daca`` is off), measure the parts on ``held`` (when there is a
    multiple-choice hold-out), and write the result over ``out`` (atomically). A fit that
    cannot be made is recorded, not raised: the trained adapter at ``out`` stays valid."""
    written = CalibrationAdapter.from_pretrained(out)
    final, record = None, {"fitted": False, "reason": "--no-daca"}
    if config.daca:
        try:
            final, record = fit_base_temperature(config, out, calibration, progress=progress)
        except CalmError as exc:
            record = {"fitted": False, "reason": str(exc)}
            logger.warning("no DACA temperature: %s; the adapter is written without one "
                           "(add it with `calm fit daca --adapter %s`)", exc, out)
    parts = None
    if held and all(isinstance(r, MultipleChoiceRecord) for r in held):
        with tempfile.TemporaryDirectory(prefix="calm-parts-") as tmp:
            folders = staged_parts(written, out, final, Path(tmp))
            parts = measure_parts(config, held, folders, progress=progress)
    result = final if final is not None else dataclasses.replace(written, created_at=None)
    if final is None:
        result.method = {**written.method, "daca": record}
    if parts is not None:
        result.metrics = {**(result.metrics or {}), "holdout_parts": parts}
    result.lora_path = written.lora_path
    # save_pretrained copies the LoRA folder of ``out`` into its staging folder before the
    # staging folder replaces ``out``
    result.save_pretrained(out, overwrite=True)
    return CalibrationAdapter.from_pretrained(out), record


def part_lines(record: dict, parts: dict | None) -> list[str]:
    """The last lines of ``calm train``: T and where it came from, then each part on the
    hold-out."""
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
    else:
        lines = [f"  no DACA temperature: {record.get('reason')}"]
    if parts:
        lines.append(f"  held-out training questions (n={parts['n']}; accuracy / ECE / NLL):")
        for name, row in parts["parts"].items():
            lines.append(f"    {name:<13} {row['accuracy']:.3f} / {row['ece']:.3f} / "
                         f"{row['nll']:.3f}")
    return lines
