"""The do-no-harm gate of ``calm train`` (docs/methods.md §4): one rule for each part that
calibrates the trained LoRA — α (τ, l) and then the temperature T.

The gate reads training questions held out of training (``CalmConfig.holdout``). The hold-out
is drawn once and cut in two halves (:func:`gate_halves`): the first decides, the second only
reports, so the readings ``calm train`` prints and records ("with α", "with T") rest on
questions that did not choose what they read. A part is kept when, on the deciding half,

* T (superiority): it lowers the NLL by more than the half-width of the paired 95% interval
  of the change (Student's t with n − 1 degrees of freedom: :func:`paired_interval`);
  α (non-inferiority: its claim is out of domain): the upper end of that interval stays
  below :data:`NLL_MARGIN`; and for both
* the paired 95% interval of its accuracy change lies above ``-ACCURACY_MARGIN``
  (non-inferiority; open-QA hold-outs, which have no options, have no accuracy to keep).

Otherwise the part is dropped (α: the identity; T: 1) and the record says why, with the
numbers the decision read. The default hold-out (400 questions, 200 deciding) is refused when
the training data cannot give it (``data.holdout_size``); a smaller one, asked for as a share
or a count, below :data:`MIN_DECIDING` deciding questions is reported as such: its interval
is wide and it keeps a part only when the part's effect is large.
"""

from __future__ import annotations

import logging
import math

import numpy as np

from calm_runtime.data.sets import MultipleChoiceRecord
from calm_training.methods.calm import data as calm_data

__all__ = ["ACCURACY_MARGIN", "CONFIDENCE", "HALVES_SEED", "MIN_DECIDING", "NLL_MARGIN",
           "RULES", "decide_part",
           "gate_halves", "held_out", "paired_interval", "t_quantile"]

logger = logging.getLogger(__name__)

#: the accuracy a part may cost (the lower end of its paired 95% interval) and still be kept:
#: 3 points, the margin the benchmarks' "accuracy kept" verdicts use
ACCURACY_MARGIN = 0.03
#: the held-out NLL α may add (the upper end of its paired 95% interval, nats per question)
#: and still be kept: α's claim is out of domain, so in domain it must only not harm
#: (non-inferiority), not improve. A margin stated before any run read it: about 2% of the
#: held-out option NLL of the recorded SmolLM2 runs (0.9–1.3 nats), not tuned to a result
NLL_MARGIN = 0.02
#: two-sided confidence of every interval the gate reads
CONFIDENCE = 0.95
#: deciding questions below which the manifest and the last line say the gate is weak
MIN_DECIDING = 200
#: seed of the hold-out's cut into a deciding and a reporting half
HALVES_SEED = 3


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        step = d * c
        h *= step
        if abs(step - 1.0) < 1e-15:
            break
    return h


def _incomplete_beta(a: float, b: float, x: float) -> float:
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                     + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def _t_cdf(t: float, df: int) -> float:
    tail = 0.5 * _incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (``0.5 < p < 1``),
    by bisection on its distribution function (the incomplete beta function)."""
    if not 0.5 < p < 1 or df < 1:
        raise ValueError(f"t_quantile needs 0.5 < p < 1 and df >= 1, got {p}, {df}")
    lo, hi = 0.0, 1.0
    while _t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if _t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12:
            break
    return 0.5 * (lo + hi)


def paired_interval(diff) -> tuple[float, float | None]:
    """``(mean, half-width)`` of the paired 95% t-interval of the per-question differences
    ``diff``; half-width ``None`` when there is none (fewer than 2 questions, or a
    non-finite difference)."""
    diff = np.asarray(diff, dtype=float)
    n = diff.size
    if n == 0:
        return float("nan"), None
    mean = float(diff.mean())
    if n < 2 or not np.isfinite(diff).all():
        return mean, None
    q = t_quantile(0.5 + CONFIDENCE / 2.0, n - 1)
    return mean, float(q * diff.std(ddof=1) / math.sqrt(n))


def gate_halves(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices of the deciding and of the reporting half of a hold-out of ``n`` questions:
    a permutation seeded by :data:`HALVES_SEED` (the hold-out itself is in file order), its
    first ``ceil(n / 2)`` decide, the rest report; each half sorted."""
    order = np.random.default_rng(HALVES_SEED).permutation(n)
    cut = (n + 1) // 2
    return np.sort(order[:cut]), np.sort(order[cut:])


#: how a part is decided: ``superiority`` (it must lower the held-out NLL beyond its
#: interval: T, whose claim is in domain) or ``non-inferiority`` (the upper end of its NLL
#: change's interval must stay below :data:`NLL_MARGIN`: α, whose claim is out of domain)
RULES = ("superiority", "non-inferiority")


