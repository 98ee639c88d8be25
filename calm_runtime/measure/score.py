"""Score a data set with an engine: calibration metrics of its confidences (``calm score``).

* Multiple-choice records: :meth:`CalibratedLM.choose_batch` (letter or cloze mode) gives
  option probabilities; :func:`calm_runtime.measure.metrics.calibration_report` on the labels.
* Open-QA records: the engine answers each question greedily (``"Question: ...\\nAnswer:"``,
  cut at the first newline); an answer is correct when it matches an alias after SQuAD
  normalisation; P(True) of the answer and the answer's sequence confidence are each
  reported with :func:`calm_runtime.measure.metrics.binary_report`.

A served model (``calm score URL``, an OpenAI-compatible API) is scored by
``calm_training.scoring.served`` with the same prompts; :func:`choices_report` builds its
report from the option probabilities, with the same keys as an engine's.

Records without a label are refused (metrics need labels).
"""

from __future__ import annotations

import json
import os
import re
import string
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from calm_runtime import modes
from calm_runtime.data.prompts import cloze_context
from calm_runtime.data.sets import MultipleChoiceRecord, Record
from calm_runtime.errors import ConfigError, DataError
from calm_runtime.files import show_name
from calm_runtime.measure import metrics

__all__ = ["score_records", "choices_report", "require_labels", "format_report", "write_report",
           "normalize_answer", "is_correct"]


#: records scored between two progress updates (each a whole choose_batch call)
PROGRESS_CHUNK = 64


def score_records(lm, records: Sequence[Record], *, mode: str = "cloze",
                  variant: str | None = None, chat: bool | None = None, n_bins: int = 10,
                  batch_size: int = 8, max_new_tokens: int = 24,
                  progress: bool = False) -> dict:
    """Metrics of ``lm``'s calibrated confidences on ``records`` (see the module docstring);
    ``progress``: a bar on a terminal, else a log line each tenth of the questions."""
    if not records:
        raise DataError("no records to score; check the data file or split")
    if isinstance(records[0], MultipleChoiceRecord):
        return _score_choices(lm, records, mode, variant, chat, n_bins, batch_size, progress)
    return _score_open_qa(lm, records, chat, n_bins, batch_size, max_new_tokens)


def _score_choices(lm, records, mode, variant, chat, n_bins, batch_size, progress) -> dict:
    from calm_runtime.progress import progress as progress_bar

    require_labels(records)
    choices = []
    bar = progress_bar(total=len(records), desc=f"{mode} scoring", unit="question",
                       bar=progress)
    for start in range(0, len(records), PROGRESS_CHUNK):
        part = records[start:start + PROGRESS_CHUNK]
        choices += lm.choose_batch([r.question for r in part], [r.choices for r in part],
                                   mode, variant=variant, chat=chat, batch_size=batch_size)
        bar.update(len(part))
    bar.close()
    report = choices_report([c.probabilities for c in choices], [r.answer for r in records],
                            mode=mode, variant=choices[0].variant,
                            answer_temperature=choices[0].answer_temperature, n_bins=n_bins)
    report["calibrated_by"] = choices[0].calibrated_by  # what calibrates these probabilities
    return report


def require_labels(records: Sequence[MultipleChoiceRecord]) -> None:
    """Raise :class:`DataError` unless every record has an answer (metrics need labels)."""
    unlabeled = sum(r.answer is None for r in records)
    if unlabeled:
        raise DataError(f"{unlabeled} of {len(records)} records have no answer; scoring needs "
                        "labels (add 'answer' to every record)")


def choices_report(probabilities: Sequence[np.ndarray], labels: Sequence[int], *, mode: str,
                   variant: str | None, answer_temperature: float, n_bins: int = 10) -> dict:
    """The multiple-choice report of ``calm score`` from each record's option probabilities
    (an engine's or a served model's): metrics over the records with the most common number
    of options, a prediction row for every record."""
    labels = np.asarray(labels)
    sizes = [len(p) for p in probabilities]
    k = int(np.bincount(sizes).argmax())
    same = [i for i, size in enumerate(sizes) if size == k]
    probs = np.stack([np.asarray(probabilities[i], dtype=np.float64) for i in same])
    report = metrics.calibration_report(probs, labels[same], n_bins)
    predictions = []
    for p, y in zip(probabilities, labels, strict=True):
        best = int(np.argmax(p))
        predictions.append({"prediction": best, "confidence": float(p[best]), "label": int(y)})
    return {"kind": "multiple_choice", "mode": mode, "variant": variant,
            "answer_temperature": answer_temperature, "n_options": k,
            "n_skipped": len(probabilities) - len(same), "metrics": report,
            "predictions": predictions}


