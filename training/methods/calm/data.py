"""Data for CALM training: the ``:train`` / ``:unlabeled`` parts, encoding, batches, shards.

Which records train CALM
------------------------
``calm eval`` and :func:`calm_training.fit.compare_methods` evaluate on the ``test`` part
of a named set (70%, :func:`calm_runtime.data.sets.split_records` with fraction 0.3, seed 0).
CALM must never see those records, so its two data sets are carved out of the other 30%,
the ``calibration`` part, which post-hoc methods (TS, DACA) fit on as well:

* ``NAME:train`` — the first half of ``NAME:calibration`` (``split_records(part, 0.5,
  seed=1)``, first part), labeled: the lower level's cross-entropy data ``S_T``;
* ``NAME:unlabeled`` — the other half, answers removed: the upper level's entropy data
  ``S_V``.

The three parts are disjoint, so training on ``arc-easy:train`` with ``arc-easy:unlabeled``
as calibration set and evaluating on ``arc-easy`` (its test part) never overlap. ``NAME``
may be a named set or a ``.jsonl`` path; any other spec (``NAME``, ``NAME:test``, a path) is
passed to :func:`calm_runtime.data.sets.load_dataset` unchanged, with a warning when it overlaps
the evaluation part.

Positions and targets
---------------------
Each record becomes an :class:`Example`: token sequences, the positions whose next-token
distribution counts, and the target token there (``-1``: entropy only).

* multiple choice, cloze mode — sequence ``"Question: ...\\nAnswer:" + " {option}"``
  (context with special tokens, continuation without, as in :mod:`calm_training.scoring.local`);
  training: CE on the correct option's text tokens; calibration (no labels): entropy at
  every position that predicts an option token, for every option (one sequence each), or
  with ``positions="answer"`` only where the answer starts (K times cheaper);
* multiple choice, letter mode — the letter prompt (chat template when configured);
  training: CE on the answer letter; calibration: entropy at the answer position;
* multiple choice with ``entropy="options"`` (calibration only) — the entropy of the
  K-option distribution the evaluation reads: cloze, every option's text as above with its
  tokens as targets, each position tagged with its option and the weight the score variant
  gives it (``sum`` 1, ``mean`` 1/tokens, ``char`` 1/characters), so that
  ``s_k = Σ weight · log p(token)``; letter, the answer position once per option letter;
* open QA — ``"Question: ...\\nAnswer:" + " {answers[0]}"``; training: CE on the answer
  tokens; calibration: entropy at the first answer position (the end of the prompt).

Every example weighs the same: its positions share a weight of ``1 / (n_positions * n)``
for ``n`` examples per rank and step, so the losses are means over examples and the mean
over ranks is the mean over the global batch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from calm_runtime import modes
from calm_runtime.data.olmo_eval_sets import SOURCES
from calm_runtime.data.prompts import (
    cloze_context,
    cloze_continuation,
    letter_prompt,
    letter_tokens,
    option_char_count,
)
from calm_runtime.data.sets import (
    DATA_PARTS,
    MultipleChoiceRecord,
    OpenQARecord,
    Record,
    dataset_hash,
    load_dataset,
    split_records,
)
from calm_runtime.errors import ConfigError, DataError
from calm_runtime.modes import CHOICE_MODES, CLOZE_VARIANTS, DEFAULT_CLOZE_VARIANT
from calm_training.scoring.local import (
    CHARS_PER_TOKEN_MARGIN,
    encode_text,
    max_token_chars,
    render_chat,
    single_token_id,
)

__all__ = [
    "CALIBRATION_POSITIONS",
    "ENTROPY_KINDS",
    "TRAIN_PART",
    "UNLABELED_PART",
    "TRAIN_SPLIT_FRACTION",
    "TRAIN_SPLIT_SEED",
    "Example",
    "TokenBatch",
    "resolve_records",
    "load_records",
    "encode_training",
    "encode_calibration",
    "answer_token_ids",
    "collate",
    "batch_indices",
    "holdout_split",
    "HOLDOUT_SEED",
]

logger = logging.getLogger(__name__)

CALIBRATION_POSITIONS = ("options", "answer")
#: the upper objective's entropy: of the K-option distribution the evaluation reads
#: (``options``) or of the full next-token distribution at the answer positions (``vocab``)
ENTROPY_KINDS = ("options", "vocab")
TRAIN_PART = "train"
UNLABELED_PART = "unlabeled"
TRAIN_SPLIT_FRACTION = 0.5
"""Share of ``NAME:calibration`` that forms ``NAME:train`` (the rest is ``NAME:unlabeled``)."""
TRAIN_SPLIT_SEED = 1
"""Seed of that split (distinct from the calibration/test split's seed 0)."""
HOLDOUT_SEED = 2
"""Seed of the gate's hold-out: every run and seed on the same data holds out the same ones."""


def holdout_size(n: int, holdout: int | float) -> int:
    """How many of ``n`` training questions ``holdout`` (``CalmConfig.holdout``) holds out: a
    count whole, refused when fewer than as many would be left to train on (the default
    count gives the gate its power; a share asks for less); a share rounded, at least 1."""
    if isinstance(holdout, float) and holdout:
        return min(n - 1, max(1, round(holdout * n)))
    if n < 2 * int(holdout):
        raise ConfigError(
            f"the gate's hold-out of {int(holdout)} questions needs at least {2 * int(holdout)} "
            f"training questions and the training data has {n}: give more, or pass --holdout "
            f"0.5 to hold out half ({round(n / 2)}; a weaker gate, said in the adapter) or "
            "--holdout 0 to write tau/shift and T ungated")
    return int(holdout)


def holdout_split(records: Sequence[Record], holdout: int | float
                  ) -> tuple[list[Record], list[Record]]:
    """``(held_out, kept)``: :func:`holdout_size` of ``records`` held out of training for the
    gate of α and T (:data:`HOLDOUT_SEED`), both in file order."""
    if len(records) < 2:
        raise ConfigError(f"holdout {holdout:g} needs at least 2 training records, got "
                          f"{len(records)}; add training data or pass --holdout 0")
    size = holdout_size(len(records), holdout)
    return split_records(records, size / len(records), HOLDOUT_SEED)


# ---------------------------------------------------------------------------- records
def resolve_records(spec: str | os.PathLike) -> list[Record]:
    """Records for one data spec, resolving the ``:train`` / ``:unlabeled`` aliases."""
    text = os.fspath(spec)
    head, sep, tail = text.rpartition(":")
    if sep and tail in (TRAIN_PART, UNLABELED_PART):
        pool = load_dataset(f"{head}:calibration")
        if len(pool) < 2:
            raise DataError(f"{head}:calibration has {len(pool)} record(s); {text} needs at "
                            "least 2 to split into train and unlabeled parts")
        train, unlabeled = split_records(pool, TRAIN_SPLIT_FRACTION, TRAIN_SPLIT_SEED)
        if tail == TRAIN_PART:
            return train
        return [replace(r, answer=None) if isinstance(r, MultipleChoiceRecord) else r
                for r in unlabeled]
    base, part = (head, tail) if sep and tail in DATA_PARTS else (text, "all")
    if base in SOURCES and part != "calibration":
        logger.warning("%s includes the evaluation (test) part that `calm eval` uses; use "
                       "%s:%s / %s:%s to keep evaluation disjoint from training", text, base,
                       TRAIN_PART, base, UNLABELED_PART)
    return load_dataset(text)


def load_records(specs: Sequence[str], *, labeled: bool, limit: int | None = None
                 ) -> tuple[list[Record], list[dict]]:
    """Concatenate the records of ``specs`` (each cut to ``limit``); also per-spec provenance.

    ``labeled`` requires an answer on every multiple-choice record (training data).
    """
    records: list[Record] = []
    info = []
    for spec in specs:
        part = resolve_records(spec)[:limit] if limit else resolve_records(spec)
        if labeled:
            missing = sum(1 for r in part if isinstance(r, MultipleChoiceRecord)
                          and r.answer is None)
            if missing:
                raise DataError(f"{spec}: {missing} of {len(part)} records have no answer; "
                                "training data needs labels (use NAME:train)")
        info.append({"spec": str(spec), "n": len(part), "sha256": dataset_hash(part)})
        records.extend(part)
    if not records:
        raise DataError(f"no records in {list(specs)}; check the data specs")
    return records, info


# ---------------------------------------------------------------------------- encoding
@dataclass(frozen=True)
class Example:
    """Token sequences and the positions (``(sequence, index)``) whose next-token
    distribution enters the loss, with the target token there (``-1``: entropy only).

    Option-entropy examples also give, per position, the option it scores (``options``)
    and its weight in that option's score (``scales``); labeled ones (CFT) their answer.
    """

    sequences: tuple[tuple[int, ...], ...]
    positions: tuple[tuple[int, int], ...]
    targets: tuple[int, ...]
    options: tuple[int, ...] | None = None
    scales: tuple[float, ...] | None = None
    label: int | None = None
    #: a reference model's option distribution (the upper objective ``daca``)
    reference: tuple[float, ...] | None = None


def _fit_length(context: list[int], continuation: list[int], max_length: int):
    """Cut the context from the left (and, if need be, the continuation from the right)."""
    if len(context) + len(continuation) <= max_length:
        return context, continuation, False
    continuation = continuation[:max_length - 1]
    return context[len(context) - (max_length - len(continuation)):], continuation, True


def _continuation_example(context, continuations, max_length, *, targets: bool) -> Example:
    sequences, positions, target_ids = [], [], []
    truncated = False
    for s, cont in enumerate(continuations):
        ctx, cont, cut = _fit_length(context, cont, max_length)
        truncated |= cut
        sequences.append(tuple(ctx + cont))
        for t, token in enumerate(cont):
            positions.append((s, len(ctx) - 1 + t))
            target_ids.append(token if targets else -1)
    if truncated:
        logger.debug("an example was cut to max_length=%d tokens", max_length)
    return Example(tuple(sequences), tuple(positions), tuple(target_ids))


def _answer_position(context: list[int], max_length: int) -> Example:
    """The next-token distribution at the end of ``context`` (where an answer starts)."""
    context = context[-max_length:]
    return Example((tuple(context),), ((0, len(context) - 1),), (-1,))


class Encoder:
    def __init__(self, tokenizer, *, mode: str, chat: bool, max_length: int,
                 positions: str = "options", entropy: str = "vocab",
                 variant: str = DEFAULT_CLOZE_VARIANT) -> None:
        if mode not in CHOICE_MODES:
            raise ConfigError(f"mode must be cloze or letter, got {mode!r}")
        if positions not in CALIBRATION_POSITIONS:
            raise ConfigError(f"calibration positions must be one of "
                              f"{', '.join(CALIBRATION_POSITIONS)}, got {positions!r}")
        self.tokenizer, self.mode, self.chat, self.max_length = tokenizer, mode, chat, max_length
        #: letter mode: the options are read from the letters' next-token logits
        self.letters = modes.mode(mode).token_level
        if entropy not in ENTROPY_KINDS:
            raise ConfigError(f"entropy must be one of {', '.join(ENTROPY_KINDS)}, got "
                              f"{entropy!r}")
        if variant not in CLOZE_VARIANTS:
            raise ConfigError(f"cloze variant must be one of {', '.join(CLOZE_VARIANTS)}, got "
                              f"{variant!r}")
        self.positions, self.entropy, self.variant = positions, entropy, variant
        self._letters: dict[int, list[int]] = {}

    def _cap(self) -> int:
        """Characters that surely hold more than ``max_length`` tokens: longer texts are cut
        (contexts from the left, answers from the right) before they are tokenised, so a
        huge record costs no more than a long one."""
        return self.max_length * max_token_chars(self.tokenizer) * CHARS_PER_TOKEN_MARGIN

    def question(self, record) -> str:
        return record.question[-self._cap():]

    def context(self, text: str) -> list[int]:
        text = text[-self._cap():]
        if self.chat:
            return encode_text(self.tokenizer, render_chat(self.tokenizer, text), special=False)
        return encode_text(self.tokenizer, text, special=True)

    def continuation(self, text: str) -> list[int]:
        ids = encode_text(self.tokenizer, cloze_continuation(text[:self._cap()]), special=False)
        if not ids:
            raise DataError(f"answer text {text!r} tokenises to nothing; fix or drop it")
        return ids

    def letter_ids(self, k: int) -> list[int]:
        if k not in self._letters:
            self._letters[k] = [single_token_id(self.tokenizer, t)
                                for t in letter_tokens(k, chat=self.chat)]
        return self._letters[k]

    def letter_example(self, record: MultipleChoiceRecord, target: int | None) -> Example:
        prompt = self.context(letter_prompt(record.question, record.choices))
        prompt = prompt[-self.max_length:]
        tgt = -1 if target is None else self.letter_ids(len(record.choices))[target]
        return Example((tuple(prompt),), ((0, len(prompt) - 1),), (tgt,))

    def option_example(self, record: MultipleChoiceRecord) -> Example:
        """The positions that score every option, tagged with option and weight."""
        if self.letters:
            base = self.letter_example(record, None)
            ids = self.letter_ids(len(record.choices))
            return Example(base.sequences, base.positions * len(ids), tuple(ids),
                           tuple(range(len(ids))), (1.0,) * len(ids))
        context = encode_text(self.tokenizer, cloze_context(self.question(record)), special=True)
        conts = [self.continuation(o) for o in record.choices]
        example = _continuation_example(context, conts, self.max_length, targets=True)
        options, scales = [], []
        for k in range(len(conts)):
            n = sum(1 for s, _ in example.positions if s == k)
            divisor = {"sum": 1, "mean": max(n, 1),
                       "char": option_char_count(record.choices[k])}[self.variant]
            options += [k] * n
            scales += [1.0 / divisor] * n
        return replace(example, options=tuple(options), scales=tuple(scales))

    def encode(self, record: Record, *, labeled: bool) -> Example:
        if isinstance(record, MultipleChoiceRecord):
            if not labeled and self.entropy == "options":
                return self.option_example(record)
            if self.letters:
                return self.letter_example(record, record.answer if labeled else None)
            context = encode_text(self.tokenizer, cloze_context(self.question(record)),
                                  special=True)
            if not labeled and self.positions == "answer":
                return _answer_position(context, self.max_length)
            options = ([record.choices[record.answer]] if labeled else list(record.choices))
            return _continuation_example(context, [self.continuation(o) for o in options],
                                         self.max_length, targets=labeled)
        if isinstance(record, OpenQARecord):
            context = encode_text(self.tokenizer, cloze_context(self.question(record)),
                                  special=True)
            if labeled:
                return _continuation_example(context, [self.continuation(record.answers[0])],
                                             self.max_length, targets=True)
            if self.entropy == "options":
                raise DataError("the options entropy needs multiple-choice calibration records "
                                "and this one is open QA; use --set entropy=vocab")
            return _answer_position(context, self.max_length)
        raise DataError(f"cannot train on a {type(record).__name__}; use multiple-choice or "
                        "open-QA records")


def encode_training(records: Sequence[Record], tokenizer, *, mode: str, chat: bool,
                    max_length: int) -> list[Example]:
    """Labeled examples for the lower level (cross-entropy on the answer tokens)."""
    encoder = Encoder(tokenizer, mode=mode, chat=chat, max_length=max_length)
    return [encoder.encode(r, labeled=True) for r in records]


def encode_calibration(records: Sequence[Record], tokenizer, *, mode: str, chat: bool,
                       max_length: int, positions: str = "options", entropy: str = "vocab",
                       variant: str = DEFAULT_CLOZE_VARIANT) -> list[Example]:
    """Unlabeled examples for the upper level.

    ``entropy="vocab"``: the full next-token entropy at the answer positions; ``positions``
    (cloze multiple choice only) says which: ``options`` — every position that predicts an
    option token, all options (one sequence each); ``answer`` — only the position where the
    answer starts (one sequence per question, about K times cheaper).
    ``entropy="options"``: the entropy of the K-option distribution (module docstring),
    cloze scores of the ``variant`` (:data:`~calm_runtime.modes.CLOZE_VARIANTS`).
    """
    encoder = Encoder(tokenizer, mode=mode, chat=chat, max_length=max_length,
                       positions=positions, entropy=entropy, variant=variant)
    return [encoder.encode(r, labeled=False) for r in records]


def encode_labeled_options(records: Sequence[Record], tokenizer, *, mode: str, chat: bool,
                           max_length: int, variant: str = DEFAULT_CLOZE_VARIANT
                           ) -> list[Example]:
    """Labeled examples that score every option (CFT: cross-entropy on the answer and the
    K-option distribution of ``variant`` cloze scores or of the letters)."""
    encoder = Encoder(tokenizer, mode=mode, chat=chat, max_length=max_length,
                       entropy="options", variant=variant)
    out = []
    for record in records:
        if not isinstance(record, MultipleChoiceRecord):
            raise DataError("calibration-aware fine-tuning needs multiple-choice training "
                            f"records and got a {type(record).__name__}; use --method lora")
        out.append(replace(encoder.option_example(record), label=record.answer))
    return out


def answer_token_ids(records: Sequence[Record], tokenizer, *, mode: str, chat: bool) -> set[int]:
    """Every token an answer can be read from: the tokens of every option text (cloze) or
    the option letters (letter) of multiple-choice records, and of every answer alias of
    open-QA records — where ``--set alpha_tokens=options`` trains τ and l."""
    encoder = Encoder(tokenizer, mode=mode, chat=chat, max_length=1 << 30)
    ids: set[int] = set()
    for record in records:
        if isinstance(record, MultipleChoiceRecord):
            if encoder.letters:
                ids.update(encoder.letter_ids(len(record.choices)))
            else:
                for option in record.choices:
                    ids.update(encoder.continuation(option))
        elif isinstance(record, OpenQARecord):
            for answer in record.answers:
                ids.update(encoder.continuation(answer))
    return ids


# ---------------------------------------------------------------------------- batches
@dataclass(frozen=True)
class TokenBatch:
    """Right-padded sequences and the flat positions ``row * length + index`` to read.

    ``weights`` sum to ``n_examples / normaliser``; ``targets`` is ``-1`` where only the
    entropy counts. Option-entropy batches also carry ``slots`` (``[P]``, the option
    ``example * k_max + k`` each position scores), ``scales`` (``[P]``, its weight in that
    score), ``option_mask`` (``[E, k_max]``, which options exist) and ``example_weights``
    (``[E]``, ``1 / normaliser``); they are ``None`` otherwise. Labeled option batches
    (CFT) carry ``labels`` (``[E]``, the answer's option index).
    """

    input_ids: object  # torch.LongTensor [S, L]
    attention_mask: object  # torch.LongTensor [S, L]
    flat_positions: object  # torch.LongTensor [P]
    targets: object  # torch.LongTensor [P]
    weights: object  # torch.FloatTensor [P]
    slots: object = None  # torch.LongTensor [P]
    scales: object = None  # torch.FloatTensor [P]
    option_mask: object = None  # torch.BoolTensor [E, k_max]
    example_weights: object = None  # torch.FloatTensor [E]
    labels: object = None  # torch.LongTensor [E]
    reference: object = None  # torch.FloatTensor [E, k_max]

    def to(self, device) -> TokenBatch:
        return TokenBatch(*(None if t is None else t.to(device) for t in (
            self.input_ids, self.attention_mask, self.flat_positions, self.targets,
            self.weights, self.slots, self.scales, self.option_mask, self.example_weights,
            self.labels, self.reference)))


def collate(examples: Sequence[Example], normaliser: int, pad_id: int) -> TokenBatch:
    """One batch of ``examples``; each example's positions weigh ``1 / (n_pos * normaliser)``."""
    import torch

    sequences = [s for e in examples for s in e.sequences]
    length = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    flat, targets, weights = [], [], []
    with_options = [e.options is not None for e in examples]
    if any(with_options) and not all(with_options):
        raise ConfigError("a batch mixes option-entropy examples with others; encode the "
                          "calibration set with one entropy kind")
    k_max = max((max(e.options) + 1 for e in examples if e.options), default=0)
    slots, scales = [], []
    option_mask = torch.zeros((len(examples), max(k_max, 1)), dtype=torch.bool)
    row = 0
    for e_index, example in enumerate(examples):
        for s, seq in enumerate(example.sequences):
            ids[row + s, :len(seq)] = torch.as_tensor(seq, dtype=torch.long)
            mask[row + s, :len(seq)] = 1
        weight = 1.0 / (len(example.positions) * normaliser)
        for (s, index), target in zip(example.positions, example.targets, strict=True):
            flat.append((row + s) * length + index)
            targets.append(target)
            weights.append(weight)
        if example.options is not None:
            for k, scale in zip(example.options, example.scales, strict=True):
                slots.append(e_index * k_max + k)
                scales.append(scale)
                option_mask[e_index, k] = True
        row += len(example.sequences)
    options = {}
    if k_max:
        options = {"slots": torch.as_tensor(slots, dtype=torch.long),
                   "scales": torch.as_tensor(scales, dtype=torch.float32),
                   "option_mask": option_mask,
                   "example_weights": torch.full((len(examples),), 1.0 / normaliser)}
        if all(e.label is not None for e in examples):
            options["labels"] = torch.as_tensor([e.label for e in examples], dtype=torch.long)
        if all(e.reference is not None for e in examples):
            reference = torch.zeros((len(examples), k_max), dtype=torch.float32)
            for e_index, example in enumerate(examples):
                reference[e_index, :len(example.reference)] = torch.as_tensor(
                    example.reference, dtype=torch.float32)
            options["reference"] = reference
    return TokenBatch(ids, mask, torch.as_tensor(flat, dtype=torch.long),
                      torch.as_tensor(targets, dtype=torch.long),
                      torch.as_tensor(weights, dtype=torch.float32), **options)


def batch_indices(n: int, batch_size: int, step: int, seed: int, stream: int) -> np.ndarray:
    """Indices of the global batch of ``step`` (0-based): a fixed function of its arguments.

    The records are visited epoch by epoch, each epoch in the order
    ``default_rng([seed, stream, epoch]).permutation(n)``; batch ``step`` takes the items
    ``step * batch_size ... + batch_size - 1`` of that endless stream. A resumed run
    therefore sees exactly the batches an uninterrupted one would.
    """
    if n < 1:
        raise DataError("no examples to draw batches from")
    start = step * batch_size
    out = np.empty(batch_size, dtype=np.int64)
    cache: dict[int, np.ndarray] = {}
    for j in range(batch_size):
        epoch, offset = divmod(start + j, n)
        if epoch not in cache:
            cache[epoch] = np.random.default_rng([seed, stream, epoch]).permutation(n)
        out[j] = cache[epoch][offset]
    return out
