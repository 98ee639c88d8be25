"""The decisive CALM experiment's statistics (benchmarks/calm_decisive.py): the paired bootstrap,
the verdict rule fixed before the runs, and the claims of each round."""

from __future__ import annotations

import numpy as np
from _decisive_design import (
    ACC_MARGIN,
    DOMAIN,
    ECE_MARGIN,
    NLL_MARGIN,
    OOD,
    ROUND2_ARMS,
    ROUND2_CONTROL,
    SEEDS,
    SHIPPED,
)

from calm_runtime.measure import metrics


# ---------------------------------------------------------------------------- decisions
def _arrays(part: dict, set_name: str, variant: str) -> dict:
    q = part["sets"][set_name]["variants"][variant]["questions"]
    return {k: np.asarray(v, float) for k, v in q.items()}


def _metric(a: dict, metric: str, idx: np.ndarray, bins: int) -> float:
    if metric == "ece":
        return float(metrics.ece(a["conf"][idx], a["correct"][idx], bins))
    if metric == "accuracy":
        return float(a["correct"][idx].mean())
    return float(a[metric][idx].mean())


def paired_delta(side_a: list[dict], side_b: list[dict], sets: list[str], metric: str,
                 n_boot: int, bins: int = 10, seed: int = 0) -> dict:
    """Δ = metric(a) − metric(b): point estimate and 95% interval (module docstring).

    ``side_a`` and ``side_b`` are per-seed lists of ``{set: arrays}``; a side with one
    element is used as is in every resample, two sides of equal length are paired by index.
    """
    rng = np.random.default_rng(seed)
    n = {s: side_a[0][s]["conf"].size for s in sets}
    weights = np.array([n[s] for s in sets], float) / sum(n.values())

    def estimate(seeds_a, seeds_b, questions):
        deltas = []
        for s in sets:
            idx = questions[s]
            ma = np.mean([_metric(side_a[i][s], metric, idx, bins) for i in seeds_a])
            mb = np.mean([_metric(side_b[i][s], metric, idx, bins) for i in seeds_b])
            deltas.append(ma - mb)
        return float(np.dot(weights, deltas))

    everything = {s: np.arange(n[s]) for s in sets}
    point = estimate(range(len(side_a)), range(len(side_b)), everything)
    paired = len(side_a) == len(side_b)
    draws = []
    for _ in range(n_boot):
        sa = rng.integers(0, len(side_a), len(side_a))
        sb = sa if paired else rng.integers(0, len(side_b), len(side_b))
        questions = {s: rng.integers(0, n[s], n[s]) for s in sets}
        draws.append(estimate(sa, sb, questions))
    lo, hi = np.percentile(draws, [2.5, 97.5])
    # the smallest difference this design finds with 80% power at two-sided 5%
    detects = float((1.96 + 0.84) * np.std(draws, ddof=1)) if n_boot > 1 else None
    return {"delta": point, "ci": [float(lo), float(hi)], "seeds": [len(side_a), len(side_b)],
            "n": int(sum(n.values())), "detects": detects}


def verdict(kind: str, lo: float, hi: float) -> str:
    if kind == "ece":
        inside = -ECE_MARGIN < lo and hi < ECE_MARGIN
        if lo > 0 or inside:
            return "refuted"
        return "holds" if hi < 0 else "inconclusive"
    if kind == "kept":
        return "holds" if lo > -ACC_MARGIN else "refuted" if hi < -ACC_MARGIN else "inconclusive"
    if kind == "collapses":
        return "holds" if hi < -ACC_MARGIN else "refuted" if lo > -ACC_MARGIN else "inconclusive"
    if kind == "nll":  # an improvement: as ECE, with NLL's margin
        if lo > 0 or (-NLL_MARGIN < lo and hi < NLL_MARGIN):
            return "refuted"
        return "holds" if hi < 0 else "inconclusive"
    if kind == "no-harm":  # non-inferiority: NLL rises by less than the margin
        return "holds" if hi <= NLL_MARGIN else "refuted" if lo > NLL_MARGIN else "inconclusive"
    raise ValueError(kind)


