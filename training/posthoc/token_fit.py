"""Token-level temperatures for cloze fits: what the engine's LM head carries.

A cloze fit calibrates the K-way distribution over option scores (``answer_temperature``);
that temperature cannot be folded into the head (docs/methods.md §3, "Token level"). The
token log-probabilities an engine serves are calibrated only by a token-level fit on the
next-token distributions at the answer positions:

* label-free (``daca``, ``naive``): the reference must share the model's tokenizer; both
  models read the same teacher-forced sequences (context + the model's chosen answer on the
  questions where both models choose the same option; every question for ``naive``), and
  DACA's masked KL is minimised over the positions where their next-token argmax agrees;
* labeled (``ts``): the NLL of the correct answer's tokens under ``softmax(z / T)``.

:func:`answer_positions` runs the teacher-forced sequences through a torch model and keeps
the full-vocabulary logits of the answer positions; :func:`token_level_fit` decides whether
a signal exists and hands the positions to the method's own token-level fit
(:meth:`FitMethod.fit_tokens <calm_training.methods.fit_method.FitMethod.fit_tokens>`:
:mod:`calm_training.methods.daca`'s, :mod:`calm_training.methods.ts`'s). Where none exists
(a reference with another tokenizer, an engine or a served model) the fit is option-level
only and the reason is recorded.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from calm_runtime.data.prompts import cloze_context, cloze_continuation
from calm_runtime.data.sets import MultipleChoiceRecord
from calm_runtime.errors import ConfigError, FitError
from calm_runtime.progress import progress as progress_bar
from calm_runtime.temperature import TOKEN_CHUNK_ROWS
from calm_training.scoring.local import (
    batched_logits,
    context_limit,
    describe,
    encode_within,
    padding_id,
    token_batches,
)

__all__ = ["AnswerPositions", "answer_positions", "token_level_fit", "token_confidences",
           "cloze_token_temperature"]

logger = logging.getLogger(__name__)

#: the most bytes of float32 answer-position logits one model's pass keeps (whole questions,
#: in the order given): a token-level temperature is one number, and full-vocabulary rows of
#: every answer token of a large calibration set outgrow memory (1,506 HellaSwag questions
#: with SmolLM2's 49,152-token vocabulary: about 21,000 positions, 4 GiB per model)
POSITION_BYTES = 2 << 30

NO_SHARED_TOKENIZER = ("the reference does not share the model's tokenizer, so a label-free "
                       "token-level fit has no signal (option-level only)")


@dataclass
class AnswerPositions:
    """Next-token logits at the answer positions of teacher-forced cloze sequences.

    ``logits`` ``[P, V]`` float32 (after any token calibration passed in), ``targets``
    ``[P]`` the answer's next token at each position, ``question`` ``[P]`` the index of the
    record (in the order given) each position belongs to; ``n_questions`` how many records
    were read (the first ones, within the memory budget)."""

    logits: np.ndarray
    targets: np.ndarray
    question: np.ndarray
    n_questions: int


def answer_positions(model, tokenizer, records: Sequence[MultipleChoiceRecord],
                     options: Sequence[int], *, calibration=None, batch_size: int = 8,
                     max_length: int | None = None, progress: bool = False,
                     max_bytes: int | None | str = "budget") -> AnswerPositions:
    """Run ``cloze_context(question) + " " + choices[options[i]]`` for the records and keep
    the logits that predict the answer's tokens (one row per answer token).

    Whole records are read in the order given while their rows fit in ``max_bytes``
    (``"budget"``: :data:`POSITION_BYTES`; ``None``: every record); ``n_questions`` of the
    result says how many were."""

    if len(options) != len(records):
        raise ConfigError(f"{len(options)} option indices for {len(records)} records")
    limit = context_limit(model, max_length)
    pad = padding_id(tokenizer)
    if max_bytes == "budget":
        max_bytes = POSITION_BYTES
    budget = None if max_bytes is None else max(1, max_bytes // (4 * _vocab_size(model)))
    sequences, n_answer, total = [], [], 0
    for row, (record, k) in enumerate(zip(records, options, strict=True)):
        cont = encode_within(tokenizer, cloze_continuation(record.choices[int(k)]), limit - 1,
                             f"option {k} of {describe(record, row)}", special=False)
        if sequences and budget is not None and total + len(cont) > budget:
            break
        total += len(cont)
        ctx = encode_within(tokenizer, cloze_context(record.question), limit,
                            describe(record, row), special=True, reserve=len(cont))
        sequences.append(ctx + cont)
        n_answer.append(len(cont))
    if len(sequences) < len(records):
        logger.info("token-level fit: the answer positions of the first %d of %d questions "
                    "(%d positions, the memory budget)", len(sequences), len(records), total)
    out, targets, owner, filled = None, [], [], 0
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
    bar = progress_bar(total=len(sequences), desc="answer positions", unit="question",
                       bar=progress)
    was_training = model.training
    model.eval()
    try:
        for chunk in token_batches(order, batch_size, [len(s) for s in sequences]):
            keep = max(n_answer[i] for i in chunk) + 1
            logits = batched_logits(model, [sequences[i] for i in chunk], keep, pad)
            if calibration is not None:
                logits = calibration.calibrate(logits)
            logits = logits.numpy()
            if out is None:  # one array, filled in place: no second copy of the rows
                out = np.empty((total, logits.shape[-1]), dtype=np.float32)
            for b, i in enumerate(chunk):
                n = n_answer[i]
                # the last n + 1 positions end with the final token's (unused) prediction
                out[filled:filled + n] = logits[b, keep - n - 1:keep - 1, :out.shape[1]]
                filled += n
                targets.extend(sequences[i][-n:])
                owner.extend([i] * n)
            bar.update(len(chunk))
    finally:
        model.train(was_training)
        bar.close()
    return AnswerPositions(logits=out, targets=np.asarray(targets, dtype=np.int64),
                           question=np.asarray(owner, dtype=np.int64),
                           n_questions=len(sequences))


def _capped(read: int, available: int) -> dict:
    """The record's note when the memory budget left questions out."""
    return {} if read == available else {
        "capped": f"the first {read} of {available} questions (POSITION_BYTES, memory)"}


