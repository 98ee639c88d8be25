"""α's own effect on the hold-out's deciding half, measured before a ``calm train`` adapter
is written (docs/methods.md §4); :mod:`calm_training.methods.calm.gate` decides from it.

The trained θ is read on training questions held out of training twice: with the learned α
and with α at the identity, with measures that see a reordering as well as a softening —
option NLL and accuracy (the questions have labels), answers whose prediction changes
(``flips``) and whose correctness changes, total variation and KL between the two option
distributions, and the change of mean option entropy — kept per question
(``share["questions"]``) for the gate's paired intervals. Open-QA hold-outs have no options:
the per-answer NLL of their tokens.
"""

from __future__ import annotations

import numpy as np

__all__ = ["measure_alpha_share", "measure_answer_nll", "option_share"]

def measure_alpha_share(model, examples, pad_id: int, batch_size: int) -> dict:
    """Option measures of ``model``'s α on labeled option ``examples`` (the hold-out;
    ``calm_data.encode_labeled_options``): with α against the same θ without it."""
    import torch

    from calm_training.methods.calm import data as calm_data
    from calm_training.methods.calm.model import option_log_probs, stack_option_rows

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
    """Open-QA hold-outs (no options to compare): the NLL of each answer's tokens (its mean
    per token; the lower level's cross-entropy, ``calm_data.encode_training`` examples) with
    α and without it."""
    import torch

    from calm_training.methods.calm import data as calm_data

    theta = [t.detach() for t in model.theta]
    alpha = [a.detach() for a in model.alpha]
    identity = [a.new_zeros(a.shape) for a in alpha]
    per = {"alpha": [], "without": []}
    with torch.no_grad():
        for example in examples:  # one at a time: each answer's own mean token NLL
            batch = calm_data.collate([example], 1, pad_id).to(model.theta[0].device)
            for key, a in (("alpha", alpha), ("without", identity)):
                per[key].append(float(model.loss(theta, a, batch, "ce")))
    nll_a, nll_b = np.asarray(per["alpha"]), np.asarray(per["without"])
    return {"n": len(examples), "nll_alpha": float(nll_a.mean()),
            "nll_without": float(nll_b.mean()), "nll_change": float((nll_a - nll_b).mean()),
            "measured_on": "answer tokens",
            "questions": {"nll_alpha": np.round(nll_a, 6).tolist(),
                          "nll_without": np.round(nll_b, 6).tolist()}}


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
    return {"n": int(n), "nll_alpha": nll_a, "nll_without": nll_b, "nll_change": nll_a - nll_b,
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
