"""The decisive CALM benchmark's decision machinery on synthetic runs: the gate's binomial
test, the paired bootstrap, the verdict rule written before the runs, and the report."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest


@pytest.fixture(scope="module")
def bench(benchmark_scripts):
    """The experiment's modules (design, statistics, report and the script) as one namespace:
    each test reads a name wherever it lives."""
    from types import SimpleNamespace

    names = ("_decisive_design", "_decisive_stats", "_decisive_report", "calm_decisive")
    with benchmark_scripts(*names) as modules:
        merged = {}
        for name in names:
            merged |= {k: v for k, v in vars(modules[name]).items() if not k.startswith("__")}
        yield SimpleNamespace(**merged)


def _questions(n, accuracy, confidence, seed):
    """Per-question records of a model right on ``accuracy`` of ``n`` questions that says
    ``confidence`` (± noise)."""
    rng = np.random.default_rng(seed)
    correct = (rng.random(n) < accuracy).astype(int)
    conf = np.clip(confidence + 0.02 * rng.standard_normal(n), 0.26, 0.999)
    p_true = np.where(correct == 1, conf, (1 - conf) / 3)
    return {"conf": conf.tolist(), "correct": correct.tolist(),
            "nll": (-np.log(p_true)).tolist(), "brier": ((1 - p_true) ** 2).tolist()}


def _part(bench, arm, seed, confidence, accuracy=0.6, variants=("alpha", "alpha+ts")):
    sets = {}
    for i, name in enumerate((bench.DOMAIN, *bench.OOD)):
        out = {}
        for j, variant in enumerate(variants):
            q = _questions(400, accuracy, confidence, seed * 100 + i * 10 + j)
            out[variant] = {"summary": bench.summary(q, 4, 0.25, 10, 20), "questions": q}
        sets[name] = {"in_domain": name == bench.DOMAIN, "k": 4, "chance": 0.25,
                      "variants": out}
    return {"arm": arm, "seed": seed, "commit": "abc1234", "command": "python x",
            "validation_nll": {"alpha": 1.0}, "sets": sets}


def test_binomial_p_value_and_verdicts(bench):
    assert bench.binomial_p_above(5, 10, 0.25) == pytest.approx(0.0781269, abs=1e-6)
    assert bench.binomial_p_above(0, 10, 0.25) == pytest.approx(1.0)
    # ECE: below 0 holds; above 0 or inside ±0.01 is refuted; straddling is inconclusive
    assert bench.verdict("ece", -0.05, -0.02) == "holds"
    assert bench.verdict("ece", 0.01, 0.04) == "refuted"
    assert bench.verdict("ece", -0.008, 0.006) == "refuted"
    assert bench.verdict("ece", -0.04, 0.02) == "inconclusive"
    # accuracy kept: non-inferiority at −3 points
    assert bench.verdict("kept", -0.02, 0.01) == "holds"
    assert bench.verdict("kept", -0.09, -0.04) == "refuted"
    assert bench.verdict("kept", -0.05, 0.01) == "inconclusive"
    # an ablation collapses: it loses more than 3 points
    assert bench.verdict("collapses", -0.2, -0.05) == "holds"
    assert bench.verdict("collapses", -0.02, 0.03) == "refuted"


def test_paired_bootstrap_separates_a_real_difference_from_none(bench):
    calibrated = [{s: {k: np.asarray(v, float) for k, v in
                       _questions(500, 0.6, 0.6, seed).items()} for s in ("a", "b")}
                  for seed in range(3)]
    overconfident = [{s: {k: np.asarray(v, float) for k, v in
                          _questions(500, 0.6, 0.9, 10 + seed).items()} for s in ("a", "b")}
                     for seed in range(3)]
    d = bench.paired_delta(calibrated, overconfident, ["a", "b"], "ece", 300)
    assert d["delta"] < -0.2 and d["ci"][1] < 0 and d["seeds"] == [3, 3] and d["n"] == 1000
    same = bench.paired_delta(calibrated, calibrated, ["a", "b"], "ece", 100)
    assert same["delta"] == 0 and same["ci"] == [0.0, 0.0]
    assert bench.verdict("ece", *same["ci"]) == "refuted"  # equivalent: no improvement
    # a one-seed comparator is used in every resample
    one = bench.paired_delta(calibrated, overconfident[:1], ["a"], "accuracy", 100)
    assert one["seeds"] == [3, 1] and math.isfinite(one["delta"])


def test_report_gives_every_claim_a_verdict_or_not_run(bench, tmp_path):
    parts = tmp_path / "calm_decisive.parts"
    parts.mkdir()
    gate = {"mode": "cloze", "alpha_tokens": "options", "alpha_lr": 0.2, "alpha_moves": True,
            "entropy_gate": 0.05, "base_entropy": 1.2, "probe_steps": 10, "commit": "abc1234",
            "command": "python gate", "probes": [
                {"alpha_lr": 0.2, "entropy_change": 0.07, "tau_range": [0.9, 1.1],
                 "shift_range": [-0.01, 0.01]}],
            "letter": {"accuracy": 0.27, "n": 150, "p_value": 0.3}}
    runs = {"gate": gate, "default": {"arm": "calm-bome-all", "rule": "lowest NLL",
                                      "validation_nll": {"calm-bome-all": 1.0}},
            "vanilla": _part(bench, "vanilla", 0, 0.9)}
    for seed in bench.SEEDS:
        runs[f"calm-bome-all-s{seed}"] = _part(bench, "calm-bome-all", seed, 0.6,
                                               variants=("alpha", "alpha+ts", "no-alpha",
                                                         "no-alpha+ts"))
        runs[f"lora-matched-s{seed}"] = _part(bench, "lora-matched", seed, 0.8)
    # a CFT run (one seed): its claims are decided, its bins and loss terms reported
    runs["cft-s0"] = {**_part(bench, "cft", 0, 0.7),
                      "settings": {"cft_weight": 1.0, "cft_scale": 1e-3, "outer_lr": 1e-3},
                      "cft_bins": {"accuracy": [0.0] * 3 + [0.4] + [0.0] * 6,
                                   "count": [0] * 3 + [12] + [0] * 6},
                      "last": {"cft_ce": 1.25, "cft_l_cal": 0.05}}
    # a run that diverged is recorded without results; the gate's own pieces are not runs
    runs["ablation-regularization-s0"] = {"arm": "ablation-regularization", "seed": 0,
                                          "commit": "abc1234", "command": "python x",
                                          "diverged": "step 30: f is nan"}
    runs["gate-probe-2"] = {"alpha_lr": 2.0, "diverged": "step 30: f is nan",
                            "commit": "abc1234", "command": "python x"}
    # CFT's learning rate chosen on the validation split from its seed-0 probes (the probes
    # exist, so nothing is trained): the lowest NLL wins, a diverged rate is left out, and a
    # rate at the grid's edge (3e-4) extends the grid past it (1e-4) until it is inside
    for lr, nll in ((1e-4, 1.3), (3e-4, 1.2), (1e-3, 1.7), (3e-3, None)):
        for arm in bench.CFT_ARMS:
            probe = {"arm": arm, "outer_lr": lr, "commit": "abc1234", "command": "python x"}
            probe |= {"validation_nll": nll} if nll is not None else {"diverged": "nan"}
            (parts / f"gate-cft-lr-{arm}-{lr:g}.json").write_text(json.dumps(probe))
    # the third round: `calm train` as users run it; its written adapter (0.6 confidence at
    # 0.6 accuracy) against the over-confident vanilla (0.9)
    for seed in bench.SEEDS:
        run = _part(bench, bench.SHIPPED, seed, 0.6,
                    variants=("alpha", "alpha+ts", "no-alpha", "no-alpha+ts", "alpha+daca",
                              "alpha+daca+ts"))
        run |= {"daca": {"fitted": True, "answer_temperature": 1.7, "temperature": 1.1,
                         "fit": {"agreement_rate": 0.71}},
                "alpha_gate": {"kept": False},
                "holdout_parts": {"n": 30, "parts": {
                    k: {"accuracy": 0.5, "ece": 0.1, "nll": 1.0} for k in
                    ("base", "lora", "lora+alpha", "lora+alpha+T")}}}
        runs[f"{bench.SHIPPED}-s{seed}"] = run
    # the second round's arm against its α-frozen control (θ trained without α)
    for seed in bench.SEEDS:
        runs[f"calm-centred-s{seed}"] = _part(bench, "calm-centred", seed, 0.6, variants=(
            "alpha", "alpha+ts", "no-alpha", "no-alpha+ts", "trained-alpha", "trained-alpha+ts"))
        runs[f"{bench.ROUND2_CONTROL}-s{seed}"] = _part(bench, bench.ROUND2_CONTROL, seed, 0.8)
    # a letter gate with the letters the LoRA answered: one letter always
    (parts / "gate-letter.json").write_text(json.dumps({
        "model": "smollm2-135m-instruct", "accuracy": 0.25, "n": 8, "p_value": 0.6,
        "settings": {"steps": 40, "outer_lr": 1e-3}, "predicted_letters": [8, 0, 0, 0],
        "label_letters": [2, 2, 2, 2], "commit": "abc1234", "command": "python x"}))
    for name, part in runs.items():
        (parts / f"{name}.json").write_text(json.dumps(part))
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{bench.README_START}\nPLACEHOLDER\n{bench.README_END}\nrest\n")
    args = bench.parse_args(["--report", "--out", str(tmp_path), "--readme", str(readme),
                             "--decision-bootstrap", "200"])
    chosen = bench.choose_cft_lr(args, gate)
    assert {a: c["outer_lr"] for a, c in chosen["arms"].items()} == {"cft": 3e-4, "cft-ce": 3e-4}
    assert chosen["arms"]["cft"]["grid"] == [1e-4, 3e-4, 1e-3, 3e-3]
    assert not chosen["arms"]["cft"]["at_edge"]
    assert bench.report(args) == 0
    payload = json.loads((tmp_path / "calm_decisive.json").read_text())
    verdicts = {c["claim"]: c["verdict"] for c in payload["claims"]}
    assert verdicts["OOD conf-ECE below lora-matched (no TS)"] == "holds"
    assert verdicts["OOD conf-ECE below vanilla, TS on both"] in ("holds", "refuted",
                                                                  "inconclusive")
    assert verdicts["calm-centred-daca: α (as trained) keeps OOD accuracy"] == "not run"
    assert verdicts["iterate ablation collapses in accuracy (vs default arm)"] == "not run"
    assert verdicts["regularization ablation collapses in accuracy (vs default arm)"] == \
        "not run"
    assert payload["diverged"] == {"ablation-regularization-s0": "step 30: f is nan"}
    assert "gate-probe-2" not in payload["runs"]
    assert verdicts["OOD conf-ECE below CFT (calibration loss alone)"] != "not run"
    assert verdicts["OOD conf-ECE below CFT (CE + calibration term)"] == "not run"
    cft = next(c for c in payload["claims"]
               if c["claim"] == "OOD conf-ECE below CFT (calibration loss alone)")
    assert cft["seeds"] == [3, 1] and cft["delta"] < 0  # 0.6 vs 0.7 confidence at 0.6 acc
    assert set(verdicts.values()) <= {"holds", "refuted", "inconclusive", "not run"}
    shipped = next(c for c in payload["claims"]
                   if c["claim"] == f"{bench.SHIPPED}: the written adapter's OOD ECE below vanilla")
    assert shipped["arm"] == f"{bench.SHIPPED}/alpha+daca" and shipped["seeds"] == [3, 1]
    assert shipped["verdict"] == "holds" and shipped["delta"] < 0
    md = (tmp_path / "calm_decisive.md").read_text()
    assert "LoRA + gated α + DACA T (what `calm train` writes) | 3 |" in md
    assert f"| {bench.SHIPPED}-s0 | no | 1.700 | 1.100 | 0.710 |" in md
    assert "ablation-iterate:0" in md and "Decision rule" in md
    control = (f"calm-centred (as trained) against θ trained without α "
               f"({bench.ROUND2_CONTROL}): OOD ECE below")
    assert verdicts[control] == "holds"
    assert "letters answered: A 8, B 0, C 0, D 0 (right letters: A 2, B 2, C 2, D 2)" in md
    assert "ablation-regularization:0" not in md.split("Runs not yet made")[1].split("\n")[0]
    assert "Diverged (no results" in md
    assert "- cft: validation NLL by learning rate (0.0001: 1.3000, 0.0003: 1.2000, 0.001: " \
        "1.7000, 0.003: " \
        "diverged); chosen 0.0003; its runs used 0.001: they are to be rerun" in md
    cft_row = md.split("## CFT runs")[1].split("| cft-s0 |")[1].split("\n")[0]
    assert "0.3: 0.40/12" in cft_row and "| 0 | 5e-05 |" in cft_row  # (1 − w)·CE, w·c·L_cal
    text = readme.read_text()
    assert "PLACEHOLDER" not in text and "calm-bome-all" in text and text.endswith("rest\n")


def test_train_help_holds_no_measured_number(capsys):
    """``calm train --help`` says what the options do and points to the docs; measured
    numbers live in the result files and docs/results.md, never in the help (a number there
    goes stale when a rerun changes it, and described another configuration than the shipped
    one)."""
    import re

    from calm_runtime.cli.main import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "docs/results.md" in text
    assert not re.search(r"[-+]?\d\.\d+ \[[-+]?\d\.\d+, [-+]?\d\.\d+\]", text)  # intervals
    assert "calm_decisive" not in text and "nats" not in text
