"""What :class:`~calm_runtime.inference.lm.CalibratedLM` returns: plain, immutable, JSON-ready
records.

Every probability here is calibrated (the engine's logits are, docs/methods.md §1–§2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Alternative", "Token", "Timing", "Generation", "Choice"]


@dataclass(frozen=True)
class Alternative:
    """One of the most probable tokens at a step."""

    id: int
    text: str
    confidence: float
    #: its raw (uncalibrated) log-probability, when asked for (see ``raw_logprobs``)
    raw_logprob: float | None = None

    def to_dict(self) -> dict:
        out = {"id": self.id, "text": self.text, "confidence": self.confidence}
        if self.raw_logprob is not None:
            out["raw_logprob"] = self.raw_logprob
        return out


@dataclass(frozen=True)
class PromptToken:
    """One token of a scored prompt (what an ``echo`` request returns).

    Attributes:
        id: token id.
        text: the token's text (``""`` for special tokens such as BOS).
        offset: the character in the prompt where the token starts.
        logprob: its calibrated log-probability given the tokens before it (``None`` for
            the first token, which nothing predicts).
        top: the most probable tokens at its position (``None`` for the first token or
            when not asked for).
        raw_logprob: its raw (uncalibrated) log-probability, when asked for.
    """

    id: int
    text: str
    offset: int
    logprob: float | None
    top: tuple[Alternative, ...] | None = None
    raw_logprob: float | None = None


@dataclass(frozen=True)
class Token:
    """A generated token.

    Attributes:
        id: token id.
        text: the text this token adds to the output (``""`` for special tokens and for a
            token that ends inside a multi-byte character, whose text comes with the next).
        confidence: its calibrated probability ``softmax(z_cal)[id]`` (full vocabulary).
        logprob: ``log(confidence)``, computed without rounding through the probability.
        entropy: entropy (nats) of the calibrated next-token distribution at this step.
        top: the most probable tokens at this step (when ``top_alternatives`` > 0).
        raw_logprob: its raw (uncalibrated) log-probability, the model's own before calm's
            calibration (when ``raw_logprobs`` is asked for; ``None`` otherwise).
    """

    id: int
    text: str
    confidence: float
    logprob: float
    entropy: float
    top: tuple[Alternative, ...] | None = None
    raw_logprob: float | None = None

    def to_dict(self) -> dict:
        out = {"id": self.id, "text": self.text, "confidence": self.confidence,
               "logprob": self.logprob, "entropy": self.entropy}
        if self.raw_logprob is not None:
            out["raw_logprob"] = self.raw_logprob
        if self.top is not None:
            out["top"] = [a.to_dict() for a in self.top]
        return out


@dataclass(frozen=True)
class Timing:
    """Wall-clock seconds of one generation call (shared by the rows of a batch).

    ``prefill_s`` covers the prompt's forward pass and the first token; ``decode_s`` the
    remaining steps; ``per_token_s`` is ``decode_s / decode_steps`` (0 without steps).
    """

    prefill_s: float
    decode_s: float
    decode_steps: int

    @property
    def per_token_s(self) -> float:
        return self.decode_s / self.decode_steps if self.decode_steps else 0.0

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    def to_dict(self) -> dict:
        return {"prefill_s": self.prefill_s, "decode_s": self.decode_s,
                "decode_steps": self.decode_steps, "per_token_s": self.per_token_s}


@dataclass(frozen=True)
class Generation:
    """One generated sequence with its confidences.

    Attributes:
        text: the generated text (prompt excluded), cut before a stop string.
        tokens: every generated token, including an end-of-sequence token and the token that
            completed a stop string (their probabilities are part of the sequence's).
        finish_reason: ``"eos"``, ``"stop"`` (a stop string) or ``"length"``; ``"cancelled"``
            when the caller stopped the row early (``generation_run(cancelled=...)``).
        prompt_tokens: the prompt's length in tokens.
        timing: see :class:`Timing`.

    Sequence confidences (docs/methods.md §2) over ``tokens``: :attr:`joint_confidence` is the
    product of the token probabilities, :attr:`sequence_confidence` their geometric mean
    (length-normalised, ``exp(mean logprob)``).
    """

    text: str
    tokens: tuple[Token, ...]
    finish_reason: str
    prompt_tokens: int
    timing: Timing = field(compare=False)

    @property
    def logprob(self) -> float:
        return float(math.fsum(t.logprob for t in self.tokens))

    @property
    def joint_confidence(self) -> float:
        """Product of the token probabilities (the sequence's calibrated probability)."""
        return math.exp(self.logprob)

    @property
    def sequence_confidence(self) -> float:
        """Length-normalised confidence: the geometric mean of the token probabilities."""
        return math.exp(self.logprob / len(self.tokens)) if self.tokens else 1.0

    @property
    def token_ids(self) -> list[int]:
        return [t.id for t in self.tokens]

    def to_dict(self) -> dict:
        return {"text": self.text, "finish_reason": self.finish_reason,
                "prompt_tokens": self.prompt_tokens,
                "joint_confidence": self.joint_confidence,
                "sequence_confidence": self.sequence_confidence, "logprob": self.logprob,
                "timing": self.timing.to_dict(), "tokens": [t.to_dict() for t in self.tokens]}


@dataclass(frozen=True, eq=False)
class Choice:
    """A multiple-choice answer.

    Attributes:
        probabilities: ``[K]`` calibrated option probabilities (sum to 1).
        prediction: index of the most probable option.
        confidence: its probability.
        scores: ``[K]`` the option scores the softmax ran on, before ``answer_temperature``:
            letter mode the option tokens' logits, cloze mode the variant's log-probability.
        mode: ``"letter"`` or ``"cloze"``.
        variant: cloze scoring variant (``"sum"``, ``"mean"``, ``"char"``; None in letter mode).
        answer_temperature: the temperature applied to the scores (1.0 when none).
        abstained: whether the confidence is below the engine's abstention threshold
            (``calm fit threshold``); ``None`` when the engine has none.
        calibrated_by: what calibrates ``probabilities`` in this mode (the fit, as the
            engine's manifest records it), ``None`` where they are the model's own.
    """

    probabilities: np.ndarray
    prediction: int
    confidence: float
    scores: np.ndarray
    mode: str
    variant: str | None
    answer_temperature: float
    abstained: bool | None = None
    calibrated_by: str | None = None

    def to_dict(self) -> dict:
        return {"probabilities": self.probabilities.tolist(), "prediction": self.prediction,
                "confidence": self.confidence, "scores": self.scores.tolist(),
                "mode": self.mode, "variant": self.variant,
                "answer_temperature": self.answer_temperature, "abstained": self.abstained,
                "calibrated_by": self.calibrated_by}
