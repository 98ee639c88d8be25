"""Option scores from the sample logs lm-evaluation-harness already wrote.

``lm_eval --log_samples`` writes one ``samples_<task>_<date>.jsonl`` per task: a line per
document with its ``doc_id``, the ``doc`` itself, the ``target`` (the gold option's index,
as a string in ``multiple_choice`` tasks), the ``arguments`` (the context and each option's
continuation) and ``filtered_resps`` (one ``[loglikelihood, is_greedy]`` pair per option,
both as strings), with a ``doc_hash``. A ``multiple_choice`` task's log-likelihoods are the
sums calm's cloze scorer computes for ``" {option}"`` after the context (docs/methods.md §2),
so :func:`read_samples` turns a log into calm's
:class:`~calm_training.scoring.option_scores.OptionScores`
(``sum``; ``mean`` with a tokenizer to count each continuation's tokens, ``char`` from the
continuation's text) and the records they belong to, and :func:`paired` checks that a model's
and a reference's logs score the same documents. ``calm fit`` / ``calm eval`` read them with
``--model-scores lm-eval:PATH`` and ``--reference-scores lm-eval:PATH``.

Everything a log could hold wrong is one :class:`~calm_runtime.errors.DataError` line
naming the line and its ``doc_id``: a file over :data:`MAX_LOG_BYTES`, a line that is not a
JSON object, a ``generate_until`` or ``loglikelihood_rolling`` task, ``arguments`` that are
not ``gen_args_0`` … ``gen_args_{K-1}`` of ``{arg_0: context, arg_1: continuation}`` (or the
older list of pairs), a response that is not a finite log-likelihood <= 0 (strings parsed as
decimal numbers, integers bounded to :data:`MAX_INT_DIGITS` digits while the JSON is read),
more than :data:`MAX_OPTIONS` options on a line, a table of documents x options over
:data:`MAX_SCORE_CELLS` (checked before it is allocated), a target outside the options, two
logs of different documents.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from calm_runtime.data.prompts import option_char_count
from calm_runtime.data.sets import MultipleChoiceRecord
from calm_runtime.errors import DataError
from calm_runtime.files import show, show_name

__all__ = ["LOG_PREFIX", "MAX_LOG_BYTES", "MAX_OPTIONS", "MAX_SCORE_CELLS", "LmEvalLog",
           "cloze_task", "is_log_spec", "log_path", "paired", "read_samples"]

#: how a score source names an lm-eval sample log: ``lm-eval:PATH``
LOG_PREFIX = "lm-eval:"
#: the largest sample log read (a 14k-question MMLU log is ~60 MB)
MAX_LOG_BYTES = 1 << 30
#: the longest line read (one document, its arguments and responses)
MAX_LINE_BYTES = 16 << 20
#: the most options one document may have (multiple-choice tasks have 2 to a few dozen)
MAX_OPTIONS = 1024
#: the most cells of the documents x options table the scores are held in (8 bytes each,
#: in a few arrays): a 14k-question MMLU log needs 56k
MAX_SCORE_CELLS = 1 << 24
#: the longest integer literal read from a log (doc ids, targets and counts are short)
MAX_INT_DIGITS = 30
_GEN_ARGS = re.compile(r"gen_args_(0|[1-9][0-9]{0,8})", re.ASCII)
_ARG = re.compile(r"arg_(0|[1-9][0-9]{0,8})", re.ASCII)
_DECIMAL = re.compile(r"\s*[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]{1,4})?\s*"
                      r"|\s*[-+]?(?:nan|inf|infinity)\s*", re.ASCII | re.IGNORECASE)
_INDEX = re.compile(r"\s*(0|[1-9][0-9]{0,8})\s*", re.ASCII)


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
        """calm's :class:`~calm_training.scoring.option_scores.OptionScores` of the log: the sums
        (cloze; ``n_tokens`` counted with ``tokenizer`` when given, else 1, and the ``mean``
        variant refused by :func:`require_token_counts`), or in letter mode the options'
        log-probabilities (a softmax over them is the letters' restricted softmax)."""
        from calm_training.scoring.option_scores import OptionScores

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


class _BigInt:
    """An integer literal longer than :data:`MAX_INT_DIGITS` digits, kept as its text (never
    converted: no number calm reads from a log is that long)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return f"<an integer of {len(self.text.lstrip('-'))} digits>"


def _bounded_int(text: str) -> int:
    return _BigInt(text) if len(text.lstrip("-")) > MAX_INT_DIGITS else int(text)


def _described(value) -> str:
    return "null" if value is None else f"{type(value).__name__} {show(value)}"


def _pairs(path: Path, where: str, arguments) -> list:
    """``[(context, continuation), ...]`` of a line's ``arguments`` (lm-eval writes a dict of
    ``gen_args_i: {arg_0, arg_1}``; older versions a list of lists), checked entry by entry;
    an entry of another task's shape is kept as its tuple of arguments for :func:`_line`."""
    if not isinstance(arguments, dict | list) or not arguments:
        _fail(path, f"{where} has no arguments (it has {show(arguments)})")
    if len(arguments) > MAX_OPTIONS:
        _fail(path, f"{where} has {len(arguments):,} options, more than the {MAX_OPTIONS:,} "
                    "read per document")
    if isinstance(arguments, list):
        entries = list(enumerate(arguments))
    else:
        indexed = {}
        for key in arguments:
            match = _GEN_ARGS.fullmatch(key)
            if match is None or int(match.group(1)) >= len(arguments):
                _fail(path, f"{where}: arguments key {show(key)} is not one of gen_args_0 … "
                            f"gen_args_{len(arguments) - 1}")
            indexed[int(match.group(1))] = arguments[key]
        entries = sorted(indexed.items())
    pairs = []
    for k, value in entries:
        name = f"gen_args_{k}" if isinstance(arguments, dict) else f"arguments[{k}]"
        if isinstance(value, dict):
            args = {}
            for key in value:
                match = _ARG.fullmatch(key)
                if match is None or int(match.group(1)) >= len(value):
                    _fail(path, f"{where}: {name} has key {show(key)}, not one of arg_0 … "
                                f"arg_{len(value) - 1}")
                args[int(match.group(1))] = value[key]
            pairs.append(tuple(args[i] for i in range(len(args))))
        elif isinstance(value, list) and isinstance(arguments, list):
            pairs.append(tuple(value))
        elif isinstance(value, str) and isinstance(arguments, list):
            pairs.append((value,))
        else:
            _fail(path, f"{where}: {name} is {_described(value)}, not the "
                        "{arg_0: context, arg_1: continuation} of an option")
    return pairs