def _vocab_size(model) -> int:
    head = model.get_output_embeddings()
    return int(head.weight.shape[0]) if head is not None else int(model.config.vocab_size)


def token_confidences(logits: np.ndarray, targets: np.ndarray, temperature: float = 1.0):
    """Per position: the top next-token probability under ``softmax(z / T)``, whether that
    token is the target, and the target's NLL: ``(confidence, correct, nll)`` arrays."""
    conf = np.empty(len(targets))
    nll = np.empty(len(targets))
    for start in range(0, len(targets), TOKEN_CHUNK_ROWS):
        z = np.asarray(logits[start:start + TOKEN_CHUNK_ROWS], np.float64) / temperature
        z = z - z.max(axis=1, keepdims=True)
        lse = np.log(np.exp(z).sum(axis=1))
        conf[start:start + len(z)] = np.exp(-lse)  # the top logit is 0 after the shift
        nll[start:start + len(z)] = lse - z[np.arange(len(z)),
                                            targets[start:start + len(z)]]
    correct = (np.asarray(logits).argmax(axis=1) == targets).astype(float)
    return conf, correct, nll


def token_level_fit(method, *, model, tokenizer, records, chosen: np.ndarray,
                    reference=None, reference_tokenizer=None, same_tokenizer: bool = False,
                    labels: np.ndarray | None = None, calibration=None, batch_size: int = 8,
                    max_length: int | None = None, progress: bool = False,
                    agree: np.ndarray | None = None):
    """Fit the token-level temperature of ``method`` (a
    :class:`~calm_training.methods.fit_method.FitMethod`) on ``records`` (the calibration split).

    ``model``/``reference`` are loaded torch models; ``chosen`` the model's option choice per
    record, ``agree`` whether the reference chose the same one (label-free methods),
    ``labels`` the correct options (``ts``). Returns ``(fit or None, record)``: the record
    says what was fitted on which signal, or why nothing was (the vector fits have no
    token-level counterpart)."""
    if not method.token_level:
        return None, {"fitted": False, "reason": f"{method.name} has no token-level counterpart"}
    if method.needs_labels:
        if labels is None or (labels < 0).any():
            return None, {"fitted": False, "reason": "labels missing on the calibration split"}
        pos = answer_positions(model, tokenizer, records, labels, calibration=calibration,
                               batch_size=batch_size, max_length=max_length, progress=progress)
        fit = method.fit_tokens(pos.logits, targets=pos.targets)
        return fit, {"fitted": True, "signal": "labels: the correct answers' tokens",
                     "positions": int(len(pos.targets)), "questions": pos.n_questions,
                     **_capped(pos.n_questions, len(records)), **fit.to_dict()}
    if reference is None or not same_tokenizer:
        return None, {"fitted": False, "reason": NO_SHARED_TOKENIZER}
    keep = np.flatnonzero(agree) if method.masked else np.arange(len(records))
    if keep.size == 0:
        return None, {"fitted": False, "reason": "no calibration question where both models "
                                                 "choose the same option"}
    subset = [records[i] for i in keep]
    options = np.asarray(chosen)[keep]
    mine = answer_positions(model, tokenizer, subset, options, calibration=calibration,
                            batch_size=batch_size, max_length=max_length, progress=progress)
    n = mine.n_questions  # the reference reads the same questions
    theirs = answer_positions(reference, reference_tokenizer, subset[:n], options[:n],
                              batch_size=batch_size, max_length=max_length, progress=progress,
                              max_bytes=None)
    if not np.array_equal(mine.targets, theirs.targets):
        return None, {"fitted": False, "reason": "the reference tokenises the answers "
                                                 "differently; option-level only"}
    width = min(mine.logits.shape[1], theirs.logits.shape[1])
    try:  # naive: every position, no agreement mask (the baseline's failure mode)
        fit = method.fit_tokens(mine.logits[:, :width], reference=theirs.logits[:, :width],
                                n_questions=len(records))
    except FitError as exc:  # no agreeing position: a result (option-level only), not a crash
        return None, {"fitted": False, "reason": str(exc)}
    return fit, {"fitted": True,
                 "signal": "reference: next-token distributions at the answer positions",
                 "positions": int(len(mine.targets)), "questions": n,
                 **_capped(n, int(keep.size)), **fit.to_dict()}


