"""The CALM replication benchmark's report: the result schema, near-chance flags, the choice
of the default arm and the generated README block, on synthetic per-direction results."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench(benchmark_scripts):
    with benchmark_scripts("calm_replication") as module:
        yield module


def _probs(accuracy: float, confidence: float, n: int = 200, seed: int = 0):
    """``[n, 4]`` probabilities whose argmax is right for ``accuracy`` of the rows."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 4, n)
    correct = np.arange(n) < round(accuracy * n)
    top = np.where(correct, labels, (labels + 1) % 4)
    probs = np.full((n, 4), (1 - confidence) / 3)
    probs[np.arange(n), top] = confidence
    return probs, labels


def _part(bench, direction, arms):
    args = bench.parse_args(["--direction", direction, "--bootstrap", "20"])
    rows = []
    for method, (acc, conf) in arms.items():
        for eval_set in bench.SETS:
            a = acc if eval_set == direction else 0.26 if eval_set == "mmlu" else acc - 0.1
            probs, labels = _probs(a, conf)
            rows.append(bench._row(direction, method, eval_set, True, probs, labels,
                                   np.full(200, 2.5), args))
    runs = {m: {"steps": 40, "seconds": 100.0, "last": {"f": -1.0, "g": 2.0, "q": 0.1},
                "q_growth_warnings": 0} for m in arms if m in bench.ARMS}
    return {"command": f"python benchmarks/calm_replication.py --direction {direction}",
            "commit": "abc1234", "direction": direction, "eta": {"eta": 0.5, "probe": []},
            "runs": runs, "rows": rows, "wall_s": 1.0}


def test_report_schema_default_and_readme_block(bench, tmp_path):
    arms = {"vanilla": (0.45, 0.7), "vanilla+ts": (0.45, 0.5), "lora": (0.70, 0.9),
            "lora+ts": (0.70, 0.72), "calm-adam-vocab": (0.55, 0.6),
            "calm-sgd-options": (0.69, 0.74), "calm-sgd-vocab": (0.71, 0.95),
            "calm-bome-options-alpha": (0.69, 0.78)}
    parts = tmp_path / "calm_replication.parts"
    parts.mkdir()
    for direction in ("arc-easy", "sciq"):
        (parts / f"{direction}.json").write_text(json.dumps(_part(bench, direction, arms)))
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{bench.README_START}\nstale text\n{bench.README_END}\noutro\n")
    assert bench.main(["--report", "--out", str(tmp_path), "--readme", str(readme)]) == 0

    payload = json.loads((tmp_path / "calm_replication.json").read_text())
    assert set(payload) >= {"command", "commit", "default_method", "rows"}
    keys = {"direction", "method", "eval_set", "in_domain", "with_alpha", "accuracy", "ece",
            "ece_ci", "mean_confidence", "near_chance", "answer_vocab_entropy"}
    assert all(keys <= set(r) for r in payload["rows"])
    # calm-sgd-options is better calibrated, but SGD with momentum is not BOME's step: the
    # momentum-free arm that keeps LoRA's accuracy wins
    assert payload["default_method"] == "calm-bome-options-alpha"
    assert payload["default_reason"].startswith("the BOME-faithful arm (plain SGD, no momentum)")
    mmlu = [r for r in payload["rows"] if r["eval_set"] == "mmlu"]
    assert all(r["near_chance"] for r in mmlu)  # 0.26 accuracy over 4 options
    assert not any(r["near_chance"] for r in payload["rows"] if r["eval_set"] != "mmlu")
    first = payload["rows"][0]
    assert first["ece_ci"][0] <= first["ece"] <= first["ece_ci"][1]
    assert first["in_domain"] == (first["eval_set"] == first["direction"])

    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith("outro\n") and "stale text" not in text
    block = text.split(bench.README_START)[1].split(bench.README_END)[0]
    assert "calm-bome-options-alpha" in block and "mmlu" not in block.split("claims")[0]
    assert "keeps accuracy: holds" in block
    assert (tmp_path / "calm_replication.md").read_text().count("trained on") >= 2


def test_report_needs_results(bench, tmp_path, capsys):
    assert bench.main(["--report", "--out", str(tmp_path), "--readme", str(tmp_path / "R")]) == 1
    assert "run --direction first" in capsys.readouterr().err