def claims(parts: dict, default: str | None, n_boot: int, bins: int) -> list[dict]:
    """The paper's claims (and α's own share), each with its verdict and interval."""
    vanilla = parts.get("vanilla")
    ood = [s for s in OOD if vanilla and not
           vanilla["sets"][s]["variants"]["alpha"]["summary"]["near_chance"]]

    def side(arm, variant, sets):
        found = [parts[f"{arm}-s{s}"] for s in SEEDS if f"{arm}-s{s}" in parts] \
            if arm != "vanilla" else ([vanilla] if vanilla else [])
        return [{s: _arrays(p, s, variant) for s in sets} for p in found]

    specs = [
        ("OOD conf-ECE below lora-matched, TS on both", "ece", "ece", (default, "alpha+ts"),
         ("lora-matched", "alpha+ts"), ood),
        ("OOD conf-ECE below vanilla, TS on both", "ece", "ece", (default, "alpha+ts"),
         ("vanilla", "alpha+ts"), ood),
        ("OOD conf-ECE below lora-matched (no TS)", "ece", "ece", (default, "alpha"),
         ("lora-matched", "alpha"), ood),
        ("α's own share: OOD ECE with α below the same θ without α", "ece", "ece",
         (default, "alpha"), (default, "no-alpha"), ood),
        ("α's own share: OOD NLL with α below the same θ without α", "nll", "nll",
         (default, "alpha"), (default, "no-alpha"), ood),
        ("accuracy kept in domain (vs lora-matched)", "kept", "accuracy", (default, "alpha"),
         ("lora-matched", "alpha"), [DOMAIN]),
        ("accuracy kept out of domain (vs lora-matched)", "kept", "accuracy",
         (default, "alpha"), ("lora-matched", "alpha"), ood),
        ("in domain: ECE below vanilla", "ece", "ece", (default, "alpha"), ("vanilla", "alpha"),
         [DOMAIN]),
        ("in domain: accuracy kept vs vanilla", "kept", "accuracy", (default, "alpha"),
         ("vanilla", "alpha"), [DOMAIN]),
        ("iterate ablation collapses in accuracy (vs default arm)", "collapses", "accuracy",
         ("ablation-iterate", "alpha"), (default, "alpha"), [DOMAIN]),
        ("regularization ablation collapses in accuracy (vs default arm)", "collapses",
         "accuracy", ("ablation-regularization", "alpha"), (default, "alpha"), [DOMAIN]),
        # the scalar ablation's one temperature collapsed high (τ ≈ 6.5, which TS undoes):
        # without TS this compares against a collapsed scalar, with TS on both it compares
        # what per-vocabulary α adds beyond one temperature
        ("OOD ECE below the scalar ablation (no TS; its one learned τ collapsed high)",
         "ece", "ece", (default, "alpha"), ("ablation-scalar", "alpha"), ood),
        ("per-vocabulary α beats one learned temperature, TS on both: OOD ECE below the "
         "scalar ablation", "ece", "ece", (default, "alpha+ts"), ("ablation-scalar",
                                                                   "alpha+ts"), ood),
        # CFT's primary comparator: cross-entropy plus the calibration term (the published
        # form), with and without TS
        ("OOD conf-ECE below CFT (CE + calibration term)", "ece", "ece", (default, "alpha"),
         ("cft-ce", "alpha"), ood),
        ("OOD conf-ECE below CFT (CE + calibration term), TS on both", "ece", "ece",
         (default, "alpha+ts"), ("cft-ce", "alpha+ts"), ood),
        ("OOD conf-ECE below CFT (calibration loss alone)", "ece", "ece", (default, "alpha"),
         ("cft", "alpha"), ood),
        ("OOD conf-ECE below CFT (calibration loss alone), TS on both", "ece", "ece",
         (default, "alpha+ts"), ("cft", "alpha+ts"), ood),
        ("accuracy kept out of domain (vs CFT, calibration loss alone)", "kept", "accuracy",
         (default, "alpha"), ("cft", "alpha"), ood),
        # "CALM is the only training-time method that improves both in domain": CFT's rows
        ("in domain: CFT (calibration loss alone) ECE below vanilla", "ece", "ece",
         ("cft", "alpha"), ("vanilla", "alpha"), [DOMAIN]),
        ("in domain: CFT (calibration loss alone) accuracy kept vs vanilla", "kept",
         "accuracy", ("cft", "alpha"), ("vanilla", "alpha"), [DOMAIN]),
        *round_two(ood),
        *round_three(ood),
    ]
    out = []
    for text, kind, metric, (arm_a, var_a), (arm_b, var_b), sets in specs:
        row = {"claim": text, "kind": kind, "metric": metric, "arm": f"{arm_a}/{var_a}",
               "comparator": f"{arm_b}/{var_b}", "sets": sets}
        a = side(arm_a, var_a, sets) if arm_a and sets else []
        b = side(arm_b, var_b, sets) if arm_b and sets else []
        if not a or not b:
            out.append({**row, "verdict": "not run"})
            continue
        if _identical(a, b):  # e.g. the gate wrote the identity: nothing to compare
            out.append({**row, "verdict": "n/a (identical readings)", "seeds": [len(a), len(b)],
                        "n": int(sum(a[0][s]["conf"].size for s in sets))})
            continue
        d = paired_delta(a, b, sets, metric, n_boot, bins)
        out.append({**row, **d, "verdict": verdict(kind, *d["ci"])})
    return out