def cloze_token_temperature(method, *, model, reference, records,
                            chosen: np.ndarray, agree: np.ndarray | None,
                            labels: np.ndarray | None, base_adapter=None, batch_size: int = 8,
                            max_length: int | None = None, progress: bool = False):
    """:func:`token_level_fit` from model sources (or specs they resolve from): loads the
    model (with ``base_adapter``'s LoRA and token calibration) and, for label-free methods,
    the reference when it shares the model's tokenizer. Engines and served models have no
    full next-token logits to fit on here: the fit is then option-level only, with the
    reason recorded."""
    from calm_training.scoring.sources import as_source

    if not method.token_level:
        return None, {"fitted": False, "reason": f"{method.name} has no token-level counterpart"}
    sources = {"model": as_source(model)}
    if method.needs_reference and reference is not None:
        sources["reference"] = as_source(reference)
    for role, source in sources.items():
        if not source.full_logits:
            return None, {"fitted": False,
                          "reason": f"the {role} is {source.described}; a token-level fit "
                                    "reads full next-token distributions from a transformers "
                                    "model (option-level only)"}
    same = False
    if method.needs_reference:
        if reference is None:
            return None, {"fitted": False, "reason": "no reference model"}
        mine, theirs = sources["model"].identity(), sources["reference"].identity()
        same = (mine.tokenizer_sha256 is not None
                and mine.tokenizer_sha256 == theirs.tokenizer_sha256)
        if not same:
            return None, {"fitted": False, "reason": NO_SHARED_TOKENIZER}
        if mine.vocab_size != theirs.vocab_size:  # one tokenizer, heads of other sizes
            return None, {"fitted": False, "reason": (
                f"the model's head has {mine.vocab_size} rows and the reference's "
                f"{theirs.vocab_size} (a padded head): their next-token distributions are "
                "not over the same ids (option-level only)")}
    lora = base_adapter.lora_path if base_adapter is not None else None
    lm, tokenizer, _ = sources["model"].load(lora_path=lora)
    calibration = (base_adapter if base_adapter is not None
                   and base_adapter.has_token_calibration() else None)
    ref = ref_tokenizer = None
    if method.needs_reference:
        ref, ref_tokenizer, _ = sources["reference"].load()
    logger.info("fitting the token-level %s temperature on the answer positions of %d "
                "calibration questions", method.name, len(records))
    return token_level_fit(method, model=lm, tokenizer=tokenizer, records=records,
                           chosen=chosen, reference=ref, reference_tokenizer=ref_tokenizer,
                           same_tokenizer=same, labels=labels, calibration=calibration,
                           batch_size=batch_size, max_length=max_length, progress=progress,
                           agree=agree)
