"""The option scores every score source returns (:class:`OptionScores`): a local model
(:mod:`.local`), an exported engine, a served model, lm-evaluation-harness logs and the
score cache all fill the same arrays, and every fit reads them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from calm_runtime import modes
from calm_runtime.data.prompts import cloze_option_scores
from calm_runtime.data.sets import MultipleChoiceRecord
from calm_runtime.errors import DataError
from calm_runtime.modes import DEFAULT_CLOZE_VARIANT

__all__ = ["OptionScores"]


@dataclass
class OptionScores:
    """Per-option scores of N questions (padded to the largest option count with NaN).

    For ``mode == "letter"``, ``values`` are next-token logits of the option letters; for
    ``"cloze"`` they are summed log-probabilities, with ``n_tokens``/``n_chars`` to derive
    the other variants. ``labels`` is -1 where a record has no answer.
    """

    mode: str
    values: np.ndarray  # [N, K_max] float64, NaN where a question has fewer options
    n_tokens: np.ndarray  # [N, K_max] int64 (ones in letter mode)
    n_chars: np.ndarray  # [N, K_max] int64
    labels: np.ndarray  # [N] int64
    #: served models, letter mode: questions where an option token was neither among the
    #: returned alternatives nor scorable by echo (it got the floor); None when local
    floored: int | None = None
    #: letter mode, a local model or an engine: the token id each option letter was read at
    #: (``[K_max]``; option ``i`` of every question is letter ``i``), where a vector fit
    #: writes its weights; None for cloze and served scores
    option_ids: np.ndarray | None = None

    @classmethod
    def empty(cls, records: Sequence[MultipleChoiceRecord],
              mode: modes.Mode | str) -> OptionScores:
        """The scores of ``records`` before any is read (NaN values, one token and character
        per option, the labels): every scorer (torch, engine, served) fills these in place."""
        mode = modes.mode(mode, choice=True).name  # the scores record the mode's name
        if not records:
            raise DataError("no records to score; check the data file or split")
        shape = (len(records), max(len(r.choices) for r in records))
        return cls(mode=mode, values=np.full(shape, np.nan),
                   n_tokens=np.ones(shape, dtype=np.int64),
                   n_chars=np.ones(shape, dtype=np.int64),
                   labels=np.array([-1 if r.answer is None else r.answer for r in records],
                                   dtype=np.int64))

    @property
    def n_options(self) -> np.ndarray:
        return (~np.isnan(self.values)).sum(axis=1)

    def scores(self, variant: str = DEFAULT_CLOZE_VARIANT) -> np.ndarray:
        """Option scores ``[N, K_max]`` for softmax, ``-inf`` where an option is absent."""
        if modes.mode(self.mode).token_level:  # the letters' logits
            out = self.values.copy()
        else:
            out = cloze_option_scores(self.values, self.n_tokens, self.n_chars, variant)
        out[np.isnan(self.values)] = -np.inf
        return out

    def to_arrays(self) -> dict[str, np.ndarray]:
        arrays = {"values": self.values, "n_tokens": self.n_tokens, "n_chars": self.n_chars,
                  "labels": self.labels}
        if self.option_ids is not None:
            arrays["option_ids"] = self.option_ids
        return arrays

    @classmethod
    def from_arrays(cls, mode: str, arrays: dict[str, np.ndarray]) -> OptionScores:
        return cls(mode=mode, values=arrays["values"], n_tokens=arrays["n_tokens"],
                   n_chars=arrays["n_chars"], labels=arrays["labels"],
                   option_ids=arrays.get("option_ids"))
