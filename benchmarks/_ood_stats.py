"""calm_train_ood's statistics: paired bootstrap deltas over seeds and questions, the
verdicts on them, and whether two readings are the same numbers."""

from __future__ import annotations

import numpy as np

from calm_runtime.measure import metrics

__all__ = ["ACC_MARGIN", "BINS", "DETECTS", "ECE_MARGIN", "identical", "paired_delta", "sides",
           "verdict"]

BINS = 10
ECE_MARGIN = 0.01
ACC_MARGIN = 0.03
#: 80% power at two-sided 5%: z_0.975 + z_0.8
DETECTS = 1.96 + 0.84


def _metric(q: dict, metric: str, idx: np.ndarray) -> float:
    conf = np.asarray(q["conf"])[idx]
    correct = np.asarray(q["correct"], float)[idx]
    if metric == "ece":
        return float(metrics.ece(conf, correct, BINS))
    if metric == "accuracy":
        return float(correct.mean())
    if metric == "over_confidence":
        return float(conf.mean() - correct.mean())
    raise ValueError(metric)


def sides(parts: dict, reading: str) -> list[dict]:
    """The per-seed set readings of ``reading`` (vanilla's one reading for every seed)."""
    if reading.startswith("vanilla"):
        return [parts["vanilla"]["sets"]] * max(1, len(parts["seeds"]))
    return [run["sets"] for run in parts["seeds"].values()]


def paired_delta(a: list[dict], b: list[dict], sets: list[str], metric: str, name_a: str,
                 name_b: str, n_boot: int, seed: int = 0) -> dict:
    """Δ = metric(a) − metric(b), question-weighted over ``sets``, with its basic bootstrap
    interval (seeds resampled with one index for both sides, then questions): ``2Δ − q97.5``
    to ``2Δ − q2.5``. Unlike the percentile interval, whose skew a wide bootstrap
    distribution can carry inside a margin, a basic interval's verdict does not improve as
    the resampling gets less precise."""
    rng = np.random.default_rng(seed)
    n_seeds = len(a)
    sizes = {s: len(a[0][s]["readings"][name_a]["conf"]) for s in sets}
    total = sum(sizes.values())

    def delta(seed_idx, question_idx) -> float:
        out = 0.0
        for s in sets:
            idx = question_idx[s]
            va = np.mean([_metric(a[i][s]["readings"][name_a], metric, idx) for i in seed_idx])
            vb = np.mean([_metric(b[i][s]["readings"][name_b], metric, idx) for i in seed_idx])
            out += (va - vb) * sizes[s] / total
        return out

    point = delta(range(n_seeds), {s: np.arange(n) for s, n in sizes.items()})
    draws = np.array([delta(rng.integers(0, n_seeds, n_seeds),
                            {s: rng.integers(0, n, n) for s, n in sizes.items()})
                      for _ in range(n_boot)])
    q_lo, q_hi = np.percentile(draws, [2.5, 97.5])
    lo, hi = 2 * point - q_hi, 2 * point - q_lo
    return {"delta": float(point), "ci": [float(lo), float(hi)],
            "detects": float(DETECTS * draws.std(ddof=1)), "n": total, "seeds": n_seeds,
            "interval": "basic bootstrap, paired (seeds, then questions)"}


def verdict(metric: str, lo: float, hi: float) -> str:
    if metric == "accuracy":
        return "holds" if lo > -ACC_MARGIN else "refuted" if hi < -ACC_MARGIN else "inconclusive"
    if lo > 0 or (lo > -ECE_MARGIN and hi < ECE_MARGIN):
        return "refuted"
    return "holds" if hi < 0 else "inconclusive"


def identical(side_a: list[dict], side_b: list[dict], sets: list[str], a: str, b: str) -> bool:
    """The two readings are the same numbers on every seed and set (nothing to compare: the
    gate dropped what would tell them apart)."""
    def same(qa: dict, qb: dict) -> bool:  # equal up to float rounding of the same math
        return (qa["correct"] == qb["correct"]
                and np.allclose(qa["conf"], qb["conf"], rtol=0, atol=1e-5))
    return all(same(x[s]["readings"][a], y[s]["readings"][b])
               for x, y in zip(side_a, side_b, strict=True) for s in sets)