def _log_likelihood(path: Path, where: str, k: int, response) -> float:
    """Option ``k``'s log-likelihood of its response ``[log-likelihood, is_greedy]`` (or the
    bare log-likelihood): a decimal number, finite, <= 0."""
    if isinstance(response, list):
        if not 1 <= len(response) <= 2:
            _fail(path, f"{where}: option {k}'s response has {len(response)} entries, not "
                        "[log-likelihood, is_greedy]")
        if len(response) == 2 and not (isinstance(response[1], bool) or response[1] in (
                "True", "False", "true", "false")):
            _fail(path, f"{where}: option {k}'s is_greedy {show(response[1])} is not true "
                        "or false")
        first = response[0]
    else:
        first = response
    if isinstance(first, _BigInt):
        value = math.inf
    elif isinstance(first, int | float) and not isinstance(first, bool):
        value = float(first)
    elif isinstance(first, str) and len(first) <= 64 and _DECIMAL.fullmatch(first):
        value = float(first)
    else:
        _fail(path, f"{where}: option {k}'s response {show(first)} is not a log-likelihood")
    if not math.isfinite(value) or value > 1e-6:
        _fail(path, f"{where}: option {k}'s log-likelihood {show(first)} is not a finite "
                    "number <= 0")
    return value


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
                line = json.loads(raw, parse_int=_bounded_int)
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
    widest = max(len(v) for v in sums)
    if len(sums) * widest > MAX_SCORE_CELLS:
        _fail(path, f"{len(sums):,} documents of up to {widest:,} options make a table of "
                    f"{len(sums) * widest:,} scores, more than the {MAX_SCORE_CELLS:,} held; "
                    "split the log or drop the documents with the most options")
    table = np.full((len(sums), widest), np.nan)
    for row, values in enumerate(sums):
        table[row, :len(values)] = values
    return LmEvalLog(path=path, sha256=digest.hexdigest(), records=records, sums=table,
                     doc_ids=doc_ids, doc_hashes=doc_hashes)


def _line(path: Path, number: int, line: dict):
    doc_id = line.get("doc_id")
    where = f"line {number} (doc_id {show(doc_id, 40)})"
    if not isinstance(doc_id, int) or isinstance(doc_id, bool) or doc_id < 0:
        _fail(path, f"{where}: doc_id is not a document index (an integer >= 0)")
    if not isinstance(line.get("doc_hash"), str | None):
        _fail(path, f"{where}: doc_hash {show(line.get('doc_hash'))} is not text")
    pairs = _pairs(path, where, line.get("arguments"))
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
    values = [_log_likelihood(path, where, k, response) for k, response in enumerate(responses)]
    target = line.get("target")
    match = (_INDEX.fullmatch(target) if isinstance(target, str)
             else _INDEX.fullmatch(str(target)) if isinstance(target, int)
             and not isinstance(target, bool) else None)
    if match is None:
        _fail(path, f"{where}: target {show(target, 40)} is not an option index")
    target = int(match.group(1))
    if not 0 <= target < len(pairs):
        _fail(path, f"{where}: target {target} is outside its {len(pairs)} options")
    contexts = {p[0] for p in pairs}
    if len(contexts) != 1:
        _fail(path, f"{where}: its options have different contexts")
    if len(pairs) < 2:
        _fail(path, f"{where} has {len(pairs)} option; multiple choice needs 2 or more")
    try:
        record = MultipleChoiceRecord(question=pairs[0][0], choices=tuple(p[1] for p in pairs),
                                      answer=target)
    except DataError as exc:
        _fail(path, f"{where}: {str(exc).split(';')[0]}")
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
