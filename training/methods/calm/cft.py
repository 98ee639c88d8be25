"""Calibration-aware fine-tuning (CFT), the training-time baseline of CALM (docs/methods.md §4,
"CFT").

The objective, on labeled multiple-choice questions, is

    L = (1 − w) · CE + w · c · L_cal

* ``CE``: cross-entropy on the correct answer's tokens (its text in cloze mode, its letter
  in letter mode), the same per-token mean as CALM's lower level.
* ``L_cal``: over the K-option distribution ``p`` the evaluation reads (cloze scores of the
  recorded variant, or the letters' softmax), each question in confidence bin ``b``
  (``B`` equal-width bins of ``max p``) adds

      [(p_max − acc_b)² + Σ_j (p_(j) − t_j)²] / N_b

  where ``acc_b`` and ``N_b`` are bin ``b``'s accuracy and size on the whole training split,
  estimated once before training (:func:`estimate_bins`), ``p_(j)`` are the other options'
  probabilities and ``t_j = a · tanh(γ p_(j)) + a`` with ``γ = log(K − 1) / (p_(2) (1 − acc_b))``
  (``p_(2)`` the second largest) and ``a = (1 − acc_b) / (Σ_j tanh(γ p_(j)) + K − 1)``: the
  other options share ``1 − acc_b`` in the order they had (``t_j = 0`` when ``acc_b = 1``).
* ``w`` (``cft_weight``, 0.5) and ``c`` (``cft_scale``, 1e-3) are the defaults of the
  authors' published trainer. The targets are not detached, as there.

Where calm differs from that code (docs/methods.md §4 names each): every bin is
regularised (its loop leaves out the top one, confidence ≥ 0.9); a bin that held no training
question at estimation time has no accuracy and adds nothing (its code divides by 0); K is
the question's option count (the code fixes four letters, log 3 and 3 = K − 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from calm_runtime.errors import ConfigError

__all__ = ["CftBins", "bin_index", "cft_loss", "estimate_bins", "other_targets"]


@dataclass(frozen=True)
class CftBins:
    """Per-bin accuracy and size of the training split before training (the E-step)."""

    accuracy: tuple[float, ...]
    count: tuple[int, ...]

    @property
    def bins(self) -> int:
        return len(self.count)

    def to_dict(self) -> dict:
        return {"accuracy": list(self.accuracy), "count": list(self.count)}


def bin_index(conf, bins: int):
    """Equal-width bin of each confidence: ``floor(conf · bins)``, 1.0 in the top bin.

    Bins are closed on the left, as in the published trainer (``bucketize(right=True)``);
    ``calm_runtime.measure.metrics.reliability_bins`` closes them on the right, as ECE reads them.
    The estimate and the loss both use this one rule, so a question on an edge sits in the
    same bin in both."""
    if isinstance(conf, torch.Tensor):
        return (conf * bins).floor().long().clamp(0, bins - 1)
    return np.clip(np.floor(np.asarray(conf) * bins).astype(np.int64), 0, bins - 1)


def estimate_bins(probs: np.ndarray, labels: np.ndarray, bins: int) -> CftBins:
    """Bin accuracies and sizes from option probabilities ``[N, K]`` and labels ``[N]``."""
    probs, labels = np.asarray(probs, float), np.asarray(labels)
    if probs.ndim != 2 or probs.shape[0] != labels.size or labels.size == 0:
        raise ConfigError(f"CFT needs option probabilities [N, K] and N labels, got "
                          f"{probs.shape} and {labels.shape}; check the training data")
    index = bin_index(probs.max(axis=1), bins)
    correct = probs.argmax(axis=1) == labels
    count = np.bincount(index, minlength=bins)
    right = np.bincount(index, weights=correct.astype(float), minlength=bins)
    accuracy = np.divide(right, count, out=np.zeros(bins), where=count > 0)
    return CftBins(tuple(float(a) for a in accuracy), tuple(int(c) for c in count))


def other_targets(others, acc, present):
    """``t_j`` for the non-top probabilities ``others`` ``[E, K−1]`` (descending; absent
    options are 0 where ``present`` is False) of questions whose bin accuracy is ``acc`` [E]."""
    k_minus_1 = present.sum(-1, keepdim=True).to(others.dtype)
    acc = acc[:, None].to(others.dtype)
    spare = 1.0 - acc
    # γ·p_(j) = log(K − 1) / (1 − acc) · p_(j) / p_(2), read as 0 when p_(2) = 0 (the clamps
    # only keep the branches that torch.where discards finite, so that no NaN reaches a
    # gradient; acc = 1 is the zero target below)
    second = others[:, :1]
    ratio = torch.where(second > 0, others / second.clamp(min=torch.finfo(others.dtype).tiny),
                        torch.zeros_like(others))
    gamma = torch.log(k_minus_1.clamp(min=1.0)) / spare.clamp(min=1e-12)
    shaped = torch.tanh(gamma * ratio) * present
    a = spare / (shaped.sum(-1, keepdim=True) + k_minus_1)
    return torch.where(acc >= 1.0, torch.zeros_like(others), (a * shaped + a) * present)


def cft_loss(option_logp, answer_ce, labels_present, bins: CftBins, *, weight: float,
             scale: float, weights, global_batch: int):
    """The CFT loss of one batch and its two parts ``(loss, ce, l_cal)``.

    ``option_logp`` ``[E, K]`` (``-inf`` where an option is absent), ``answer_ce`` ``[E]``
    (the per-token mean CE on each question's answer), ``labels_present`` the option mask
    ``[E, K]``; ``weights`` ``[E]`` is ``1 / examples`` of the rank's share of the global
    batch. ``L_cal`` is ``Σ_i term_i / N_b`` over the global batch: each rank adds its terms
    times ``global_batch · weights`` (the number of ranks), so that the mean over
    data-parallel ranks reproduces it.
    """
    probs = option_logp.exp()
    ordered, _ = probs.sort(-1, descending=True)
    top, others = ordered[:, 0], ordered[:, 1:]
    present = (torch.arange(others.shape[1], device=others.device)[None, :]
               < (labels_present.sum(-1, keepdim=True) - 1))
    index = bin_index(top.detach(), bins.bins)
    acc = torch.as_tensor(bins.accuracy, dtype=probs.dtype, device=probs.device)[index]
    count = torch.as_tensor(bins.count, dtype=probs.dtype, device=probs.device)[index]
    targets = other_targets(others, acc, present)
    term = (top - acc) ** 2 + (((others - targets) * present) ** 2).sum(-1)
    known = count > 0
    per = torch.where(known, term / count.clamp(min=1.0), torch.zeros_like(term))
    share = weights.to(probs.dtype) * global_batch
    l_cal = (per * share).sum()
    ce = (answer_ce * weights.to(answer_ce.dtype)).sum()
    return (1.0 - weight) * ce + weight * scale * l_cal, ce, l_cal

