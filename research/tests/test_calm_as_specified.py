"""The experiment's rules on made-up readings: the go/no-go rule, the verdicts, the paired
interval, and the report that decides `calm train`'s default."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pytest

# research/'s scripts are not a package: imported from their folder
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import calm_as_specified as exp  # noqa: E402


def _probs(n: int, confidence: float, accuracy: float, k: int = 4, seed: int = 0):
    """``n`` questions answered with ``confidence`` on the first option, right on a share
    ``accuracy`` of them (label 0), else label 1."""
    rng = np.random.default_rng(seed)
    rest = (1 - confidence) / (k - 1)
    probs = [[confidence] + [rest] * (k - 1) for _ in range(n)]
    labels = [0 if rng.random() < accuracy else 1 for _ in range(n)]
    return probs, labels


def _entry(readings: dict, labels, chance=0.25):
    return {"labels": labels, "chance": chance, "readings": readings}


def _selection(over_sets: set[str], n=120, seed=0):
    """vanilla and three LoRA seeds on the selection questions: the LoRA confident (0.9) and
    right half the time on ``over_sets``, calibrated (0.5) elsewhere."""
    vanilla = {"stages": {"selection": {}}}
    loras = {f"lora-s{s}": {"stages": {"selection": {}}} for s in exp.SEEDS}
    for i, name in enumerate(exp.OOD_SETS):
        probs, labels = _probs(n, 0.5, 0.5, seed=seed + i)
        vanilla["stages"]["selection"][name] = _entry({"vanilla": probs, "vanilla+ts": probs},
                                                      labels)
        for s in exp.SEEDS:
            lp, _ = _probs(n, 0.9 if name in over_sets else 0.5, 0.5, seed=seed + i)
            loras[f"lora-s{s}"]["stages"]["selection"][name] = _entry(
                {"lora": lp, "lora+ts": lp}, labels)
    return {"vanilla": vanilla, **loras}


def test_go_needs_two_sets_where_the_lora_is_over_confident():
    decision = exp.decide(_selection({"arc-easy", "hellaswag"}), n_boot=200)
    assert decision["go"] and decision["regime"] == ["arc-easy", "hellaswag"]
    assert exp.decide(_selection({"arc-easy"}), n_boot=200)["go"] is False


def test_a_set_where_vanilla_is_near_chance_is_never_in_the_regime():
    parts = _selection({"arc-easy", "hellaswag", "copa"})
    for entry in parts["vanilla"]["stages"]["selection"].values():
        entry["chance"] = 0.48  # vanilla's 0.5 accuracy is within 0.05 of it
    decision = exp.decide(parts, n_boot=200)
    assert decision["regime"] == [] and not decision["go"]
    assert all(not r["above_chance"] for r in decision["sets"].values())


@pytest.mark.parametrize(("metric", "lo", "hi", "said"), [
    ("ece", -0.05, -0.02, "holds"), ("ece", -0.005, 0.004, "refuted"),
    ("ece", 0.001, 0.03, "refuted"), ("ece", -0.05, 0.01, "inconclusive"),
    ("accuracy", -0.02, 0.01, "kept"), ("accuracy", -0.08, -0.04, "lost"),
    ("accuracy", -0.05, 0.0, "inconclusive"), ("nll", -0.1, 0.01, "kept"),
    ("nll", 0.03, 0.1, "lost")])
def test_verdicts(metric, lo, hi, said):
    assert exp.verdict(metric, lo, hi) == said


def test_the_paired_interval_finds_a_real_difference_and_not_an_absent_one():
    rng = np.random.default_rng(1)
    labels = list(rng.integers(0, 2, 300))
    right = [[0.6, 0.4] if y == 0 else [0.4, 0.6] for y in labels]
    sure = [[0.99, 0.01] if y == 0 else [0.01, 0.99] for y in labels]
    a = [{"s": exp.per_question(right, labels)}] * 3
    b = [{"s": exp.per_question(sure, labels)}] * 3
    d = exp.paired_delta(a, b, ["s"], "nll", 300)
    assert d["ci"][0] > 0  # the sharper right answers (b) have the lower NLL
    same = exp.paired_delta(a, a, ["s"], "ece", 300)
    assert same["delta"] == 0 and same["ci"] == [0.0, 0.0]


def test_the_report_decides_the_default_by_the_written_rule(tmp_path):
    """A full set of parts where CALM as specified lowers out-of-domain ECE against the
    LoRA and the LoRA with TS without costing accuracy: the report says the default
    changes, and writes its block into the results page."""
    args = argparse.Namespace(command="python research/calm_as_specified.py", commit="abc",
                              bootstrap=200, out=str(tmp_path), smoke=False)
    parts = exp.Parts(tmp_path / "parts", args)
    selection = _selection({"arc-easy", "hellaswag"})
    n = 200

    def stage(sets, readings_of, seed):
        out = {}
        for i, name in enumerate(sets):
            probs, labels = _probs(n, 0.5, 0.5, seed=seed + i)
            out[name] = _entry({r: _probs(n, c, 0.5, seed=seed + i)[0]
                                for r, c in readings_of.items()}, labels)
        return out
    regime, domain = ["arc-easy", "hellaswag"], list(exp.TRAIN_SETS)
    vanilla = selection["vanilla"]
    vanilla["stages"]["test"] = stage(regime, {"vanilla": 0.7, "vanilla+ts": 0.55}, 10)
    vanilla["stages"]["domain"] = stage(domain, {"vanilla": 0.6, "vanilla+ts": 0.5}, 20)
    parts.put("vanilla", vanilla)
    for s in exp.SEEDS:
        lora = selection[f"lora-s{s}"]
        lora["stages"]["test"] = stage(regime, {"lora": 0.9, "lora+ts": 0.75}, 10)
        lora["stages"]["domain"] = stage(domain, {"lora": 0.6, "lora+ts": 0.55}, 20)
        parts.put(f"r1-lora-s{s}", lora)
        parts.put(f"r1-calm-s{s}", {"stages": {
            "test": stage(regime, {"calm": 0.52, "calm-theta": 0.9}, 10),
            "domain": stage(domain, {"calm": 0.55, "calm-theta": 0.6}, 20)}})
    parts.put("r1-decision", exp.decide(exp.load(parts, 1), 200))
    doc = tmp_path / "results.md"
    doc.write_text(f"# R\n\n{exp.BLOCK_START}\nOLD-BLOCK\n{exp.BLOCK_END}\n\nafter\n")
    payload = exp.build(parts, 200)
    assert payload["go"] and payload["complete"] and payload["default_changes"]
    said = {(c["metric"], c["b"]): c["verdict"] for c in payload["claims"]}
    assert said[("ece", "lora")] == "holds" and said[("ece", "calm-theta")] == "holds"
    text = exp.render({"command": "c", "commit": "abc", "run_commands": ["r"], **payload})
    assert "it becomes `calm train`'s default" in text
    assert exp.write_block(doc, text)
    page = doc.read_text()
    assert "OLD-BLOCK" not in page and "#### The claims" in page and page.endswith("after\n")
    json.dumps(payload)  # the result file is plain JSON
    sentences = exp.readme_sentences(payload)
    assert sentences.count(". ") <= 2 and "so it is the default" in sentences
    assert f"{payload['claims'][0]['delta']:+.3f}" in sentences