def _identical(a: list[dict], b: list[dict]) -> bool:
    """Whether two sides hold the same per-question arrays, seed by seed."""
    return len(a) == len(b) and all(
        np.array_equal(x[s][k], y[s][k]) for x, y in zip(a, b, strict=True) for s in x
        for k in ("conf", "correct", "nll"))


def round_two(ood: list[str]) -> list[tuple]:
    """The second round's claims: for each new arm, α's own share as trained (before the
    gate) on ECE, NLL and accuracy, and the shipped adapter's (after the gate) on NLL."""
    specs = []
    for arm in ROUND2_ARMS:
        specs += [
            (f"{arm}: α's own share (as trained), OOD ECE below the same θ without α", "ece",
             "ece", (arm, "trained-alpha"), (arm, "no-alpha"), ood),
            (f"{arm}: α's own share (as trained), OOD NLL below the same θ without α", "nll",
             "nll", (arm, "trained-alpha"), (arm, "no-alpha"), ood),
            (f"{arm}: α (as trained) keeps OOD accuracy", "kept", "accuracy",
             (arm, "trained-alpha"), (arm, "no-alpha"), ood),
            (f"{arm}: the written adapter's α does not raise OOD NLL (by {NLL_MARGIN})",
             "no-harm", "nll", (arm, "alpha"), (arm, "no-alpha"), ood),
            (f"{arm}: in domain, α's own share (as trained), NLL below the same θ without α",
             "nll", "nll", (arm, "trained-alpha"), (arm, "no-alpha"), [DOMAIN])]
    # α's share read a second way: against a θ trained without α at all (the same settings
    # and held-out questions, α frozen), so that θ's training with α is part of what is read
    arm, control = ROUND2_ARMS[0], (ROUND2_CONTROL, "alpha")
    specs += [
        (f"{arm} (as trained) against θ trained without α ({ROUND2_CONTROL}): OOD ECE below",
         "ece", "ece", (arm, "trained-alpha"), control, ood),
        (f"{arm} (as trained) against θ trained without α ({ROUND2_CONTROL}): OOD NLL below",
         "nll", "nll", (arm, "trained-alpha"), control, ood),
        (f"{arm} (as trained) against θ trained without α ({ROUND2_CONTROL}): OOD accuracy "
         "kept", "kept", "accuracy", (arm, "trained-alpha"), control, ood),
        (f"{arm} (as written) against θ trained without α ({ROUND2_CONTROL}): OOD NLL not "
         f"raised (by {NLL_MARGIN})", "no-harm", "nll", (arm, "alpha"), control, ood)]
    return specs


#: the third round's readings of a `calm train` run, in the order its parts are added
ROUND3_READINGS = (("vanilla", "alpha", "vanilla (the model as given)"),
                   (SHIPPED, "no-alpha", "LoRA alone"),
                   (SHIPPED, "alpha", "LoRA + gated α"),
                   (SHIPPED, "alpha+daca", "LoRA + gated α + DACA T (what `calm train` writes)"),
                   (SHIPPED, "no-alpha+ts", "LoRA + labeled TS (in-domain labels)"))


def round_three(ood: list[str]) -> list[tuple]:
    """The third round's claims: what `calm train`'s output (LoRA, gated α, DACA T against
    the model before the LoRA) does out of domain against the model it was given and against
    each of its parts."""
    arm, written = SHIPPED, (SHIPPED, "alpha+daca")
    return [
        (f"{arm}: the written adapter's OOD ECE below vanilla", "ece", "ece", written,
         ("vanilla", "alpha"), ood),
        (f"{arm}: the written adapter's OOD ECE below LoRA alone", "ece", "ece", written,
         (arm, "no-alpha"), ood),
        (f"{arm}: the written adapter's OOD ECE below LoRA + labeled TS", "ece", "ece", written,
         (arm, "no-alpha+ts"), ood),
        (f"{arm}: LoRA alone, OOD ECE below vanilla", "ece", "ece", (arm, "no-alpha"),
         ("vanilla", "alpha"), ood),
        (f"{arm}: gated α's own share, OOD ECE below LoRA alone", "ece", "ece", (arm, "alpha"),
         (arm, "no-alpha"), ood),
        (f"{arm}: the written adapter keeps OOD accuracy (vs vanilla)", "kept", "accuracy",
         written, ("vanilla", "alpha"), ood),
        (f"{arm}: in domain, the written adapter's ECE below vanilla", "ece", "ece", written,
         ("vanilla", "alpha"), [DOMAIN])]
