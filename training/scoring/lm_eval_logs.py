"""Option scores from the sample logs lm-evaluation-harness already wrote.

``lm_eval --log_samples`` writes one ``samples_<task>_<date>.jsonl`` per task: a line per
document with its ``doc_id``, the ``doc`` itself, the ``target`` (the gold option's index,
as a string in ``multiple_choice`` tasks), the ``arguments`` (the context and each option's
continuation) and ``filtered_resps`` (one ``[loglikelihood, is_greedy]`` pair per option,
both as strings), with a ``doc_hash``. A ``multiple_choice`` task's log-likelihoods are the
sums calm's cloze scorer computes for ``" {option}"`` after the context (docs/methods.md §2),
so :func:`read_samples` turns a log into calm's :class:`~calm_training.scoring.local.OptionScores`
(``sum``; ``mean`` with a tokenizer to count each continuation's tokens, ``char`` from the
continuation's text) and the records they belong to, and :func:`paired` checks that a model's
and a reference's logs score the same documents. ``calm fit`` / ``calm eval`` read them with
``--model-scores lm-eval:PATH`` and ``--reference-scores lm-eval:PATH``.

Everything a log could hold wrong is one :class:`~calm_runtime.errors.DataError` line: a
file over :data:`MAX_LOG_BYTES`, a line that is not a JSON object, a ``generate_until`` or
``loglikelihood_rolling`` task, a non-finite or non-numeric log-likelihood, a target outside
the options, two logs of different documents.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from calm_runtime.data.prompts import option_char_count
from calm_runtime.data.sets import MultipleChoiceRecord
from calm_runtime.errors import DataError
from calm_runtime.files import show_name

__all__ = ["LOG_PREFIX", "MAX_LOG_BYTES", "LmEvalLog", "cloze_task", "is_log_spec", "log_path",
           "paired", "read_samples"]

#: how a score source names an lm-eval sample log: ``lm-eval:PATH``
LOG_PREFIX = "lm-eval:"
#: the largest sample log read (a 14k-question MMLU log is ~60 MB)
MAX_LOG_BYTES = 1 << 30
#: the longest line read (one document, its arguments and responses)
MAX_LINE_BYTES = 16 << 20


#: an lm-eval ``multiple_choice`` task over calm's JSONL (question, choices, answer) whose
#: prompt is calm's cloze prompt, so that its log-likelihoods are calm's ``sum`` scores
CLOZE_TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def cloze_task(name: str, data: str | os.PathLike) -> str:
    """The YAML of an lm-eval task ``name`` that scores calm's JSONL file ``data`` with calm's
    cloze prompt (pass its folder to ``lm_eval --include_path``)."""
    return CLOZE_TASK.format(name=name, data=data)


def is_log_spec(spec) -> bool:
    return isinstance(spec, str) and spec.startswith(LOG_PREFIX)


def log_path(spec: str) -> Path:
    path = Path(spec[len(LOG_PREFIX):]) if is_log_spec(spec) else Path(spec)
    if not str(path):
        raise DataError(f"{spec!r} names no file; pass lm-eval:PATH to a samples_*.jsonl log")
    return path


@dataclass
class LmEvalLog:
    """One sample log read: the records (context as the question, continuations as the
    options), their summed log-likelihoods ``[N, K_max]`` (NaN where a document has fewer
    options), the documents' ids and hashes, the file's sha256."""

    path: Path
    sha256: str
    records: list
    sums: np.ndarray
    doc_ids: list
    doc_hashes: list

    def record(self) -> dict:
        """What an adapter records of the log."""
        return {"file": self.path.name, "sha256": self.sha256, "n": len(self.records)}

    def option_scores(self, mode: str, tokenizer=None):
        """calm's :class:`~calm_training.scoring.local.OptionScores` of the log: the sums
        (cloze; ``n_tokens`` counted with ``tokenizer`` when given, else 1, and the ``mean``
        variant refused by :func:`require_token_counts`), or in letter mode the options'
        log-probabilities (a softmax over them is the letters' restricted softmax)."""
        from calm_training.scoring.local import OptionScores

        scores = OptionScores.empty(self.records, mode)
        scores.values = self.sums.copy()
        for row, record in enumerate(self.records):
            for k, option in enumerate(record.choices):
                scores.n_chars[row, k] = option_char_count(option)
                if tokenizer is not None:
                    ids = tokenizer(option, add_special_tokens=False)["input_ids"]
                    scores.n_tokens[row, k] = max(len(ids), 1)
        return scores


def _fail(path: Path, what: str) -> None:
    raise DataError(f"{show_name(str(path))}: {what}; pass a samples_*.jsonl that lm_eval "
                    "--log_samples wrote for a multiple_choice task")


def _pairs(arguments) -> list:
    """``[(context, continuation), ...]`` of a line's ``arguments`` (lm-eval writes a dict of
    ``gen_args_i: {arg_0, arg_1}``; older versions a list of lists)."""
    if isinstance(arguments, dict):
        items = [arguments[k] for k in sorted(arguments, key=lambda k: int(
            "".join(c for c in k if c.isdigit()) or 0))]
        return [tuple(v.get(f"arg_{i}") for i in range(len(v))) if isinstance(v, dict)
                else tuple(v) for v in items]
    if isinstance(arguments, list):
        return [tuple(v) if isinstance(v, list | tuple) else (v,) for v in arguments]
    return []


def read_samples(path: str | os.PathLike) -> LmEvalLog:
    """Read one lm-eval sample log of a ``multiple_choice`` task (see the module's
    docstring); one :class:`DataError` line on anything else."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise DataError(f"cannot read {show_name(str(path))} ({exc.strerror or exc}); check "
                        "the path") from None
    if not path.is_file():
        _fail(path, "not a regular file")
    if size > MAX_LOG_BYTES:
        _fail(path, f"{size:,} bytes, more than the {MAX_LOG_BYTES:,} read")
    digest = hashlib.sha256()
    records, sums, doc_ids, doc_hashes = [], [], [], []
    with open(path, "rb") as handle:
        for number, raw in enumerate(iter(lambda: handle.readline(MAX_LINE_BYTES + 1), b""), 1):
            digest.update(raw)
            if len(raw) > MAX_LINE_BYTES:
                _fail(path, f"line {number} is longer than {MAX_LINE_BYTES:,} bytes")
            if not raw.strip():
                continue
            try:
                line = json.loads(raw)
            except (ValueError, RecursionError):
                _fail(path, f"line {number} is not JSON")
            if not isinstance(line, dict):
                _fail(path, f"line {number} is not a JSON object")
            record, values = _line(path, number, line)
            records.append(record)
            sums.append(values)
            doc_ids.append(line.get("doc_id"))
            doc_hashes.append(line.get("doc_hash"))
    if not records:
        _fail(path, "no documents")
    table = np.full((len(sums), max(len(v) for v in sums)), np.nan)
    for row, values in enumerate(sums):
        table[row, :len(values)] = values
    return LmEvalLog(path=path, sha256=digest.hexdigest(), records=records, sums=table,
                     doc_ids=doc_ids, doc_hashes=doc_hashes)


def _line(path: Path, number: int, line: dict):
    where = f"line {number} (doc_id {line.get('doc_id')!r})"
    pairs = _pairs(line.get("arguments"))
    if not pairs:
        _fail(path, f"{where} has no arguments")
    if any(len(p) != 2 or not all(isinstance(x, str) for x in p) for p in pairs):
        kind = ("generate_until" if any(len(p) == 2 and isinstance(p[1], dict) for p in pairs)
                else "loglikelihood_rolling" if all(len(p) == 1 for p in pairs)
                else "another")
        _fail(path, f"{where} is a {kind} task's (its arguments are not context and "
                    "continuation pairs); calm reads multiple_choice logs only")
    responses = line.get("filtered_resps")
    if not isinstance(responses, list) or len(responses) != len(pairs):
        _fail(path, f"{where} has {len(pairs)} options but "
                    f"{len(responses) if isinstance(responses, list) else 'no'} responses")
    values = []
    for k, response in enumerate(responses):
        first = response[0] if isinstance(response, list | tuple) and response else response
        try:
            value = float(first)
        except (TypeError, ValueError):
            _fail(path, f"{where}: option {k}'s response {first!r} is not a log-likelihood")
        if not math.isfinite(value) or value > 1e-6:
            _fail(path, f"{where}: option {k}'s log-likelihood {value} is not a finite "
                        "number <= 0")
        values.append(value)
    try:
        target = int(str(line.get("target")).strip())
    except ValueError:
        _fail(path, f"{where}: target {line.get('target')!r} is not an option index")
    if not 0 <= target < len(pairs):
        _fail(path, f"{where}: target {target} is outside its {len(pairs)} options")
    contexts = {p[0] for p in pairs}
    if len(contexts) != 1:
        _fail(path, f"{where}: its options have different contexts")
    if len(pairs) < 2:
        _fail(path, f"{where} has {len(pairs)} option; multiple choice needs 2 or more")
    record = MultipleChoiceRecord(question=pairs[0][0], choices=tuple(p[1] for p in pairs),
                                  answer=target)
    return record, values


def paired(model: LmEvalLog, reference: LmEvalLog) -> None:
    """Refuse, in one line, two logs that do not score the same documents in the same order
    with the same options (matched by ``doc_hash`` where both logs have it, else ``doc_id``)."""
    def keys(log):
        hashes = [h for h in log.doc_hashes if h]
        return hashes if len(hashes) == len(log.records) else [str(d) for d in log.doc_ids]

    a, b = keys(model), keys(reference)
    if a != b:
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                     min(len(a), len(b)))
        raise DataError(f"{model.path.name} and {reference.path.name} score different "
                        f"documents ({len(a)} vs {len(b)}; the first difference at line "
                        f"{first + 1}); log both models on the same task and limit")
    for i, (x, y) in enumerate(zip(model.records, reference.records, strict=True)):
        if len(x.choices) != len(y.choices) or x.answer != y.answer:
            raise DataError(f"{model.path.name} and {reference.path.name} differ at document "
                            f"{model.doc_ids[i]!r} (options or target); log both models on "
                            "the same task version")
