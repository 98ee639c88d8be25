"""α's own effect, measured before a CALM adapter is written (docs/methods.md §4).

The trained θ is read on training questions held out of training
(``CalmConfig.alpha_holdout``) twice: with the learned α and with α at the identity. What α
does there is measured with measures that see a reordering as well as a softening —
option NLL and accuracy (the questions have labels), answers whose prediction changes
(``flips``) and whose correctness changes, total variation and KL between the two option
distributions, and the change of mean option entropy. :func:`decide` keeps α only when it
lowers the held-out NLL by more than the half-width of the paired 95% interval of that
change (:data:`NLL_Z`) and the held-out accuracy does not fall by more than
:data:`ACCURACY_MARGIN`; otherwise the adapter carries the identity and says why. The
per-question arrays the decision read are kept with it (``share["questions"]``).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["ACCURACY_MARGIN", "NLL_Z", "measure_alpha_share", "measure_answer_nll",
           "option_share", "decide"]

#: the held-out accuracy α may cost and still be written (3 points: the margin the
#: benchmarks' "accuracy kept" verdicts use)
ACCURACY_MARGIN = 0.03
#: the normal quantile of the paired interval of α's held-out NLL change (95%, two-sided):
#: an improvement smaller than the interval's half-width is within the noise of the
#: hold-out and is not written
NLL_Z = 1.96


def measure_alpha_share(model, examples, pad_id: int, batch_size: int) -> dict:
    """Option measures of ``model``'s α on labeled option ``examples`` (the hold-out;
    ``calm_data.encode_labeled_options``): with α against the same θ without it."""
    import torch

    from calm_training.calm import data as calm_data
    from calm_training.calm.model import option_log_probs, stack_option_rows

    theta = [t.detach() for t in model.theta]
    alpha = [a.detach() for a in model.alpha]
    identity = [a.new_zeros(a.shape) for a in alpha]
    with_alpha, without, labels = [], [], []
    with torch.no_grad():
        for start in range(0, len(examples), batch_size):
            chunk = examples[start:start + batch_size]
            batch = calm_data.collate(chunk, len(chunk), pad_id).to(model.theta[0].device)
            z = model.logits(theta, batch)
            for out, a in ((with_alpha, alpha), (without, identity)):
                logp = model.calibrate(z, a).log_softmax(-1)
                out += list(option_log_probs(logp, batch).double().cpu().numpy())
            labels += batch.labels.tolist()
    return option_share(stack_option_rows(with_alpha, -np.inf),
                        stack_option_rows(without, -np.inf), np.asarray(labels))


def measure_answer_nll(model, examples, pad_id: int, batch_size: int) -> dict:
    """Open-QA hold-outs (no options to compare): the mean NLL of the answers' tokens
    (the lower level's cross-entropy, ``calm_data.encode_training`` examples) with α and
    without it."""
    import torch

    from calm_training.calm import data as calm_data

    theta = [t.detach() for t in model.theta]
    alpha = [a.detach() for a in model.alpha]
    identity = [a.new_zeros(a.shape) for a in alpha]
    totals = {"alpha": 0.0, "without": 0.0}
    with torch.no_grad():
        for start in range(0, len(examples), batch_size):
            chunk = examples[start:start + batch_size]
            batch = calm_data.collate(chunk, len(examples), pad_id).to(model.theta[0].device)
            for key, a in (("alpha", alpha), ("without", identity)):
                totals[key] += float(model.loss(theta, a, batch, "ce"))
    return {"n": len(examples), "nll_alpha": totals["alpha"], "nll_without": totals["without"],
            "nll_change": totals["alpha"] - totals["without"], "measured_on": "answer tokens"}


def option_share(logp_alpha: np.ndarray, logp_base: np.ndarray, labels: np.ndarray) -> dict:
    """The measures of the module docstring from option log-probabilities ``[N, K]``
    (``-inf`` where an option is absent) with and without α."""
    n = labels.size
    rows = np.arange(n)
    p_a, p_b = np.exp(logp_alpha), np.exp(logp_base)
    pred_a, pred_b = p_a.argmax(1), p_b.argmax(1)
    right_a, right_b = pred_a == labels, pred_b == labels
    finite = np.isfinite(logp_alpha) & np.isfinite(logp_base)
    kl = np.where(finite, p_b * (np.where(finite, logp_base, 0) - np.where(finite, logp_alpha, 0)),
                  0.0).sum(1)

    def entropy(p, logp):
        return float(-np.where(finite, p * np.where(finite, logp, 0), 0.0).sum(1).mean())

    per_a, per_b = -logp_alpha[rows, labels], -logp_base[rows, labels]
    nll_a, nll_b = float(per_a.mean()), float(per_b.mean())
    diff = per_a - per_b
    # None: no interval (one question, or an infinite NLL)
    half = (float(NLL_Z * diff.std(ddof=1) / math.sqrt(n)) if n > 1 and np.isfinite(diff).all()
            else None)
    return {"n": int(n), "nll_alpha": nll_a, "nll_without": nll_b, "nll_change": nll_a - nll_b,
            "nll_change_half_width": half,
            "questions": {"nll_alpha": np.round(per_a, 6).tolist(),
                          "nll_without": np.round(per_b, 6).tolist(),
                          "correct_alpha": right_a.astype(int).tolist(),
                          "correct_without": right_b.astype(int).tolist()},
            "accuracy_alpha": float(right_a.mean()), "accuracy_without": float(right_b.mean()),
            "flips": int((pred_a != pred_b).sum()),
            "correctness_flips": int((right_a != right_b).sum()),
            "total_variation": float(0.5 * np.abs(p_a - p_b).sum(1).mean()),
            "kl_without_to_alpha": float(kl.mean()),
            "entropy_change": entropy(p_a, logp_alpha) - entropy(p_b, logp_base)}


def decide(share: dict | None) -> tuple[bool, str]:
    """``(keep α, why)``: α is kept only when it lowers the held-out option NLL by more than
    its paired interval's half-width and costs at most :data:`ACCURACY_MARGIN` of held-out
    accuracy (an open-QA hold-out, which has no per-question options: when it lowers the
    answers' NLL)."""
    if share is None:
        return True, "no hold-out (alpha_holdout 0): α written as trained, unmeasured"
    change = share["nll_change"]
    paired = "nll_change_half_width" in share  # option hold-outs; open QA has no pairs
    half = share.get("nll_change_half_width")
    interval = "" if half is None else f" ± {half:.4f}"
    facts = (f"held-out NLL {share['nll_without']:.4f} -> {share['nll_alpha']:.4f} "
             f"({change:+.4f}{interval}) on {share['n']} questions")
    if "flips" in share:
        facts += (f", {share['flips']} answers changed, accuracy "
                  f"{share['accuracy_without']:.3f} -> {share['accuracy_alpha']:.3f}, "
                  f"TV {share['total_variation']:.4f}")
    else:
        facts += f" ({share.get('measured_on', 'answer tokens')})"
    lowers = math.isfinite(change) and change < 0
    clears = lowers and (not paired or (half is not None and -change > half))
    accuracy_drop = (share["accuracy_without"] - share["accuracy_alpha"]
                     if "accuracy_alpha" in share else 0.0)
    if clears and accuracy_drop <= ACCURACY_MARGIN:
        return True, f"alpha kept: it lowers the {facts}"
    if clears:
        why = f"it costs more than {ACCURACY_MARGIN:.2f} of held-out accuracy"
    elif lowers and half is None:
        why = "its held-out NLL gain has no interval (fewer than 2 questions or an infinite NLL)"
    elif lowers:
        why = "its held-out NLL gain is within the paired 95% interval"
    else:
        why = "it does not lower the held-out NLL"
    return False, f"alpha not written (identity instead): {why}: {facts}"