def test_default_falls_back_to_an_arm_that_keeps_accuracy(bench):
    args = bench.parse_args(["--direction", "sciq", "--bootstrap", "10"])
    rows = []
    for method, acc, conf in (("lora", 0.70, 0.9), ("calm-sgd-options", 0.60, 0.6),
                              ("calm-adam-options-alpha", 0.71, 0.75),
                              ("calm-adam-vocab", 0.72, 0.72)):
        probs, labels = _probs(acc, conf)
        rows.append(bench._row("sciq", method, "sciq", True, probs, labels, None, args))
    runs = dict.fromkeys(["lora", "calm-sgd-options", "calm-adam-options-alpha",
                          "calm-adam-vocab"], {})
    arm, reason = bench.pick_default(rows, runs)
    assert arm == "calm-adam-options-alpha"  # calm-adam-vocab is never the default
    assert reason.startswith("no BOME-faithful")
    rows = [r for r in rows if r["method"] != "calm-adam-options-alpha"]
    runs.pop("calm-adam-options-alpha")
    arm, reason = bench.pick_default(rows, runs)
    assert arm == "calm-sgd-options" and reason.startswith("no arm kept")


def test_add_merges_arms_into_a_direction(bench):
    """``--add`` replaces the added arms' runs and rows (every row kind of the arm) and keeps
    the others, the vanilla rows, both commands and both commits."""
    old = _part(bench, "sciq", {"vanilla": (0.45, 0.7), "vanilla+ts": (0.45, 0.5),
                                "lora": (0.7, 0.9), "calm-bome-options-alpha": (0.3, 0.9),
                                "calm-bome-options-alpha/no-alpha+ts": (0.3, 0.9),
                                "base+alpha-of-calm-bome-options-alpha": (0.4, 0.7)})
    new = _part(bench, "sciq", {"calm-bome-options-alpha": (0.69, 0.75)})
    new.update(commit="def5678", command="python benchmarks/calm_replication.py --add",
               lr_probes={"calm-bome-options-alpha": {"lr": 0.1, "probe": []}},
               date="today")
    merged = bench.merge_parts(old, new)
    methods = [r["method"] for r in merged["rows"]]
    assert methods.count("calm-bome-options-alpha") == len(bench.SETS)
    assert "calm-bome-options-alpha/no-alpha+ts" not in methods
    assert "base+alpha-of-calm-bome-options-alpha" not in methods
    assert {"vanilla", "vanilla+ts", "lora"} <= set(methods)
    accs = {r["accuracy"] for r in merged["rows"] if r["method"] == "calm-bome-options-alpha"
            and r["in_domain"]}
    assert accs == {0.69}
    assert merged["commit"] == "abc1234,def5678" and " && " in merged["command"]
    assert set(merged["runs"]) == {"lora", "calm-bome-options-alpha"}
    assert merged["lr_probes"]["calm-bome-options-alpha"]["lr"] == 0.1


def test_calm_train_defaults_are_the_committed_default_arm(bench):
    """``calm train``'s defaults are the settings of the arm the committed replication chose
    (its learning rate: the smallest the probes chose), and plain ``lora`` keeps Adam."""
    from calm_training.methods.calm.config import CalmConfig

    result = json.loads((BENCHMARKS / "results" / "calm_replication.json").read_text())
    arm = result["default_method"]
    settings = {**bench.COMMON, **bench.ARMS[arm]}
    config = CalmConfig(model="m", train=("arc-easy:train",), calibration=("arc-easy:unlabeled",))
    # the inner solver is the decisive experiment's choice since (test_calm_decisive.py)
    for name in ("method", "optimizer", "momentum", "entropy", "upper_params", "alpha_tokens",
                 "cloze_variant", "lora_rank", "batch_size"):
        if name in settings:
            assert getattr(config, name) == settings[name], name
    if arm in bench.PROBE_LR:
        chosen = [d["lr_probes"][arm]["lr"] for d in result["directions"].values()]
        assert config.theta_lr == min(chosen)
        assert config.alpha_step_lr == pytest.approx(min(chosen) * bench.ALPHA_LR_RATIO)
    assert config.warm_steps == config.steps // 2
    assert CalmConfig(model="m", train=("a:train",), calibration=("a:unlabeled",),
                      method="lora").optimizer == "adam"