def _score_open_qa(lm, records, chat, n_bins, batch_size, max_new_tokens) -> dict:
    questions = [r.question for r in records]
    generations = lm.generate([cloze_context(q) for q in questions],
                              max_new_tokens=max_new_tokens, stop="\n", batch_size=batch_size)
    answers = [g.text.strip().split("\n")[0].strip() for g in generations]
    correct = np.array([is_correct(a, r.answers) for a, r in zip(answers, records, strict=True)],
                       dtype=np.int64)
    p_true = lm.p_true_batch(questions, answers, chat=chat, batch_size=batch_size)
    sequence = np.array([g.sequence_confidence for g in generations])
    return {"kind": "open_qa", "template": lm.manifest.p_true().name,
            "answer_accuracy": float(correct.mean()),
            "metrics": {"p_true": metrics.binary_report(p_true, correct, n_bins),
                        "sequence_confidence": metrics.binary_report(sequence, correct, n_bins)},
            "predictions": [{"answer": a, "correct": bool(c), "p_true": float(p),
                             "sequence_confidence": float(s)}
                            for a, c, p, s in zip(answers, correct, p_true, sequence,
                                                  strict=True)]}


def format_report(report: dict) -> str:
    """A one-screen Markdown summary (the same columns as ``calm eval``)."""
    head = f"{report['engine']} on {report['data']} ({report['split']} split"
    rows = []
    if report["kind"] == "multiple_choice":
        head += f", {report['mode']}"
        if not modes.mode(report["mode"]).token_level:  # a cloze variant and T_ans
            head += f", {report['variant']} scores, T_ans={report['answer_temperature']:.3f}"
        if "served_model" in report:  # a served model (calm score URL)
            name = "served model + adapter" if report.get("adapter") else "served model"
        elif "calibrated_by" in report and report["calibrated_by"] is None:
            name = "engine (uncalibrated)"  # its option probabilities are the model's own
        else:
            name = "calibrated engine"
        rows.append((name, report["metrics"]))
    else:
        head += f", P(True) template {report['template']}"
        head += f"; answer accuracy {report['answer_accuracy']:.3f}"
        rows += [("P(True)", report["metrics"]["p_true"]),
                 ("sequence confidence", report["metrics"]["sequence_confidence"])]
    first = rows[0][1]
    head += f"), n={first['n']}, {first['n_bins']} bins; backend {report['backend']}"
    if report.get("floored") is not None:
        head += (f"; {report['floored']} of {len(report['predictions'])} questions with an "
                 "option letter at the floor (an upper bound)")
    lines = [head, "", "| confidence | acc | ECE | MCE | AECE | Brier | NLL |",
             "|---|---|---|---|---|---|---|"]
    for name, row in rows:
        lines.append(f"| {name} | {row['accuracy']:.3f} | {row['ece']:.3f} | {row['mce']:.3f} "
                     f"| {row['aece']:.3f} | {row['brier']:.3f} | {row['nll']:.3f} |")
    return "\n".join(lines)


def check_report_path(path: str | os.PathLike) -> Path:
    """``path`` as a report file, or a one-line :class:`ConfigError` (a directory, the root,
    a name the file system cannot take); checked before any work is done."""
    path = Path(path)
    if not path.name or path.is_dir():
        raise ConfigError(f"--out {show_name(str(path))} is a directory; pass a file name such "
                          "as report.json")
    try:
        str(path).encode("utf-8")  # a non-UTF-8 name (surrogate escapes) breaks the writers
    except UnicodeError:
        raise ConfigError(f"--out {show_name(str(path))} is not a valid file name here; pass "
                          "another") from None
    return path


def write_report(report: dict, path: str | os.PathLike) -> Path:
    """Write the report as JSON (atomically: a temporary sibling, then a rename; the
    temporary file never outlives a failure)."""
    path = check_report_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(report, indent=2, sort_keys=True, allow_nan=False) + "\n",
                       encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD/TriviaQA normalisation: lower case, drop punctuation and articles, squeeze spaces.

    The one definition of answer correctness, used by training (``calm fit``/``calm eval``
    in P(True) mode) and by ``calm score`` alike."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def is_correct(prediction: str, aliases: Sequence[str]) -> bool:
    """The normalised prediction equals an alias or contains one as a whole-word phrase."""
    pred = normalize_answer(prediction)
    if not pred:
        return False
    padded = f" {pred} "
    return any((norm := normalize_answer(a)) and (norm == pred or f" {norm} " in padded)
               for a in aliases)