def decide_part(name: str, nll_with, nll_without, correct_with=None,
                correct_without=None, *, rule: str = "superiority") -> dict:
    """Keep the part ``name`` (``"alpha"`` or ``"T"``) or not, from per-question NLLs (and,
    for multiple choice, correctness) on the deciding questions with and without it, by
    ``rule`` (:data:`RULES`); either way its accuracy change must stay above
    ``-ACCURACY_MARGIN``.

    Returns ``{"kept", "reason", "n", "nll_change", "nll_change_half_width",
    "accuracy_change", "accuracy_change_interval", "weak"}``; ``reason`` is one sentence
    with the numbers."""
    nll_with, nll_without = np.asarray(nll_with, float), np.asarray(nll_without, float)
    n = int(nll_with.size)
    change, half = paired_interval(nll_with - nll_without)
    record = {"part": name, "n": n, "nll_without": float(nll_without.mean()) if n else None,
              "nll_with": float(nll_with.mean()) if n else None, "nll_change": change,
              "nll_change_half_width": half, "interval": "paired 95% Student t",
              "weak": n < MIN_DECIDING}
    interval = "" if half is None else f" ± {half:.4f}"
    facts = (f"deciding NLL {record['nll_without']:.4f} -> {record['nll_with']:.4f} "
             f"({change:+.4f}{interval}) on {n} held-out questions" if n else
             "no held-out question")
    accuracy_ok = True
    if correct_with is not None:
        a = np.asarray(correct_with, float) - np.asarray(correct_without, float)
        acc_change, acc_half = paired_interval(a)
        if acc_half is None:
            acc_lo = acc_hi = acc_change
        else:
            acc_lo, acc_hi = acc_change - acc_half, acc_change + acc_half
        record |= {"accuracy_without": float(np.mean(correct_without)),
                   "accuracy_with": float(np.mean(correct_with)),
                   "accuracy_change": acc_change,
                   "accuracy_change_interval": [acc_lo, acc_hi],
                   "correctness_changes": int(np.sum(a != 0))}
        facts += (f", accuracy {record['accuracy_without']:.3f} -> "
                  f"{record['accuracy_with']:.3f} ({acc_change:+.3f} "
                  f"[{acc_lo:+.3f}, {acc_hi:+.3f}])")
        accuracy_ok = math.isfinite(acc_lo) and acc_lo > -ACCURACY_MARGIN
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    record["rule"] = rule
    lowers = math.isfinite(change) and change < 0
    if rule == "superiority":
        clears = lowers and half is not None and -change > half
    else:
        clears = (math.isfinite(change) and half is not None
                  and change + half < NLL_MARGIN)
        record["nll_margin"] = NLL_MARGIN
    if clears and accuracy_ok:
        why = (f"{name} kept: it lowers the {facts}" if rule == "superiority" else
               f"{name} kept: not worse in domain (NLL change below +{NLL_MARGIN:g}): {facts}")
    elif rule == "non-inferiority":
        because = ("its accuracy change's 95% interval reaches below "
                   f"-{ACCURACY_MARGIN:.2f}" if clears else
                   "its NLL change has no interval (fewer than 2 questions or an infinite "
                   "NLL)" if half is None else
                   f"its NLL change's 95% interval reaches above +{NLL_MARGIN:g}")
        why = f"{name} dropped: {because}: {facts}"
    else:
        if clears:
            because = (f"its accuracy change's 95% interval reaches below "
                       f"-{ACCURACY_MARGIN:.2f}")
        elif lowers and half is None:
            because = "its NLL gain has no interval (fewer than 2 questions or an infinite NLL)"
        elif lowers:
            because = "its NLL gain is within the paired 95% interval"
        else:
            because = "it does not lower the held-out NLL"
        why = f"{name} dropped: {because}: {facts}"
    if record["weak"]:
        why += f" (fewer than {MIN_DECIDING} deciding questions: a weak gate)"
    return {**record, "kept": bool(clears and accuracy_ok), "reason": why}


def held_out(config, train: list, has_alpha: bool, encode: dict) -> tuple[tuple, list]:
    """The gate's hold-out of ``calm train`` and the training records left:
    ``((records, deciding examples, kind, info), train)``. ``kind`` is ``"options"``
    (multiple choice) or ``"answers"`` (open QA); the examples, encoded with ``encode`` for α's
    measurement, are the deciding half's. Nothing is held out when there is no part to gate
    (no α and no T) or ``config.holdout`` is 0. A method's α-frozen control
    (``--set freeze_alpha=true``) holds out the same questions, so that the two train on the same
    data."""
    if not ((has_alpha or config.daca) and config.holdout):
        return (None, None, None, None), train
    held, train = calm_data.holdout_split(train, config.holdout)
    deciding, reporting = gate_halves(len(held))
    decide = [held[i] for i in deciding]
    examples = kind = None
    if has_alpha and all(isinstance(r, MultipleChoiceRecord) for r in held):
        examples = calm_data.encode_labeled_options(decide, **encode,
                                                    variant=config.cloze_variant)
        kind = "options"
    elif has_alpha:  # open QA: the answers' token NLL, no options to compare
        examples, kind = calm_data.encode_training(decide, **encode), "answers"
    info = {"asked": config.holdout, "n": len(held), "deciding": len(deciding),
            "reporting": len(reporting), "seed": calm_data.HOLDOUT_SEED,
            "n_train_left": len(train)}
    if len(deciding) < MIN_DECIDING:
        logger.warning("the gate's hold-out is %d of the %d training questions (--holdout %s): "
                       "α and T are decided on %d of them, fewer than %d: a weak gate; give "
                       "more training data for one with power", len(held),
                       len(held) + len(train), f"{config.holdout:g}", len(deciding),
                       MIN_DECIDING)
    return (held, examples, kind, info), train
