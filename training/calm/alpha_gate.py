"""α's own effect, measured before a CALM adapter is written (docs/methods.md §4).

The trained θ is read on training questions held out of training
(``CalmConfig.alpha_holdout``) twice: with the learned α and with α at the identity. What α
does there is measured with measures that see a reordering as well as a softening —
option NLL and accuracy (the questions have labels), answers whose prediction changes
(``flips``) and whose correctness changes, total variation and KL between the two option
distributions, and the change of mean option entropy. :func:`decide` keeps α only when it
lowers the held-out NLL; otherwise the adapter carries the identity and says why.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["measure_alpha_share", "measure_answer_nll", "option_share", "decide"]


def measure_alpha_share(model, examples, pad_id: int, batch_size: int) -> dict:
    """Option measures of ``model``'s α on labeled option ``examples`` (the hold-out;
    ``calm_data.encode_labeled_options``): with α against the same θ without it."""
    import torch

    from calm_training.calm import data as calm_data
    from calm_training.calm.model import option_log_probs

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
    return option_share(np.stack(with_alpha), np.stack(without), np.asarray(labels))


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

    nll_a = float(-logp_alpha[rows, labels].mean())
    nll_b = float(-logp_base[rows, labels].mean())
    return {"n": int(n), "nll_alpha": nll_a, "nll_without": nll_b, "nll_change": nll_a - nll_b,
            "accuracy_alpha": float(right_a.mean()), "accuracy_without": float(right_b.mean()),
            "flips": int((pred_a != pred_b).sum()),
            "correctness_flips": int((right_a != right_b).sum()),
            "total_variation": float(0.5 * np.abs(p_a - p_b).sum(1).mean()),
            "kl_without_to_alpha": float(kl.mean()),
            "entropy_change": entropy(p_a, logp_alpha) - entropy(p_b, logp_base)}


def decide(share: dict | None) -> tuple[bool, str]:
    """``(keep α, why)``: α is kept only when it lowers the held-out option NLL."""
    if share is None:
        return True, "no hold-out (alpha_holdout 0): α written as trained, unmeasured"
    change = share["nll_change"]
    facts = (f"held-out NLL {share['nll_without']:.4f} -> {share['nll_alpha']:.4f} "
             f"({change:+.4f}) on {share['n']} questions")
    if "flips" in share:
        facts += (f", {share['flips']} answers changed, accuracy "
                  f"{share['accuracy_without']:.3f} -> {share['accuracy_alpha']:.3f}, "
                  f"TV {share['total_variation']:.4f}")
    else:
        facts += f" ({share.get('measured_on', 'answer tokens')})"
    if math.isfinite(change) and change < 0:
        return True, f"alpha kept: it lowers the {facts}"
    return False, (f"alpha not written (identity instead): it does not lower the {facts}")
